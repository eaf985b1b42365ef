"""speed auto in a real run, and compiled blocks over several bucket shapes (issue 24), on the CPU.

What compile buys in time is measured on a GPU (benchmarks/fast_default.py); here: the choice is printed through
the console script, a compiled run over three bucket shapes in random order stops compiling once each shape was
seen (no recompile storm) and never falls back to eager at dynamo's recompile limit, a limit hit is named, and
compiled blocks under block swap (hooks around the compiled forward, weights poisoned while evicted) train as
the eager block-swap run does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.flows.bench import _prepare
from difftrain.speed.regional_compile import recompile_limit_hits
from difftrain.trainers.loop import Hooks, Trainer

BUCKETS = [(128, 128), (96, 160), (160, 96)]


def _cfg(tmp_path, *sets):
    base = resolve(recipe="tiny-sd3-lora", sets=["train.checkpoint_every=1000", *sets]).config
    return base


@pytest.mark.slow
def test_train_prints_what_speed_auto_chose(tiny_model, dataset, tmp_path):
    """Through the console script: the one line saying what auto chose and why (the CPU: eager)."""
    from conftest import set_args, tiny_sets

    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"train.max_steps": 1})
    env_cmd = [sys.executable, "-m", "difftrain"]
    r = subprocess.run([*env_cmd, "precompute", "--recipe", "tiny-sdxl-lora", *set_args(sets)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    r = subprocess.run(
        [*env_cmd, "train", "--recipe", "tiny-sdxl-lora", *set_args(sets)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    text = " ".join((r.stdout + r.stderr).split())
    assert "speed: eager: auto: the device is cpu: compiled kernels pay on CUDA GPUs" in text


@pytest.mark.slow
def test_compiled_blocks_over_three_bucket_shapes_stop_compiling_after_the_first_epoch(tmp_path, monkeypatch):
    """Tiny SD3, every joint block compiled (dynamic after the second shape): 6 items in 3 buckets drawn in random
    order for 2 epochs. The second epoch compiles nothing new, fewer graphs than one per shape were made for
    the blocks, and no block was left eager at the recompile limit."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = _prepare(
        _cfg(tmp_path, "speed.compile=true", f"speed.compile_cache_dir={tmp_path / 'inductor'}"),
        tmp_path,
        12,
        None,
        buckets=BUCKETS,
    )
    graphs: list[int] = []
    hooks = Hooks(after_step=lambda: graphs.append(counters["stats"]["unique_graphs"]))
    trainer = Trainer(cfg, hooks=hooks)
    out = trainer.run()
    assert trainer.speed.compile and not trainer.speed.cuda_graphs  # on the CPU: compiled, no graphs
    shapes = {tuple(b["latents"].shape[-2:]) for b in [trainer.feed.batch([it], 0) for it in trainer.feed.items]}
    assert len(shapes) == 3
    assert len(graphs) == 12 and all(torch.isfinite(torch.tensor(out.losses)))
    assert graphs[5] == graphs[-1], graphs  # the second epoch (steps 7-12) compiled nothing new
    # the first shape compiles each block variant once (the tiny SD3 has two: the last block's differs), the second
    # once more with dynamic sizes, which the third shape reuses: not one graph per shape
    assert graphs[0] >= 1 and graphs[-1] == 2 * graphs[0], graphs
    assert recompile_limit_hits() == []
    torch._dynamo.reset()


def test_a_recompile_limit_hit_is_named_not_silent():
    """A function recompiled past dynamo's limit runs eagerly from then on: difftrain says so, naming it."""
    import torch._dynamo

    from difftrain.config.schema import SpeedConfig
    from difftrain.speed.regional_compile import configure_compile

    configure_compile(SpeedConfig(compile=True))
    torch._dynamo.reset()

    def block(x):
        return torch.nn.functional.gelu(x) * 2

    # dynamo's own patch (monkeypatch's undo would delete the config entry: later compiles then fail)
    with torch._dynamo.config.patch(recompile_limit=1):
        f = torch.compile(block, dynamic=False, backend="eager")
        before = len(recompile_limit_hits())
        for n in (3, 4, 5):
            f(torch.ones(n))
    hits = recompile_limit_hits()[before:]
    assert hits and "block" in hits[0]
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_blocks_under_block_swap_train_as_eager_block_swap(tmp_path, monkeypatch):
    """Tiny SD3 with its joint blocks swapped (weights emptied while evicted, so a use outside the hooks raises)
    and checkpointing: compiled (only each block's forward; the swap hooks stay eager) the losses of 4 steps
    match the eager block-swap run's, with the blocks really compiled."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from difftrain.memory import block_swap

    real_init = block_swap.BlockSwap.__init__

    def poisoned(self, *a, **k):
        real_init(self, *a, **{**k, "poison": True})

    monkeypatch.setattr(block_swap.BlockSwap, "__init__", poisoned)
    sets = [
        "memory.offload={kind: block_swap, blocks_to_swap: 2}",
        "memory.activations.kind=checkpoint",
        "train.learning_rate=3e-3",
    ]
    losses = {}
    for mode in ("false", "true"):
        torch._dynamo.reset()
        cfg = _prepare(
            _cfg(tmp_path, *sets, f"speed.compile={mode}", f"speed.compile_cache_dir={tmp_path / 'inductor'}"),
            tmp_path,
            4,
            None,
            run=f"run-{mode}",
        )
        trainer = Trainer(cfg)
        losses[mode] = trainer.run().losses
        blocks = list(trainer.parts.comps["transformer"].transformer_blocks)
        swap = trainer.parts.block_swap
        assert swap is not None and len(swap.swapped) == 2
        compiled = [b for b in blocks if hasattr(vars(b).get("forward"), "_torchdynamo_orig_callable")]
        assert len(compiled) == (len(blocks) if mode == "true" else 0)
    assert losses["true"] == pytest.approx(losses["false"], rel=2e-3, abs=1e-4)
    torch._dynamo.reset()
