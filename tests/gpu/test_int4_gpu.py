"""memory.weights int4 on a CUDA GPU (issue 53; skipped elsewhere): an int4 Linear compiled by inductor gives what the
eager layer gives, and the tiny seeded Flux trains a LoRA over int4 weights with block swap and compiled blocks
(speed.compile true), close to the bf16 base's run."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.families.registry import get_family
from difftrain.memory import int4
from difftrain.precompute.run import precompute

pytestmark = pytest.mark.gpu


def test_an_int4_linear_compiled_by_inductor_matches_eager():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3072, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    int4.convert(lin, "cuda", 64)
    x = torch.randn(2, 4096, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = lin(x)
    eager.float().square().mean().backward()
    g_eager, x.grad = x.grad, None
    compiled = torch.compile(lin, fullgraph=True)(x)
    compiled.float().square().mean().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(x.grad, g_eager)


def test_tiny_flux_trains_over_int4_weights_with_block_swap_and_compiled_blocks(_dataset_master, tmp_path):
    from difftrain.trainers.loop import Trainer

    model = get_family("flux").build_tiny(tmp_path / "model", seed=0)
    losses = {}
    for name, sets in {
        "bf16": {"memory.weights": "{kind: bf16}"},
        "int4": {"memory.weights": "{kind: int4, group_size: 16}", "memory.activations": "{kind: checkpoint}",
                 "memory.offload": "{kind: block_swap, blocks_to_swap: 2}", "speed.compile": "true"},
    }.items():  # fmt: skip
        more = {"train.device": "cuda", "precompute.device": "cuda", "train.mixed_precision": "bf16",
                "train.max_steps": 4, "report.to": "[]", "save.formats": "[]", "data.cache_dir": tmp_path / "cache"}  # fmt: skip
        cfg = resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / name, **more, **sets))
        precompute(cfg.config)
        t = Trainer(cfg.config)
        losses[name] = t.run().losses
        if name == "int4":
            assert len(t.parts.block_swap.swapped) == 2
    assert all(math.isfinite(v) for v in losses["int4"])
    assert losses["int4"] == pytest.approx(losses["bf16"], rel=0.03)
