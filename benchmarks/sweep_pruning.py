"""What pruning saves a sweep, and one sweep spread over several processes (issue 55).

A 16-trial SDXL LoRA sweep at 512 px on random weights of the real architecture (the model file as
benchmarks/multi_gpu.py makes it, a synthetic dataset of 16 images that the sweep's precompute encodes once):
learning rate 1e-5 .. 1e-2 (4 log-spaced points) x LoRA rank 4, 16, 32, 64, 48 steps each, eager, the held-out
loss on 2 items every 8 steps. Why so small: at 1024 px with speed auto, as sdxl-lora-8gb ships, a trial took
285-290 s on 4 H200s at once (2026-11-27; 126 s of it compiling and capturing graphs), and at 512 px eager with 100
steps 124-158 s (about 1.0 s a step: eager SDXL with LoRA and checkpointing is launch-bound), so the three cases
took an hour of four GPUs, then half of one; this size puts none and median inside one 10-minute call, shared in
another. Cases:

- ``none``: the grid, no pruning.
- ``median``: the same grid with ``--prune median`` (Optuna's MedianPruner, 4 startup trials).
- ``shared``: the grid without pruning run by sweep processes of one GPU each sharing one study (a journal
  file: the stand-in for as many machines), each with its own sweep folder and cache: two processes, or one per
  GPU that ``--gpus`` names.

Each prints the GPU-seconds its trials took (the sum of every trial's wall time on its GPU, from the trial
folders' result.json), the trials finished / pruned / failed, the best trial (its values and held-out loss) and
the wall time; ``--out`` writes them as JSON. Random weights train nothing useful: the numbers are the sweep's
costs, and which trials the pruner stops depends on how these random models' losses move.

    python benchmarks/sweep_pruning.py --work /tmp/swp --out $OUT/sweep_pruning.json [--cases none,median,shared]
        [--gpus 4]   # none and median run their trials four at a time (one per GPU); shared runs four processes of
                     # one GPU each
        [--together 'none=0,0,1,1;median=2,2,3,3']   # both cases at once, two trials a GPU, each its own cache
        [--ranks 4,16]   # a smaller grid (8 trials): the shared case over two processes within one call
        [--shared-ranks 4,16]   # that smaller grid for the shared case only: with --together
                                # 'none=0,0,0,1,1,1;median=2,2,2,3,3,3;shared=1,3' all three cases in one call
    DIFFTRAIN_BENCH_TINY=1 python benchmarks/sweep_pruning.py --work /tmp/swp    # the tiny SDXL on CPU, 4 steps
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TINY = os.environ.get("DIFFTRAIN_BENCH_TINY") == "1"
STEPS, EVERY = (4, 2) if TINY else (48, 8)
LRS = "1e-5,1e-4,1e-3,1e-2"
RANKS = "4,16,32,64"
_ARGS: dict[str, str] = {}  # --ranks, where the command line narrows the grid


def _sets(work: Path) -> tuple[list[str], Path]:
    """The base --set options and the model file (random weights; the tiny model under DIFFTRAIN_BENCH_TINY)."""
    import torch

    from difftrain.families.sdxl import SDXL
    from difftrain.flows.quickstart import make_dataset

    data = work / "data"
    if not data.exists():
        make_dataset(data, n=16, seed=0)
    sets = [
        f"data.dir={data}",
        "train.batch_size=1",
        f"train.max_steps={STEPS}",
        "validation.loss_items=2",
        f"validation.every_n_steps={EVERY}",
        "train.checkpoint_every=100",
        "report.to=[]",
        "report.html=false",
        "speed.sync_seconds=0",
    ]
    if TINY:
        model = work / "tiny-sdxl"
        if not model.exists():
            SDXL().build_tiny(model, seed=0)
        return [*sets, "data.resolution=64", "train.device=cpu"], model
    from difftrain.flows.bench import synthetic_tokenizers

    model = work / "random-sdxl.safetensors"
    tok = work / "tok"  # stand-in tokenizers: a single file carries none, and the machine has no Hub
    if not tok.exists():
        synthetic_tokenizers(tok)
    if not model.exists():
        SDXL().build_random("sdxl-base-1.0", model, device="cuda" if torch.cuda.is_available() else "cpu")
    sets += [
        "data.resolution=512",
        "speed.compile=false",  # eager: see the module's note
        "train.mixed_precision=bf16",
        "memory.weights.kind=bf16",
        "memory.activations.kind=checkpoint",
        "train.device=cuda",
        f"model.tokenizer_path={tok}",
    ]
    return sets, model


def _cmd(sets: list[str], model: Path, out: Path, cache: Path, *extra: str, ranks: str | None = None) -> list[str]:
    ranks = ranks or _ARGS.get("ranks") or RANKS
    recipe = "tiny-sdxl-lora" if TINY else "sdxl-lora-8gb"
    return [
        sys.executable,
        "-m",
        "difftrain",
        "sweep",
        "--recipe",
        recipe,
        "--model",
        str(model),
        *[a for s in [*sets, f"data.cache_dir={cache}"] for a in ("--set", s)],
        "-g",
        f"train.learning_rate={LRS}",
        "-g",
        f"lora.rank={ranks}",
        "-o",
        str(out),
        *extra,
    ]


def _summary(folders: list[Path], wall: float) -> dict:
    rows = []
    for folder in folders:
        rows += json.loads((folder / "results.json").read_text())
    mine = [json.loads(p.read_text()) for f in folders for p in f.glob("trials/*/result.json")]
    by_trial = {r["trial"]: r for r in rows}  # one row per trial (every process's table holds the whole study)
    statuses = [r["status"] for r in by_trial.values()]
    done = [r for r in by_trial.values() if r["status"] == "ok" and r.get("val_loss") is not None]
    best = min(done, key=lambda r: r["val_loss"]) if done else None
    return {
        "gpu_seconds": round(sum(r.get("seconds") or 0 for r in mine), 1),
        "wall_seconds": round(wall, 1),
        "trials": len(by_trial),
        "finished": statuses.count("ok"),
        "pruned": statuses.count("pruned"),
        "failed": len(statuses) - statuses.count("ok") - statuses.count("pruned"),
        "best": None
        if best is None
        else {
            "trial": best["trial"],
            "learning_rate": best.get("train.learning_rate"),
            "rank": best.get("lora.rank"),
            "val_loss": best["val_loss"],
        },
    }


def run_case(
    case: str, work: Path, sets: list[str], model: Path, gpus: str | None = None, cache: Path | None = None
) -> dict:
    """One case; ``cache``: its own cache folder (cases run together precompute apart), else the shared one."""
    root = work / case
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    t0 = time.time()
    if case in ("none", "median"):
        extra: list[str] = []
        if case == "median":  # --prune median, with a quarter of the grid as the pruner's startup trials
            spec = root / "sweep.yaml"
            spec.write_text("prune: {pruner: median, n_startup_trials: 4}\n")
            extra = ["--spec", str(spec)]
        if gpus and not TINY:
            extra += ["--gpus", gpus]
        subprocess.run(_cmd(sets, model, root / "sw", cache or work / "cache", *extra), check=True)
        return _summary([root / "sw"], time.time() - t0)
    # shared: processes of one GPU each (two, or one per GPU of --gpus), one study in a journal file; each its own
    # folder and cache
    journal = root / "study.journal"
    ids = _gpu_ids(gpus) if gpus and not TINY else ["0", "1"]
    procs = []
    for i, gpu in enumerate(ids):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu} if not TINY else dict(os.environ)
        cmd = _cmd(
            sets,
            model,
            root / f"sw{i}",
            root / f"cache{i}",
            "--storage",
            str(journal),
            "--study",
            "shared",
            ranks=_ARGS.get("shared_ranks"),
        )
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait():
            raise SystemExit(f"a sweep process ended with exit code {p.returncode}")
    return {"processes": len(ids), **_summary([root / f"sw{i}" for i in range(len(ids))], time.time() - t0)}


def _gpu_ids(gpus: str) -> list[str]:
    """--gpus as GPU ids: a count (4 -> 0..3) or a comma list (as ``difftrain sweep --gpus`` reads it)."""
    return [str(i) for i in range(int(gpus))] if gpus.isdigit() else gpus.split(",")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", default="none,median,shared")
    ap.add_argument("--gpus", default=None, help="none and median: trials in parallel, one per GPU (a count or ids)")
    ap.add_argument(
        "--together",
        default=None,
        help="cases run at once, each on its own GPUs and cache: 'none=0,0,1,1;median=2,2,3,3' (two trials a GPU)",
    )
    ap.add_argument("--ranks", default=None, help=f"the grid's LoRA ranks (default {RANKS})")
    ap.add_argument("--shared-ranks", default=None, help="the shared case's LoRA ranks (default: --ranks)")
    args = ap.parse_args()
    _ARGS.update({k: v for k, v in (("ranks", args.ranks), ("shared_ranks", args.shared_ranks)) if v})
    args.work.mkdir(parents=True, exist_ok=True)
    sets, model = _sets(args.work)
    results: dict[str, dict] = {}

    def record(case: str, result: dict) -> None:
        results[case] = result
        print(f"{case}: {json.dumps(result)}", flush=True)
        if args.out:  # each case as it ends: a later case that runs out of time leaves the earlier ones on record
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")

    if args.together:  # e.g. none and median side by side on two GPUs each: the same conditions, one call's time
        groups = [g.split("=", 1) for g in args.together.split(";") if g.strip()]
        with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
            futures = {
                pool.submit(run_case, case, args.work, sets, model, gpus, args.work / f"cache-{case}"): case
                for case, gpus in groups
            }
            for f in concurrent.futures.as_completed(futures):
                record(futures[f], f.result())
    else:
        for case in args.cases.split(","):
            record(case, run_case(case, args.work, sets, model, args.gpus))
    if "none" in results and "median" in results:
        a, b = results["none"]["gpu_seconds"], results["median"]["gpu_seconds"]
        print(f"pruning saved {a - b:.0f} GPU-seconds of {a:.0f} ({(a - b) / a:.0%})" if a else "")


if __name__ == "__main__":
    main()
