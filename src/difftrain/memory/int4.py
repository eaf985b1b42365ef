"""int4 base weights: frozen Linear weights stored as 4-bit integers, in groups with a scale and a zero point.

The layout of fp8.py's storage, a quarter of bf16's bytes: each group of ``group_size`` input columns of a row keeps
``scale = (max - min) / 15`` and ``zero = min`` (in the compute dtype), each weight ``q = round((w - zero) / scale)``
in 0..15, two to a byte (the even column in the low nibble). Each forward dequantizes the layer's weight
(``q * scale + zero``) inside one autograd function that saves only the packed weight and its groups' scales for
backward, as fp8.py does, and compiled code calls custom ops for the same reason (fp8.py says why). The affine
min-max scheme is optimum-quanto's and HQQ's int4 without their refinements; 0.5625 bytes a weight at group 64.

Why our own beside bitsandbytes' nf4 (memory.weights nf4): its layers hold their weights in bitsandbytes' own
parameter class, which block swap cannot move layer by layer and torch.compile does not trace (config/schema
refuses both pairs). These are plain uint8 and bf16 tensors: the streaming load stores them as it reads each
weight, block swap moves them, compiled blocks take them, on any device. torchao's int4 weight-only tensors are
made for its inference kernels' packed layouts, one per backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils import own_parameter
from .fp8 import Fp8Linear, _compute_dtype, _MadeByStore
from .fp8 import convertible as fp8_convertible

LEVELS = 15  # the largest 4-bit code


def quantize(w: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [out, in] as (packed uint8 [out, in / 2], scale [out, in / group_size], zero [same]); ``dtype``: the
    scales' (the compute dtype). The codes are rounded against the stored (rounded) scale and zero, so
    :func:`dequantize` is within half a step of ``w`` wherever the scale is."""
    out, cols = w.shape
    g = w.float().reshape(out, cols // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / LEVELS).clamp(min=1e-12).to(dtype)
    zero = lo.to(dtype)
    q = ((g - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, LEVELS).to(torch.uint8)
    q = q.reshape(out, cols)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype``: what every forward and input gradient below multiplies with."""
    out = packed.shape[0]
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(out, scale.shape[1], -1)
    w = q.to(dtype) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]
    return w.reshape(out, -1)


class _Int4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, scale, zero, bias):
        dtype = _compute_dtype(x)
        ctx.save_for_backward(packed, scale, zero)
        with torch.autocast(x.device.type, enabled=False):
            w = dequantize(packed, scale, zero, dtype)
            return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, gy):
        packed, scale, zero = ctx.saved_tensors
        return gy @ dequantize(packed, scale, zero, gy.dtype), None, None, None, None


@torch.library.custom_op("difftrain::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x, dequantize(packed, scale, zero, x.dtype), bias)


@int4_linear.register_fake
def _(x, packed, scale, zero, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.custom_op("difftrain::int4_linear_grad_input", mutates_args=())
def int4_linear_grad_input(
    gy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    return gy @ dequantize(packed, scale, zero, gy.dtype)


@int4_linear_grad_input.register_fake
def _(gy, packed, scale, zero):
    return gy.new_empty((*gy.shape[:-1], packed.shape[1] * 2))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2], inputs[3])


def _backward(ctx, gy):
    packed, scale, zero = ctx.saved_tensors
    return int4_linear_grad_input(gy, packed, scale, zero), None, None, None, None


int4_linear.register_autograd(_backward, setup_context=_setup)


class Int4Linear(_MadeByStore, torch.nn.Linear):
    """A Linear whose frozen weight is stored by :func:`store` (``in_features`` and ``out_features`` stay the
    layer's, which peft reads for a LoRA's sizes)."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            dtype = _compute_dtype(x)
            bias = None if self.bias is None else self.bias.to(dtype)
            return int4_linear(x.to(dtype), self.weight, self.int4_scale, self.int4_zero, bias)
        return _Int4Linear.apply(x, self.weight, self.int4_scale, self.int4_zero, self.bias)


def convertible(m: torch.nn.Module, name: str, group_size: int, skip: tuple[str, ...] = ()) -> bool:
    """Whether ``m`` (named ``name``) is stored in int4: a frozen-able Linear outside ``skip`` (fnmatch patterns,
    the family's high-precision modules) whose input width is a whole number of groups (and even)."""
    if fp8_convertible(m, name, skip) is not Fp8Linear:  # a plain Linear outside skip (fp8's test)
        return False
    assert isinstance(m, torch.nn.Linear)  # what fp8's test said
    return m.in_features % group_size == 0 and group_size % 2 == 0


def store(m: torch.nn.Module, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, compute_dtype) -> None:
    """Make the Linear ``m`` an int4 layer holding ``packed`` and its groups' ``scale`` and ``zero`` (compute_dtype:
    the dtype its weight had, which peft reads for the adapters' dtype, as over fp8 layers)."""
    assert type(m) in (torch.nn.Linear, Int4Linear), f"{type(m).__name__} has no int4 form"
    m.weight = own_parameter(packed, requires_grad=False)  # packed may be a view into a pinned slab (block swap)
    m.register_buffer("int4_scale", scale)
    m.register_buffer("int4_zero", zero)
    m.compute_dtype = compute_dtype  # a plain attribute peft reads
    m.__class__ = Int4Linear


def convert(module: torch.nn.Module, device, group_size: int = 64, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Store every frozen Linear weight of ``module`` that :func:`convertible` takes in int4 on ``device``, layer by
    layer (the module may sit on the CPU: only each layer's int4 copy goes to ``device``). Returns
    {"int4_params": weights stored in int4, "kept_params": the rest}."""
    counts = {"int4_params": 0, "kept_params": 0}
    with torch.no_grad():
        for name, m in module.named_modules():
            if not convertible(m, name, group_size, skip) or m.weight.requires_grad:
                continue
            dtype = m.weight.dtype
            w = m.weight.to(device)
            packed, scale, zero = quantize(w, group_size, dtype)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(m.bias.to(device), requires_grad=False)
            store(m, packed, scale, zero, dtype)
            counts["int4_params"] += w.numel()
    module.to(device)
    counts["kept_params"] = sum(p.numel() for p in module.parameters() if p.dtype != torch.uint8)
    return counts
