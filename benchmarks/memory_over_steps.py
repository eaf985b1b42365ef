"""Host RSS and GPU memory over a long run: does anything grow with the step count?

The tiers are measured over a few steps (card_fit.py, tests/gpu); a real run takes thousands. This trains a recipe as
shipped on a random-weight model of its architecture and a random cache of its shapes (what `difftrain bench memory`
trains on), and records after every ``--every``-th optimizer step this process's resident set (VmRSS) and, on a GPU,
torch's allocated and reserved bytes. What it prints last: each figure after the warm-up and at the end, and its
growth per 1 000 steps fitted over the second half of the run (the warm-up's compiles and first allocations left out).
A loop that keeps something per step shows as a steady slope; a flat run shows ~0.

    python3 benchmarks/memory_over_steps.py --recipe flux2-klein-4b-lora-24gb --steps 400 --out $OUT --work /tmp/mos
    python3 benchmarks/memory_over_steps.py --recipe tiny-sdxl-lora --steps 600 --out /tmp/mos-out --work /tmp/mos

``--card N`` caps torch's allocator as an N GiB card would leave it (as `bench memory --card`); ``--planned-steps``
is the run length speed auto weighs its compile against (default: ``--steps``). JSON to OUT/memory_over_steps.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from difftrain.config.load import resolve
from difftrain.flows.bench import _prepare
from difftrain.memory.card import allocator_budget, measure_overhead
from difftrain.trainers.loop import Hooks, Trainer
from difftrain.utils import pick_device


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def slope_per_1000(rows: list[dict], key: str) -> float | None:
    """Least-squares growth of ``key`` per 1 000 steps over the second half of ``rows``."""
    half = [r for r in rows[len(rows) // 2 :] if r.get(key) is not None]
    if len(half) < 2:
        return None
    xs, ys = [r["step"] for r in half], [r[key] for r in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=10, help="record after every N-th step")
    ap.add_argument("--warmup", type=int, default=20, help="steps before the first figure printed as 'after warm-up'")
    ap.add_argument("--card", type=float, default=None, help="cap torch's allocator as this card (GiB) would")
    ap.add_argument("--planned-steps", type=int, default=None)
    ap.add_argument("--set", "-s", action="append", default=[], help="a config override, as `difftrain train -s`")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    cfg = resolve(recipe=args.recipe, sets=args.set).config
    cfg = _prepare(cfg, args.work, args.steps, None)
    device = pick_device(cfg.train.device)
    if args.card is not None:
        budget = allocator_budget(args.card, measure_overhead(device))
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"gpu_memory_limit_gib": budget})})
    cuda = device.type == "cuda"
    rows: list[dict] = []
    t0 = time.perf_counter()
    step = [0]

    def after() -> None:
        step[0] += 1
        n = step[0]
        if n == 1 or n % args.every == 0 or n == args.steps:
            row = {"step": n, "s": round(time.perf_counter() - t0, 2), "rss_mib": round(rss_mib(), 1)}
            if cuda:  # the allocator's counters: host-side, no wait for the GPU
                row["alloc_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 3)
                row["reserved_gib"] = round(torch.cuda.memory_reserved(device) / 2**30, 3)
            rows.append(row)

    planned = args.planned_steps or args.steps
    trainer = Trainer(cfg, hooks=Hooks(after_step=after, planned_steps=planned))
    result = trainer.run(overwrite=True)
    keys = ["rss_mib"] + (["alloc_gib", "reserved_gib"] if cuda else [])
    warm = next((r for r in rows if r["step"] >= args.warmup), rows[0])
    summary = {
        k: {"after_warmup": warm.get(k), "end": rows[-1].get(k), "per_1000_steps": slope_per_1000(rows, k)}
        for k in keys
    }
    report = {
        "recipe": args.recipe,
        "sets": args.set,
        "steps": args.steps,
        "planned_steps": planned,
        "card_gib": args.card,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "speed": trainer.speed.line(),
        "s_per_step": round(result.seconds / max(1, args.steps), 4),
        "stats": result.stats,
        "rows": rows,
        "summary": summary,
    }
    (args.out / "memory_over_steps.json").write_text(json.dumps(report, indent=1))
    print(f"{args.recipe}: {args.steps} steps, {report['s_per_step']} s/step, {report['device']}")
    print(f"| figure | after step {warm['step']} | at step {rows[-1]['step']} | growth per 1 000 steps (2nd half) |")
    print("|---|---|---|---|")
    for k in keys:
        s = summary[k]
        g = s["per_1000_steps"]
        print(f"| {k} | {s['after_warmup']} | {s['end']} | {'n/a' if g is None else round(g, 3)} |")


if __name__ == "__main__":
    main()
