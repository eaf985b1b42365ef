"""Gradient checkpointing inside compiled blocks (speed.compile with memory.activations checkpoint).

The checkpoint call is moved into each compiled block's traced forward, so AOT autograd saves only the block's
inputs and recomputes the rest in the compiled backward (and CUDA graphs can replay it). These tests hold it to
what diffusers' own checkpointing gives: the same gradients, and about the same memory kept for backward.
"""

from __future__ import annotations

import copy

import pytest
import torch

from difftrain import speed
from difftrain.config.schema import SpeedConfig


def _blocks():
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    res = ResnetBlock2D(in_channels=32, out_channels=64, temb_channels=64, groups=16)
    attn = BasicTransformerBlock(64, 4, 16, cross_attention_dim=48)
    return [(res, (torch.randn(2, 32, 20, 20), torch.randn(2, 64)), {}),
            (attn, (torch.randn(2, 200, 64),), {"encoder_hidden_states": torch.randn(2, 20, 48)})]


def _saved_bytes(block, args, kwargs):
    """Bytes of activations autograd keeps for backward over one forward, and the gradients after backward.
    Weights are not counted: neither the parameters nor copies of them (inductor on the CPU keeps convolution
    weights in its own layout), told apart by their element counts."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    weight_sizes = {p.numel() for p in block.parameters()}
    seen: set[int] = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if (ptr not in params and ptr not in seen and t.dtype.is_floating_point and t.dim() >= 2
                and t.numel() not in weight_sizes):
            seen.add(ptr)
        return t

    x = args[0].clone().requires_grad_(True)
    sizes = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (pack(t), sizes.setdefault(
            t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))[0], lambda t: t):
        out = block(x, *args[1:], **kwargs)
    out.float().pow(2).mean().backward()
    return sum(sizes[p] for p in seen), x.grad, [p.grad.clone() for p in block.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["ResnetBlock2D", "BasicTransformerBlock"])
def test_checkpoint_inside_compiled_block_keeps_inputs_only(which, tmp_path, monkeypatch):
    """A compiled block checkpointed inside keeps (about) its inputs for backward, where the compiled block without
    checkpointing keeps several times more; both give eager's gradients. (diffusers' eager checkpointing keeps the
    inputs by reference, outside autograd's saved tensors, so it is not measured the same way.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    import torch._dynamo

    block, args, kwargs = _blocks()[which]
    name = type(block).__name__
    inputs = sum(t.numel() * t.element_size() for t in [*args, *kwargs.values()])
    results = {}
    for mode in ("eager", "compiled", "compiled-ckpt"):
        torch._dynamo.reset()
        b = copy.deepcopy(block)
        if mode != "eager":
            n = speed.compile_blocks(torch.nn.Sequential(b), (name,), SpeedConfig(compile=True),
                                     checkpoint_every=1 if mode == "compiled-ckpt" else 0)
            assert n == 1 and b._compiled_call_impl is not None
        b(*args, **kwargs)  # compiled outside the measurement
        results[mode] = _saved_bytes(b, args, kwargs)
    eager, comp, comp_ckpt = (results[m] for m in ("eager", "compiled", "compiled-ckpt"))
    for other in (comp, comp_ckpt):  # eager's gradients
        torch.testing.assert_close(other[1], eager[1], rtol=1e-4, atol=1e-5)
        for a, b in zip(other[2], eager[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert comp_ckpt[0] <= inputs * 1.25, (comp_ckpt[0], inputs)
    assert comp[0] > 3 * inputs, (comp[0], inputs)
