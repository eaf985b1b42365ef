"""Why fp8-stored weights made compiled + CUDA-graph steps several times slower on Flux (issue 27): the tiny seeded
Flux trained on the GPU with fp8 base weights, compiled, with and without CUDA graphs, under torch's cudagraphs and
perf-hint logs. Each case is its own process (a fresh compile state); the log lines that say a graph was recorded
or re-recorded, and why, are counted and kept.

    python benchmarks/fp8_graphs.py --out $OUT [--steps 12]

Writes $OUT/fp8_graphs.json and each case's log $OUT/<case>.log; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

CASES = {
    "bf16-graphs": ["memory.weights.kind=bf16", "speed.compile=true", "speed.cuda_graphs=true"],
    "fp8-graphs": ["memory.weights.kind=fp8", "speed.compile=true", "speed.cuda_graphs=true"],
    "fp8-compiled": ["memory.weights.kind=fp8", "speed.compile=true", "speed.cuda_graphs=false"],
    # the full-size recipes checkpoint; the tiny recipe does not
    "bf16-ckpt-graphs": [
        "memory.weights.kind=bf16",
        "memory.activations.kind=checkpoint",
        "speed.compile=true",
        "speed.cuda_graphs=true",
    ],
    "fp8-ckpt-graphs": [
        "memory.weights.kind=fp8",
        "memory.activations.kind=checkpoint",
        "speed.compile=true",
        "speed.cuda_graphs=true",
    ],
}

CHILD = r"""
import json, sys, time, torch
from pathlib import Path
from difftrain.config.load import resolve
from difftrain.families.registry import get_family
from difftrain.precompute.run import precompute
from difftrain.flows.quickstart import make_dataset
from difftrain.trainers.loop import Trainer
work, steps, sets = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = work / "tiny-flux"
if not model.exists():
    get_family("flux").build_tiny(model)
data = work / "images"
if not data.exists():
    make_dataset(data, n=8, seed=0)
base = [f"model.path={model}", f"data.dir={data}", f"data.cache_dir={work / 'cache'}",
        f"train.output_dir={work / 'run'}", f"train.device={dev}", f"precompute.device={dev}",
        "train.mixed_precision=bf16", f"train.max_steps={steps}", "train.checkpoint_every=100000",
        "report.to=[]", "data.resolution=256", "data.min_side=256", "data.max_side=256", "train.batch_size=1"]
cfg = resolve(recipe="tiny-flux-lora", sets=base + sets).config
precompute(cfg)
t = Trainer(cfg)
t0 = time.perf_counter()
r = t.run()
print("RESULT", json.dumps({"seconds": time.perf_counter() - t0, "losses": r.losses}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-fp8-graphs"))
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in a.cases.split(","):
        sets = CASES[name]
        env = dict(os.environ, TORCH_LOGS="perf_hints,cudagraphs,recompiles", DIFFTRAIN_PROGRESS="0")
        p = subprocess.run([sys.executable, "-c", CHILD, str(a.work), str(a.steps), *sets, f"train.output_dir={a.work / name}"],
                           capture_output=True, text=True, env=env, timeout=400)  # fmt: skip
        log = p.stdout + p.stderr
        (a.out / f"{name}.log").write_text(log)
        res = next((json.loads(x[7:]) for x in log.splitlines() if x.startswith("RESULT ")), {})
        rows[name] = {
            "rc": p.returncode,
            "seconds": res.get("seconds"),
            "recordings": len(re.findall(r"[Rr]ecording", log)),
            "rerecord": len(re.findall(r"re-?record", log)),
            "skipping": sorted(set(re.findall(r"skipping cudagraphs[^\n]*", log)))[:5],
            "reasons": sorted(set(re.findall(r"(?:data pointer|static input)[^\n]*", log)))[:10],
        }
    (a.out / "fp8_graphs.json").write_text(json.dumps(rows, indent=1))
    print("| case | rc | s | recording lines | re-record lines | skipping | reasons |")
    print("|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        s = f"{r['seconds']:.1f}" if r["seconds"] else ""
        print(f"| {n} | {r['rc']} | {s} | {r['recordings']} | {r['rerecord']} | {r['skipping']} | {r['reasons']} |")


if __name__ == "__main__":
    main()
