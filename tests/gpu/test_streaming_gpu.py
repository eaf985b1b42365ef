"""The streaming load on a CUDA GPU (issue 50; skipped elsewhere): the tiny seeded Flux stored in fp8 with block swap
(LoRA), and trained whole in bf16 with block swap and Adafactor in the backward pass (write-back into pinned slabs),
each trains exactly as with the load before issue 50 (DIFFTRAIN_STREAMING_LOAD=0), and the swapped weights the load
put in pinned memory are block swap's home copies (no second copy)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.families.registry import get_family
from difftrain.precompute.run import precompute

pytestmark = pytest.mark.gpu

SWAP = {"memory.activations": "{kind: checkpoint}", "memory.offload": "{kind: block_swap, blocks_to_swap: 2}"}
PLANS = {
    "fp8-lora": {"memory.weights": "{kind: fp8}", **SWAP},
    "bf16-full-fused": {
        "train.method": "full",
        "memory.weights.kind": "bf16",
        "memory.optimizer.kind": "adafactor",
        "memory.fused_backward": "true",
        "train.max_grad_norm": "null",
        "train.learning_rate": 1e-4,
        **SWAP,
    },
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_streamed_load_trains_as_the_load_before_with_pinned_homes(_dataset_master, tmp_path, monkeypatch, plan):
    from difftrain.trainers.loop import Trainer

    model = get_family("flux").build_tiny(tmp_path / "tiny-flux")
    runs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("DIFFTRAIN_STREAMING_LOAD", mode)
        sets = {"train.device": "cuda", "precompute.device": "cuda", "train.mixed_precision": "bf16",
                "train.max_steps": 4, "report.to": "[]", "save.formats": "[]",
                "data.cache_dir": tmp_path / "cache", **PLANS[plan]}  # fmt: skip
        cfg = resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / mode, **sets)).config
        precompute(cfg)
        t = Trainer(cfg)
        r = t.run()
        swap = t.parts.block_swap
        homes = [h for i in swap.swapped for h in swap.home[i]]
        assert homes and all(h.is_pinned() for h in homes)
        from difftrain.memory import pinned

        assert pinned.budget().used_bytes == swap.swapped_bytes  # one pinned copy of each swapped weight, not two
        den = t.parts.comps["transformer"]
        runs[mode] = (r.losses, {n: p.detach().float().cpu() for n, p in den.named_parameters()}, swap.swapped)
    assert runs["1"][0] == runs["0"][0]
    assert runs["1"][2] == runs["0"][2]
    assert all(torch.equal(runs["1"][1][n], runs["0"][1][n]) for n in runs["0"][1])
