"""fp8 base weights: frozen Linear/Conv2d weights stored as float8 (e4m3fn) with a scale.

Each forward upcasts the weight to the compute dtype inside one autograd
function (Linear) or custom op (Conv2d) that saves only the fp8 weight for
backward, which upcasts again. A plain ``w.to(bf16)`` before ``F.linear`` would
leave the bf16 copy alive until backward (autograd keeps it for the input
gradient), so nothing would be saved without checkpointing. Layers keep their
class (a subclass of nn.Linear / nn.Conv2d), so peft still wraps them with
LoRA. Norms, embeddings and the layers the family names stay in high
precision. LoRA only: a frozen weight can be rounded once; a trained one would
lose every update.

Scale: ``tensor`` (one scale, amax / 448) or ``channel`` (one per output
channel: better where a few rows have large values).
"""

from __future__ import annotations

import fnmatch
from typing import Optional

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    if per_channel:
        amax = w.abs().reshape(w.shape[0], -1).amax(dim=1).reshape(-1, *([1] * (w.ndim - 1)))
    else:
        amax = w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w / scale).to(FP8), scale


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w8, scale, bias):
        dtype = _compute_dtype(x)
        w = w8.to(dtype) * scale.to(dtype)
        ctx.save_for_backward(w8, scale)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, gy):
        w8, scale = ctx.saved_tensors
        # The operands swapped on purpose (the same product): under torch.compile AOT autograd traces forward and
        # backward into one graph and CSE merges two identical upcasts into one node, which the partitioner then
        # keeps for backward - a bf16 copy of every weight (measured 4.8 GiB over the SDXL UNet on an H100).
        # Written differently it is not merged, and only the fp8 weight (a parameter) is kept.
        # tests/integration/test_compile_checkpoint.py fails if that changes.
        w = scale.to(gy.dtype) * w8.to(gy.dtype)
        return gy @ w, None, None, None


# Conv2d goes through a custom op, opaque to the compiler: traced as the Linear above, inductor's layout
# optimisation turns the fp8 weight channels-last in the forward and keeps that fp8 copy for backward (the CPU test
# saw it). Opaque, the op saves the fp8 parameter itself. Its Python dispatch costs more per call than a traced
# upcast, which is why Linear (hundreds of layers) is not done this way; a UNet has few convolutions.
@torch.library.custom_op("difftrain::fp8_conv2d", mutates_args=())
def fp8_conv2d(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], stride: list[int],
               padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return F.conv2d(x, w8.to(x.dtype) * scale.to(x.dtype), bias, stride, padding, dilation, groups)


@fp8_conv2d.register_fake
def _(x, w8, scale, bias, stride, padding, dilation, groups):
    w = torch.empty(w8.shape, dtype=x.dtype, device="meta")
    shape = F.conv2d(torch.empty(x.shape, dtype=x.dtype, device="meta"), w, None, stride, padding, dilation, groups).shape
    return x.new_empty(shape)


@torch.library.custom_op("difftrain::fp8_conv2d_grad_input", mutates_args=())
def fp8_conv2d_grad_input(gy: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, input_shape: list[int],
                          stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    w = w8.to(gy.dtype) * scale.to(gy.dtype)
    return torch.nn.grad.conv2d_input(input_shape, w, gy, stride, padding, dilation, groups)


@fp8_conv2d_grad_input.register_fake
def _(gy, w8, scale, input_shape, stride, padding, dilation, groups):
    return gy.new_empty(input_shape)


def _conv_setup(ctx, inputs, output):
    x, w8, scale, _, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(w8, scale)
    ctx.conf = (list(x.shape), stride, padding, dilation, groups)


def _conv_backward(ctx, gy):
    w8, scale = ctx.saved_tensors
    return (fp8_conv2d_grad_input(gy, w8, scale, *ctx.conf), *[None] * 7)


fp8_conv2d.register_autograd(_conv_backward, setup_context=_conv_setup)


class Fp8Linear(torch.nn.Linear):
    def forward(self, x):
        return _Fp8Linear.apply(x, self.weight, self.fp8_scale, self.bias)


class Fp8Conv2d(torch.nn.Conv2d):
    def forward(self, x):
        if self.padding_mode != "zeros":  # pragma: no cover - diffusers' convs are zero-padded
            raise NotImplementedError("fp8 Conv2d supports zero padding only")
        dtype = _compute_dtype(x)
        return fp8_conv2d(x.to(dtype), self.weight, self.fp8_scale, None if self.bias is None else self.bias.to(dtype),
                          list(self.stride), list(self.padding), list(self.dilation), self.groups)


def convert(module: torch.nn.Module, device, per_channel: bool = False, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Store every frozen Linear/Conv2d weight of ``module`` in fp8 on ``device``, layer by layer.

    The module may sit on the CPU: each layer is quantized on ``device`` and only
    its fp8 copy stays there, so GPU memory never holds the high-precision model.
    Returns {"fp8_params": n, "kept_params": n}.
    """
    counts = {"fp8_params": 0, "kept_params": 0}
    with torch.no_grad():
        for name, m in module.named_modules():
            kind = {torch.nn.Linear: Fp8Linear, torch.nn.Conv2d: Fp8Conv2d}.get(type(m))
            # a LoRA-wrapped layer's weight sits in "<name>.base_layer": match the layer's own name
            plain = name.removesuffix(".base_layer")
            if kind is None or m.weight.requires_grad or any(fnmatch.fnmatch(plain, pat) for pat in skip):
                continue
            if kind is Fp8Conv2d and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
                continue
            w8, scale = quantize(m.weight.to(device), per_channel)
            m.weight = torch.nn.Parameter(w8, requires_grad=False)
            m.register_buffer("fp8_scale", scale)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(m.bias.to(device), requires_grad=False)
            m.__class__ = kind
            counts["fp8_params"] += w8.numel()
    module.to(device)  # everything else (norms, embeddings, LoRA, skipped layers) as it is
    counts["kept_params"] = sum(p.numel() for p in module.parameters() if p.dtype != FP8)
    return counts
