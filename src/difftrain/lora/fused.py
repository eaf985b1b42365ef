"""peft's LoRA Linear with its forward and backward written as few passes over the activations (speed.lora_kernel).

Why our own: peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` op by op, and first casts ``x`` to
the adapter's dtype (fp32 here, where the adapter is trained) for autocast to cast it back. Under torch.compile
each of those ops reads or writes an activation-sized tensor: the casts, the up-projection's output, the scaling,
the sum; in the backward the same again. Where the step is bound by memory traffic (SDXL LoRA at batch 4) that
is a measurable share of the step: peft's adapters cost 0.50 ms of a 1.82 ms SDXL transformer block (batch 4,
1280 channels, compiled, H100; benchmarks/lora_block.py). Here the low-rank path reads ``x`` once for the
down-projection, and the base and the up-projection are one matmul over ``[x, x a^T]`` (the backward's input
gradient likewise), with no casts of the activations. Same weights, names and state dict: only the forward of the
layer changes, so checkpoints, exports and peft's own tools see peft's layer. Anything this does not cover
(several active adapters, dropout, DoRA and other variants, a merged or disabled adapter, a base layer that is not
a plain ``nn.Linear``, no autocast) runs peft's own forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class _LoraLinear(torch.autograd.Function):
    """``x @ weight.T + bias + scale * (x @ a.T) @ b.T`` with every tensor in one dtype (autocast's)."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, a, b, scale: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        mid = x2 @ a.t()
        # one matmul for the base and the up-projection: [x, x a^T] [w, s b]^T. Measured against adding the
        # up-projection in an addmm (cuBLAS first copies the sum's input into its output: one more pass), SDXL's
        # 1280-channel block at batch 4 on an H100: 1.734 against 1.767 ms, peft's 1.822 (benchmarks/lora_block.py)
        y = torch.cat([x2, mid], 1) @ torch.cat([weight, b * scale], 1).t()
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, mid, weight, a, b)
        ctx.scale, ctx.shape = scale, shape
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad):
        x2, mid, weight, a, b = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])
        gm = g2 @ (b * ctx.scale)  # the down-projection's output gradient (rows x rank)
        gx = gw = gbias = ga = gb = None
        if need_x:  # [g, g s b] [w; a], as the forward
            gx = (torch.cat([g2, gm], 1) @ torch.cat([weight, a], 0)).view(ctx.shape)
        if need_w:  # the base layer trained too: not LoRA's case, kept correct
            gw = g2.t() @ x2
        if need_bias:
            gbias = g2.sum(0)
        if need_a:
            ga = gm.t() @ x2
        if need_b:
            gb = (g2.t() @ mid) * ctx.scale
        return gx, gw, gbias, ga, gb, None


def _plain(layer: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The adapter's name where this layer and call are the plain case the fused path computes, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged or layer.fan_in_fan_out:
        return None
    if not torch.is_autocast_enabled(x.device.type) or type(layer.base_layer) is not torch.nn.Linear:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    if name not in layer.lora_A or name in layer.lora_variant or layer.lora_bias.get(name, False):
        return None
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return None
    return name


def _forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = _plain(self, x, args, kwargs)
    if name is None:
        return super(type(self), self).forward(x, *args, **kwargs)
    dt = torch.get_autocast_dtype(x.device.type)
    base = self.base_layer
    bias = None if base.bias is None else base.bias.to(dt)
    a, b = self.lora_A[name].weight.to(dt), self.lora_B[name].weight.to(dt)
    return _LoraLinear.apply(x.to(dt), base.weight.to(dt), bias, a, b, float(self.scaling[name]))


def use_fused(module: torch.nn.Module) -> int:
    """Gives every peft LoRA Linear under ``module`` the fused forward; returns how many. Weights, names and the
    state dict are untouched."""
    from peft.tuners.lora.layer import Linear

    n = 0
    for m in module.modules():
        if type(m) is Linear:
            m.__class__ = fused_class()
            n += 1
    return n


@functools.cache
def fused_class() -> type:
    """peft's LoRA Linear with the fused forward (built on first use: importing peft is slow)."""
    from peft.tuners.lora.layer import Linear

    return type("FusedLoraLinear", (Linear,), {"forward": _forward, "__module__": __name__})


def __getattr__(name: str) -> Any:  # pickle and copy find the class by its name
    if name == "FusedLoraLinear":
        return fused_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
