"""Wall time of difftrain's console commands that answer without training (``plan``, ``plan --vram``, a usage
error), each in a fresh process as a user runs it, and whether their output is the same in two checkouts.

Usage (from the repository root, in the dev environment):

    python benchmarks/cli_times.py [--repeat 3] [--root CHECKOUT] [--json out.json]

``--root`` runs another checkout's code (``python -m difftrain`` with ``ROOT/src`` first on PYTHONPATH), e.g. a
worktree of an earlier commit; the figures are the median of ``--repeat`` runs. The output of each command is
hashed so that two checkouts can be compared (the same plan, byte for byte).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "version": ["--version"],
    "plan sdxl-lora-8gb": ["plan", "--recipe", "sdxl-lora-8gb"],
    "plan sdxl-lora-8gb --vram 8gb": ["plan", "--recipe", "sdxl-lora-8gb", "--vram", "8gb"],
    "plan sd3-lora-8gb --vram 8gb": ["plan", "--recipe", "sd3-lora-8gb", "--vram", "8gb"],
    "plan sdxl-full --gpus 2 --vram 24gb": ["plan", "--recipe", "sdxl-full", "--gpus", "2", "--vram", "24gb"],
    "usage error (unknown recipe)": ["train", "--recipe", "no-such-recipe"],
}


def run(root: Path, args: list[str]) -> tuple[float, int, str]:
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "COLUMNS": "200", "DIFFTRAIN_PROGRESS": "0"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, env=env, cwd=root)
    seconds = time.perf_counter() - t0
    return seconds, r.returncode, hashlib.sha256((r.stdout + r.stderr).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    root = args.root.resolve()
    out = {}
    for name, cmd in CASES.items():
        runs = [run(root, cmd) for _ in range(args.repeat)]
        out[name] = {
            "median_s": round(statistics.median(s for s, _, _ in runs), 2),
            "exit": runs[0][1],
            "output_sha256": runs[0][2],
            "same_output_each_run": len({h for _, _, h in runs}) == 1,
        }
        print(
            f"{name:40s} {out[name]['median_s']:7.2f} s  exit {out[name]['exit']}  output {out[name]['output_sha256']}"
        )
    if args.json:
        args.json.write_text(json.dumps({"root": str(root), "cases": out}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
