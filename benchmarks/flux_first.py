"""Flux.1 [dev] on a GPU, first figures (issue 27): LoRA r16 at 1024x1024, batch 2, on random weights of the bundled flux-dev
architecture (`difftrain bench memory`, which builds them once and a random cache of the real shapes), eager
(speed off), each case in its own process: peak allocated / reserved, s/step, and the planner's prediction.

    python benchmarks/flux_first.py --out $OUT [--cases bf16-ckpt,fp8-ckpt] [--steps 6]

The LoRA targets are the family's defaults (both streams' attention and MLPs of the 19 double blocks; the 38
single blocks' to_q/k/v, proj_mlp and proj_out). Writes $OUT/flux_first.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BASE = [
    "family=flux",
    "model.config=flux-dev",
    "data.resolution=1024",
    "data.min_side=512",
    "data.max_side=2048",
    "data.bucket_step=64",
    "text_encoders.t5.max_length=512",
    "lora.rank=16",
    "lora.alpha=16",
    "train.mixed_precision=bf16",
    # batch 2: the base recipe's (tiny-flux-lora), which the first figures ran with (docs/benchmarks.md; the Flux
    # recipes' card figures are batch 1)
    "train.batch_size=2",
    "train.device=cuda",
    "train.learning_rate=1e-4",
    "speed.compile=false",
    "report.to=[]",
    "report.html=false",
]
CASES = {
    "bf16-ckpt": ["memory.weights.kind=bf16", "memory.activations.kind=checkpoint"],
    "fp8-ckpt": ["memory.weights.kind=fp8", "memory.activations.kind=checkpoint"],
    # the same with flash attention named (auto took cuDNN's, whose backward failed on Flux's 4 608 tokens)
    "bf16-ckpt-flash": ["memory.weights.kind=bf16", "memory.activations.kind=checkpoint", "speed.attention=flash"],
    "fp8-ckpt-flash": ["memory.weights.kind=fp8", "memory.activations.kind=checkpoint", "speed.attention=flash"],
    "bf16-none": ["memory.weights.kind=bf16", "memory.activations.kind=none"],
    # speed auto as a user gets it (weighed against --planned-steps)
    "bf16-ckpt-auto": ["memory.weights.kind=bf16", "memory.activations.kind=checkpoint", "speed.compile=auto"],
}


def main() -> None:
    from difftrain.families.flux import Flux

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default="bf16-ckpt,fp8-ckpt")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--work", type=Path, default=Path("/tmp/flux-bench"))
    ap.add_argument("--planned-steps", type=int, default=None, help="passed to bench memory (speed auto)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    targets = "lora.targets=[" + ", ".join(Flux.default_lora_targets) + "]"
    rows = []
    for case in a.cases.split(","):
        sets = [*BASE, *CASES[case], targets]
        js = a.out / f"{case}.json"
        cmd = [sys.executable, "-m", "difftrain", "bench", "memory", "--recipe", "tiny-flux-lora"]
        cmd += [x for s in sets for x in ("--set", s)] + [
            "--steps",
            str(a.steps),
            "--work",
            str(a.work),
            "--json",
            str(js),
        ]
        t = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        (a.out / f"{case}.log").write_text(p.stdout + p.stderr)
        row = {"case": case, "rc": p.returncode, "wall_s": round(time.time() - t, 1)}
        if p.returncode == 0 and js.exists():
            row.update(json.loads(js.read_text()))
        else:
            row["error"] = (p.stderr or p.stdout)[-1500:]
        print(json.dumps(row)[:3000], flush=True)
        rows.append(row)
    (a.out / "flux_first.json").write_text(json.dumps(rows, indent=1))
    print("\ncase       rc  wall s  summary")
    for r in rows:
        keys = [k for k in r if any(w in k for w in ("peak", "s_per_step", "plan", "reserved"))]
        summary = {k: r[k] for k in keys[:8]}
        print(
            f"{r['case']:<10} {r['rc']:>2} {r['wall_s']:>7}  {summary if r['rc'] == 0 else r.get('error', '')[-300:]}"
        )


if __name__ == "__main__":
    main()
