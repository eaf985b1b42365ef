"""Checkpointing with the checkpoints in host RAM (memory.activations: {kind: checkpoint, offload: true}).

Gradient checkpointing keeps one tensor per block alive until backward: the block's input hidden states. For a
video DiT at its training size they are most of the activations (Wan2.1-14B, 81 frames of 480x832: 32 760 tokens
x 5 120 x 2 bytes = 0.31 GiB a block, 12.5 GiB for its 40 blocks). Here each checkpointed block's large inputs go
to pinned host memory as the forward passes it and come back when backward reaches it; the block runs without
autograd in the forward and again with it in the backward, as checkpointing does. What diffusion-pipe calls
"unsloth" checkpointing and OneTrainer "CPU offloaded" checkpointing.

Why our own: torch's non-reentrant checkpoint keeps the block's inputs by reference (its recompute closure), so
``torch.autograd.graph.save_on_cpu`` around it moves nothing, and neither diffusers nor accelerate offers an
offloaded checkpoint. The copies run on the compute stream: in order with the kernels around them, so a tensor
is on the host before its GPU memory is reused, and back before the recompute reads it (a block's compute at
these sizes takes far longer than its input's copy: 0.31 GiB at ~25 GB/s is 13 ms).

Used as diffusers' ``gradient_checkpointing_func`` (``ModelMixin.enable_gradient_checkpointing``): the model
calls ``func(block, *args)`` for each checkpointed block.
"""

from __future__ import annotations

from typing import Any

import torch

#: inputs smaller than this stay where they are (the timestep embedding, the text, rotary tables are small)
MIN_OFFLOAD_BYTES = 1 << 20


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _Offloaded(torch.autograd.Function):
    """forward(ctx, block, spec, dummy, *tensors): ``tensors`` are the block's tensor arguments, ``spec`` how to
    put the call back together; ``dummy`` requires grad, so backward runs even when no input does (a LoRA
    block's input comes from frozen layers: its trainable parameters are not inputs of this function)."""

    @staticmethod
    def forward(ctx, block, spec, dummy, *tensors):
        ctx.block, ctx.spec = block, spec
        ctx.devices = [t.device for t in tensors]
        ctx.grads = [t.requires_grad for t in tensors]
        ctx.stored = [
            _to_host(t) if t.is_floating_point() and t.numel() * t.element_size() >= MIN_OFFLOAD_BYTES else t
            for t in tensors
        ]
        with torch.no_grad():
            return block(*_rebuild(spec, tensors))

    @staticmethod
    def backward(ctx, *grads):
        inputs = [
            s.to(d, non_blocking=True).detach().requires_grad_(g) for s, d, g in zip(ctx.stored, ctx.devices, ctx.grads)
        ]
        ctx.stored = None
        with torch.enable_grad():
            out = ctx.block(*_rebuild(ctx.spec, inputs))
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [
            (o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[i.grad if i.requires_grad else None for i in inputs])


def _flatten(args: tuple) -> tuple[list[torch.Tensor], Any]:
    """The tensors of ``args`` (nested in tuples and lists one level down too: rotary tables) and how to put
    ``args`` back together from them."""
    tensors: list[torch.Tensor] = []
    spec: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append(("t", len(tensors)))
            tensors.append(a)
        elif isinstance(a, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in a):
            inner = []
            for x in a:
                if isinstance(x, torch.Tensor):
                    inner.append(("t", len(tensors)))
                    tensors.append(x)
                else:
                    inner.append(("v", x))
            spec.append(("seq", type(a), inner))
        else:
            spec.append(("v", a))
    return tensors, spec


def _rebuild(spec: list[Any], tensors) -> list[Any]:
    out: list[Any] = []
    for s in spec:
        if s[0] == "t":
            out.append(tensors[s[1]])
        elif s[0] == "seq":
            out.append(s[1](tensors[i[1]] if i[0] == "t" else i[1] for i in s[2]))
        else:
            out.append(s[1])
    return out


def offloaded_checkpoint(block: torch.nn.Module, *args) -> Any:
    """Run ``block(*args)`` checkpointed, its large tensor inputs kept in host RAM until backward."""
    if not torch.is_grad_enabled():
        return block(*args)
    tensors, spec = _flatten(args)
    dummy = torch.empty(0, requires_grad=True)
    return _Offloaded.apply(block, spec, dummy, *tensors)
