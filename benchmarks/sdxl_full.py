"""SDXL full fine-tuning on a GPU: peak GPU memory, peak host RSS (load / train / save) and step time.

Full-size SDXL (random weights from difftrain's bundled configs: memory and speed
are what a real checkpoint gives), saved as a single-file checkpoint in the
distributed layout, 1024x1024, batch 1, latents and text embeddings of the real
shapes in a difftrain cache. Each case runs in a fresh subprocess through
difftrain's own Trainer; a sampler thread reads /proc/self/status every 20 ms to
split host memory into anonymous (what the process allocated) and file-backed
(pages of the memory-mapped checkpoint, which the OS can drop).

    python benchmarks/sdxl_full.py --work /tmp/bench --out $OUT            # all cases
    python benchmarks/sdxl_full.py --work /tmp/bench --out $OUT --cases B   # some
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

COMMON = [
    # speed.sync_seconds=0: a metrics record's time is when its step finished (this script times steps from them)
    "speed.sync_seconds=0",
    "family=sdxl",
    "model.config=sdxl-base-1.0",
    "train.method=full",
    "train.batch_size=1",
    "train.mixed_precision=bf16",
    "memory.activations.kind=checkpoint",
    "save.formats=[]",
    "train.device=cuda",
    "data.resolution=1024",
    "train.learning_rate=1e-5",
    "train.lr_scheduler=constant",
    "train.max_grad_norm=1.0",
]
TE = ["full.train_text_encoder_1=true", "full.train_text_encoder_2=true"]
CASES = {
    "A": (
        "UNet + both TEs, bf16 weights (SR), 8-bit AdamW, checkpointing, fp16 single-file export",
        [
            "memory.weights.kind=bf16",
            "memory.optimizer.kind=adamw8bit",
            "save.formats=[single_file]",
            "save.precision=fp16",
            *TE,
        ],
    ),
    "B": (
        "UNet only, bf16 weights, 8-bit AdamW, checkpointing",
        ["memory.weights.kind=bf16", "memory.optimizer.kind=adamw8bit"],
    ),
    "C": (
        "UNet + both TEs, fp32 master weights + fp16 autocast, 8-bit AdamW, checkpointing (the sd-scripts command)",
        ["memory.weights.kind=fp32", "train.mixed_precision=fp16", "memory.optimizer.kind=adamw8bit", *TE],
    ),
    "D": (
        "UNet only, bf16 weights, AdamW fp32 moments + stochastic rounding, checkpointing",
        ["memory.weights.kind=bf16", "memory.optimizer.kind=adamw"],
    ),
}


TINY = os.environ.get("DIFFTRAIN_BENCH_TINY") == "1"  # CPU smoke test of this script on the tiny SDXL


def build_model(work: Path) -> Path:
    """The random full-size SDXL single file (difftrain's own stand-in, as `bench memory` uses)."""
    from difftrain.families.sdxl import SDXL

    path = work / "sdxl_random.safetensors"
    if not path.exists():
        t = time.time()
        SDXL().build_random("sdxl-tiny" if TINY else "sdxl-base-1.0", path, device="cpu" if TINY else "cuda")
        print(
            f"built random SDXL -> {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.time() - t:.0f}s", flush=True
        )
    return path


def build_cache(work: Path) -> Path:
    """A cache of random latents and embeddings of the real shapes, and stand-in tokenizers in work/tok."""
    from difftrain.config.load import resolve
    from difftrain.flows.bench import synthetic_cache, synthetic_tokenizers

    synthetic_tokenizers(work / "tok")
    cache_dir = work / "cache"
    if not (cache_dir / "index.json").exists():
        sets = (
            ["model.config=sdxl-tiny", "data.resolution=128", "data.min_side=64"] if TINY else ["data.resolution=1024"]
        )
        synthetic_cache(resolve(sets=sets).config, cache_dir)
    return cache_dir


class MemSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.stop = False

    def run(self):
        while not self.stop:
            with open("/proc/self/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in self.peak:
                        self.peak[k] = max(self.peak[k], int(v.split()[0]))
            time.sleep(0.02)

    def gib(self) -> dict:
        return {k: round(v / 2**20, 2) for k, v in self.peak.items()}


def run_case(name: str, work: Path, steps: int) -> dict:
    """In the subprocess: train one case, return its measurements."""
    return run_sets(name, CASES[name][0], COMMON + CASES[name][1], work, steps)


def run_sets(name: str, what: str, sets: list[str], work: Path, steps: int) -> dict:
    """Train one config on the random model and synthetic cache; measure it; add the planner's prediction."""
    import torch

    from difftrain.config.load import resolve
    from difftrain.planning.estimate import plan_memory
    from difftrain.trainers.loop import Trainer

    sets = sets + [
        f"model.path={work / 'sdxl_random.safetensors'}",
        f"model.tokenizer_path={work / 'tok'}",
        f"data.cache_dir={work / 'cache'}",
        f"train.output_dir={work / ('run-' + name)}",
        f"train.max_steps={steps}",
    ]
    if TINY:
        sets = [
            x.replace("adamw8bit", "adamw")
            .replace("sdxl-base-1.0", "sdxl-tiny")
            .replace("=cuda", "=cpu")
            .replace("resolution=1024", "resolution=128")
            for x in sets
        ] + ["data.min_side=64"]
        torch.cuda.synchronize = lambda *a: None
    cfg = resolve(sets=sets).config
    plan = plan_memory(cfg)
    phases = {}
    sampler = MemSampler()
    sampler.start()
    trainer = Trainer(cfg)
    orig_setup = trainer.setup

    def setup_and_mark():
        orig_setup()
        torch.cuda.synchronize()
        phases["load"] = sampler.gib()

    trainer.setup = setup_and_mark
    orig_export = trainer.export_model

    def export_and_mark(tag):
        phases["train"] = sampler.gib()
        return orig_export(tag)

    trainer.export_model = export_and_mark
    result = trainer.run()
    time.sleep(0.1)
    sampler.stop = True
    phases["end"] = sampler.gib()
    phases.setdefault("train", phases["end"])
    times = [json.loads(line)["time"] for line in (cfg.train.output_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [b - a for a, b in itertools.pairwise(times)][1:]  # drop the first steps (warm-up)
    return {
        "case": name,
        "what": what,
        "steps": steps,
        "stats": result.stats,
        "rss": phases,
        "plan": {"gpu": plan.gpu, "gpu_total": plan.gpu_total, "gpu_reserved": plan.gpu_reserved, "host": plan.host},
        "batch": cfg.train.batch_size,
        "resolution": cfg.data.resolution,
        "s_per_step_median": round(statistics.median(step_times), 3),
        "step_times": [round(x, 3) for x in step_times],
        "losses": [round(x, 4) for x in result.losses],
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": None if TINY else torch.cuda.get_device_name(),
        },
    }


def run_cases(script: str, names: list[str], work: Path, steps: int, what: dict[str, str] | None = None) -> list[dict]:
    """Run each case in a fresh subprocess of ``script`` (clean RSS and CUDA state); collect their results.

    A failed case's result holds its stderr (and its description from ``what``, when given).
    """
    results = []
    for name in names:
        t = time.time()
        p = subprocess.run(
            [sys.executable, script, "--case", name, "--work", str(work), "--steps", str(steps)],
            capture_output=True,
            text=True,
            env=dict(os.environ, DIFFTRAIN_PROGRESS="0"),
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"case {name} failed ({p.returncode}):\n{p.stderr[-3000:]}", flush=True)
            results.append(
                {"case": name, **({"what": what.get(name, "")} if what is not None else {}), "error": p.stderr[-2000:]}
            )
            continue
        r = json.loads(line[0][7:])
        r["wall_seconds"] = round(time.time() - t, 1)
        results.append(r)
        print(json.dumps(r), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # subprocess mode
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_case(a.case, a.work, a.steps)), flush=True)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    build_model(a.work)
    build_cache(a.work)
    results = run_cases(__file__, a.cases.split(","), a.work, a.steps, {k: v[0] for k, v in CASES.items()})
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "sdxl_full.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| case | GPU peak alloc GiB | GPU peak reserved GiB | s/step | host RSS load (anon) GiB | RSS train (anon) | RSS end/save (anon) | load s | save s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} {r['what']} | failed | | | | | | | |")
            continue
        s, m = r["stats"], r["rss"]
        print(
            f"| {r['case']} {r['what']} | {s.get('gpu_peak_alloc_gib')} | {s.get('gpu_peak_reserved_gib')} | {r['s_per_step_median']} | "
            f"{m['load']['VmRSS']} ({m['load']['RssAnon']}) | {m['train']['VmRSS']} ({m['train']['RssAnon']}) | "
            f"{m['end']['VmRSS']} ({m['end']['RssAnon']}) | {s['load_seconds']} | {s.get('save_seconds')} |"
        )


if __name__ == "__main__":
    main()
