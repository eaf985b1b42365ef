"""Where a training step's GPU memory goes, phase by phase (issue 51: why the 14B LoRA missed a 24 GB card).

Trains a recipe with overrides as `difftrain bench memory` does, uncapped, with a mark at every transformer block's
forward (``fwd``: the forward pass, run without autograd under checkpointing; ``re``: its recompute in backward),
at the model's forward end and around each optimizer step. At each mark: the memory allocated then and the peak
allocated since the previous mark (torch's peak counter reset at each mark; host-issue order, exact). The peak of
the whole step is then read against what was live when it started.

    python benchmarks/memory_phases.py --out $OUT --variant w14-24-so-x [--steps 2] [--set K=V ...]

``--variant`` takes the recipe and sets of a benchmarks/card_fit_wan.json label (fragment match). Prints the
table last; writes $OUT/memory_phases.json. (Recording torch's allocation history instead broke the checkpoint's
recompute at the out-of-memory on torch 2.11: "error return without exception set".)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

BLOCKS = {"WanTransformerBlock", "CogVideoXBlock", "FluxTransformerBlock", "FluxSingleTransformerBlock"}
MODELS = {"WanTransformer3DModel", "CogVideoXTransformer3DModel", "FluxTransformer2DModel"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default="tiny-wan-lora")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--variant", default=None, help="a card_fit_wan.json label fragment")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-card/tiny"))
    a = ap.parse_args()
    if a.variant:
        runs = json.loads((Path(__file__).parent / "card_fit_wan.json").read_text())
        run = next(r for r in runs if a.variant in r["label"])
        a.recipe, a.sets = run["recipe"], run["sets"] + a.sets
    from difftrain.config.load import resolve
    from difftrain.flows.bench import bench_memory

    marks: list[dict] = []
    index: dict[int, int] = {}
    gib = lambda v: round(v / 2**30, 3)

    def mark(label: str) -> None:
        marks.append(
            {
                "at": label,
                "alloc": gib(torch.cuda.memory_allocated()),
                "peak_before": gib(torch.cuda.max_memory_allocated()),
            }
        )
        torch.cuda.reset_peak_memory_stats()

    def pre(module, args):
        name = type(module).__name__
        if name in BLOCKS:
            i = index.setdefault(id(module), len(index))
            mark(f"{'re' if torch.is_grad_enabled() else 'fwd'} {i}")
        elif name in MODELS:
            mark("model fwd start")

    def post(module, args, out):
        if type(module).__name__ in MODELS:
            mark("model fwd end")

    torch.nn.modules.module.register_module_forward_pre_hook(pre)
    torch.nn.modules.module.register_module_forward_hook(post)
    register_optimizer_step_pre_hook(lambda *_: mark("optimizer step"))
    register_optimizer_step_post_hook(lambda *_: mark("optimizer done"))
    cfg = resolve(recipe=a.recipe, sets=a.sets).config
    res = bench_memory(cfg, a.work, a.steps)
    mark("end")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "memory_phases.json").write_text(json.dumps({"marks": marks, "result": res.__dict__}, default=str) + "\n")
    # the last step: from the last "model fwd start" on; blocks' rows folded into ranges of like figures
    last = max(i for i, m in enumerate(marks) if m["at"] == "model fwd start")
    print("peak of the whole run GiB:", max(m["peak_before"] for m in marks))
    print("| from mark | allocated at it | peak until the next |")
    print("|---|---|---|")
    rows = marks[last:]
    for m, n in zip(rows, rows[1:] + [{"peak_before": None}]):
        print(f"| {m['at']} | {m['alloc']} | {n['peak_before']} |")


if __name__ == "__main__":
    main()
