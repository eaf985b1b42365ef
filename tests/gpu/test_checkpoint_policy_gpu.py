"""memory.activations.save_attention on CUDA: the attention kernels SDPA dispatches to there (flash, cuDNN,
memory-efficient) are the ones the policy keeps, eagerly and inside a compiled block, with the gradients of plain
checkpointing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import AttentionBlock, count_attention
from difftrain.memory.checkpoint_policy import checkpoint_function

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _step(block, keep: bool, count: bool = True):
    torch.manual_seed(0)
    x = torch.randn(1, 2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ctx = torch.randn(1, 16, 256, device="cuda", dtype=torch.bfloat16)
    block.zero_grad(set_to_none=True)
    counter = count_attention()
    with counter if count else contextlib.nullcontext():
        checkpoint_function(keep)(block, x, ctx).float().square().mean().backward()
    return counter.keys, [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


def _assert_near(want, got, share: float):
    """Each gradient within ``share`` of its norm: SDPA's flash backward adds its query gradients up in no fixed
    order (torch.equal failed between the two, H200, 2026-11-28), so runs differ in the last bits of bf16; a wrong
    saved tensor would be off by the whole gradient."""
    for a, b in zip(want, got, strict=True):
        assert (a.float() - b.float()).norm() <= share * a.float().norm(), (a, b)


def test_the_cuda_attention_kernels_are_kept_and_the_gradients_are_checkpointings():
    block = AttentionBlock(256).cuda().to(torch.bfloat16)
    plain_keys, plain = _step(block, False)
    kept_keys, kept = _step(block, True)
    assert sorted(plain_keys) == [16, 16, 2048, 2048], plain_keys  # the kernels SDPA took are in the policy's table
    assert sorted(kept_keys) == [16, 16, 2048]
    _assert_near(plain, kept, 1e-2)


def test_inside_a_compiled_block_the_gradients_are_checkpointings():
    from difftrain.speed.regional_compile import checkpoint_inside

    ref = AttentionBlock(256).cuda().to(torch.bfloat16)
    _, want = _step(ref, False, count=False)
    holder = torch.nn.Module()
    holder.block = AttentionBlock(256).cuda().to(torch.bfloat16)
    holder.block.load_state_dict(ref.state_dict())
    checkpoint_inside(holder, [holder.block], checkpoint_function(True))
    holder.block.compile()
    torch.manual_seed(0)
    x = torch.randn(1, 2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ctx = torch.randn(1, 16, 256, device="cuda", dtype=torch.bfloat16)
    holder.block(x, ctx).float().square().mean().backward()
    got = [p.grad for p in holder.block.parameters()] + [x.grad]
    _assert_near(want, got, 3e-2)  # inductor fuses in bf16: close, not equal
