"""fp8 base weights: frozen Linear/Conv2d weights stored as float8 (e4m3fn) with a scale.

Each forward upcasts the weight to the compute dtype inside one autograd
function that saves only the fp8 weight for backward. A plain ``w.to(bf16)``
before ``F.linear`` would leave the bf16 copy alive until backward (autograd
keeps it for the input gradient), so nothing would be saved without
checkpointing. Layers keep their class (a subclass of nn.Linear / nn.Conv2d),
so peft still wraps them with LoRA. Norms, embeddings and the layers the
family names stay in high precision. LoRA only: a frozen weight can be
rounded once; a trained one would lose every update.

Scale: ``tensor`` (one scale, amax / 448) or ``channel`` (one per output
channel: better where a few rows have large values).
"""

from __future__ import annotations

import fnmatch
import functools
import math

import torch
import torch.nn.functional as F
import torch.nn.grad  # a submodule torch.nn loads but does not name for type checkers
from torch.utils.flop_counter import register_flop_formula

from ..utils import own_parameter

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


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in the compute dtype: what every forward and input-gradient below multiplies with."""
    return w8.to(dtype) * scale.to(dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w8, scale, bias):
        dtype = _compute_dtype(x)
        w = dequantize(w8, scale, dtype)
        ctx.save_for_backward(w8, scale)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, gy):
        w8, scale = ctx.saved_tensors
        w = dequantize(w8, scale, gy.dtype)
        return gy @ w, None, None, None


class _Fp8Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w8, scale, bias, stride, padding, dilation, groups):
        dtype = _compute_dtype(x)
        w = dequantize(w8, scale, dtype)
        ctx.save_for_backward(w8, scale)
        ctx.conf = (x.shape, stride, padding, dilation, groups)
        with torch.autocast(x.device.type, enabled=False):
            return F.conv2d(x.to(dtype), w, None if bias is None else bias.to(dtype), stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, gy):
        w8, scale = ctx.saved_tensors
        shape, stride, padding, dilation, groups = ctx.conf
        w = dequantize(w8, scale, gy.dtype)
        gx = torch.nn.grad.conv2d_input(shape, w, gy, stride, padding, dilation, groups)
        return gx, None, None, None, None, None, None, None


# Under torch.compile the autograd functions above lose their point: AOT autograd traces forward and backward
# into one graph, CSE merges the two upcasts, and the partitioner saves the bf16 weight for backward (measured on
# an H100: every fp8 layer of an SDXL block kept its bf16 copy, 4.8 GiB over the UNet, checkpointed or not).
# So compiled code calls these custom ops instead: opaque to the tracer, each upcasts inside itself, and only the
# fp8 weight and its scale (parameters, free to keep) are saved. Eager code keeps the autograd functions: the
# memory tiers were measured with them, and the custom ops' per-call cost in eager runs is not measured yet (if
# it is no higher, both paths can become the custom ops). Tried and measured worse: tracing the autograd function
# with its backward upcast written differently (scale * w8) so CSE cannot merge it - on the CPU no copy was kept,
# but on an H100 the 4 GiB tier peaked at 6.46 GiB instead of 3.29 (S1g, benchmarks/speed.py), and inductor's
# layout optimisation kept an fp8 channels-last copy of each conv weight.
@torch.library.custom_op("difftrain::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x, dequantize(w8, scale, x.dtype), bias)


@fp8_linear.register_fake
def _(x, w8, scale, bias):
    return x.new_empty((*x.shape[:-1], w8.shape[0]))


@torch.library.custom_op("difftrain::fp8_linear_grad_input", mutates_args=())
def fp8_linear_grad_input(gy: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return gy @ dequantize(w8, scale, gy.dtype)


@fp8_linear_grad_input.register_fake
def _(gy, w8, scale):
    return gy.new_empty((*gy.shape[:-1], w8.shape[1]))


def _linear_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _linear_backward(ctx, gy):
    w8, scale = ctx.saved_tensors
    return fp8_linear_grad_input(gy, w8, scale), None, None, None


fp8_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("difftrain::fp8_conv2d", mutates_args=())
def fp8_conv2d(
    x: torch.Tensor,
    w8: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        # contiguous, as the fake kernel below says: a channels-last input or weight (speed.channels_last) would
        # give a channels-last output, whose strides compiled graphs check against the fake's
        return F.conv2d(x, dequantize(w8, scale, x.dtype), bias, stride, padding, dilation, groups).contiguous()


@fp8_conv2d.register_fake
def _(x, w8, scale, bias, stride, padding, dilation, groups):
    w = torch.empty(w8.shape, dtype=x.dtype, device="meta")
    shape = F.conv2d(
        torch.empty(x.shape, dtype=x.dtype, device="meta"), w, None, stride, padding, dilation, groups
    ).shape
    return x.new_empty(shape)


@torch.library.custom_op("difftrain::fp8_conv2d_grad_input", mutates_args=())
def fp8_conv2d_grad_input(
    gy: torch.Tensor,
    w8: torch.Tensor,
    scale: torch.Tensor,
    input_shape: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    w = dequantize(w8, scale, gy.dtype)
    return torch.nn.grad.conv2d_input(input_shape, w, gy, stride, padding, dilation, groups).contiguous()


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


# speed.fp8_matmul: the forward and the input gradient of an fp8-stored Linear as fp8 matmuls (torch._scaled_mm),
# what musubi-tuner's --fp8_fast does in its forward. The weight is the stored e4m3 tensor with its one scale; the
# input (and in backward the output gradient) is cast to e4m3 with a scale per row (token), the rowwise scaling
# Hopper's fp8 matmuls take. The input gradient multiplies by the weight's transpose, which _scaled_mm takes in
# column-major order: a transposed copy of the fp8 weight per backward (its bytes, against the matmul's
# 2 x tokens x in x out FLOPs). Opt-in: activations rounded to 3 mantissa bits change what is learned a little.
def rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as e4m3 with one float32 scale per row ([M, 1]), in torch ops (the CPU's way, and the reference
    the Triton kernel below is checked against)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).to(FP8), scale


def _rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 matmul ops' row cast: the torch ops, until the Triton kernel below has been checked and timed on a GPU
    (then: ``rows_fp8_triton(x) if x.is_cuda else rows_fp8_torch(x)``, the same bits)."""
    return rows_fp8_torch(x)


# The row cast above as one Triton kernel, for the fp8 matmul ops to use on a GPU once measured there (not yet:
# benchmarks/fp8_rows.py times it against the torch ops, tests/gpu checks it gives their bits). Why our own: the fp8
# matmul ops are opaque to inductor (the autograd rule that saves only the fp8 weight needs them to be), so the cast
# inside them runs as eager torch ops, five kernels with float32 copies: about 25 bytes moved per element where one
# pass needs 5 (read the row twice, write a byte). FLUX.2 [dev] at 1024x1024 casts ~8.5 billion input elements a
# forward (~16 billion output-gradient ones a backward): some 200 GB moved where 40 GB would do, in 1.4 s steps.
# torch has no fused rowwise fp8 cast (torchao's rowwise scaling leaves the fusing to torch.compile, which cannot
# see inside these ops). One program a row: its absolute maximum, then the cast, with the torch ops' arithmetic
# (float32, IEEE division, round to nearest even; Triton's e4m3 saturates where torch's gives NaN, past 464, which
# a row scaled to its own maximum never reaches), so both give the same bits.
@functools.cache
def _rows_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rows_fp8(x_ptr, q_ptr, s_ptr, k, stride, FMAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = x_ptr + row * stride
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(src + cols, mask=cols < k, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(v))
        scale = tl.maximum(tl.max(acc, axis=0) / FMAX, 1e-12)
        tl.store(s_ptr + row, scale)
        dst = q_ptr + row * k
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(src + cols, mask=cols < k, other=0.0).to(tl.float32)
            tl.store(dst + cols, tl.div_rn(v, scale).to(tl.float8e4nv), mask=cols < k)

    return rows_fp8


def rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rows_fp8_torch` as one Triton kernel: ``x`` [M, K] on a CUDA GPU (compute capability 8.9+)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, max(128, 1 << (k - 1).bit_length()))
        with torch.cuda.device(x.device):
            _rows_kernel()[(m,)](x, q, scale, k, x.stride(0), FP8_MAX, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return q, scale


def _mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=dtype)


@torch.library.custom_op("difftrain::fp8_mm_linear", mutates_args=())
def fp8_mm_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    x8, sx = _rows_fp8(x2)
    sw = scale.float().reshape(1, 1).expand(1, w8.shape[0]).contiguous()
    y = _mm(x8, w8.t(), sx, sw, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], w8.shape[0])


@fp8_mm_linear.register_fake
def _(x, w8, scale, bias):
    return x.new_empty((*x.shape[:-1], w8.shape[0]))


@torch.library.custom_op("difftrain::fp8_mm_linear_grad_input", mutates_args=())
def fp8_mm_linear_grad_input(gy: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    g2 = gy.reshape(-1, gy.shape[-1])
    g8, sg = _rows_fp8(g2)
    sw = scale.float().reshape(1, 1).expand(1, w8.shape[1]).contiguous()
    gx = _mm(g8, w8.t().contiguous().t(), sg, sw, gy.dtype)  # the weight as [out, in] in column-major order
    return gx.reshape(*gy.shape[:-1], w8.shape[1])


@fp8_mm_linear_grad_input.register_fake
def _(gy, w8, scale):
    return gy.new_empty((*gy.shape[:-1], w8.shape[1]))


def _mm_backward(ctx, gy):
    w8, scale = ctx.saved_tensors
    return fp8_mm_linear_grad_input(gy, w8, scale), None, None, None


fp8_mm_linear.register_autograd(_mm_backward, setup_context=_linear_setup)


# The custom ops are opaque to torch.utils.flop_counter (bench speed's model FLOPs, hence MFU): their matmuls are
# counted as the Linear's would be (2 x rows x in x out each), so an fp8-matmul run's MFU reads against the same FLOPs
# as its bf16 run (2026-11-28: Krea 2 with fp8 matmuls was reported at 9 % MFU, its matmuls uncounted).
@register_flop_formula(torch.ops.difftrain.fp8_mm_linear)
def _fp8_mm_linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]


@register_flop_formula(torch.ops.difftrain.fp8_mm_linear_grad_input)
def _fp8_mm_linear_grad_input_flops(gy_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(gy_shape[:-1]) * w_shape[0] * w_shape[1]


def fp8_matmul_ok(m: torch.nn.Module) -> bool:
    """Whether an fp8 Linear can compute as fp8 matmuls: one scale for the tensor (a per-channel scale lies along
    the input gradient's inner dimension, which rowwise scaling cannot take) and sizes in multiples of 16."""
    if not isinstance(m, Fp8Linear):
        return False
    scale = m.get_buffer("fp8_scale")
    return scale.numel() == 1 and m.in_features % 16 == 0 and m.out_features % 16 == 0


class _MadeByStore:
    """fp8 layers are made by :func:`store` (a class change of a loaded layer), never constructed. peft constructs
    a conv LoRA's two layers as ``type(base_layer)(...)``: over an fp8 base (the streaming load stores fp8 before
    the adapters are added) that call gets the plain layer, as it did over the bf16 base. A call without arguments
    (copy.deepcopy, pickle) makes the fp8 class as usual."""

    def __new__(cls, *args, **kwargs):
        if args or kwargs:
            return cls.__mro__[2](*args, **kwargs)  # Fp8Conv2d -> _MadeByStore -> nn.Conv2d
        return super().__new__(cls)


class Fp8Linear(_MadeByStore, torch.nn.Linear):
    #: speed.fp8_matmul set on this layer (fp8_matmul_ok): its forward and input gradient are fp8 matmuls
    fp8_matmul = False

    def forward(self, x):
        if self.fp8_matmul:
            dtype = _compute_dtype(x)
            bias = None if self.bias is None else self.bias.to(dtype)
            return fp8_mm_linear(x.to(dtype), self.weight, self.fp8_scale, bias)
        if torch.compiler.is_compiling():
            dtype = _compute_dtype(x)
            return fp8_linear(
                x.to(dtype), self.weight, self.fp8_scale, None if self.bias is None else self.bias.to(dtype)
            )
        return _Fp8Linear.apply(x, self.weight, self.fp8_scale, self.bias)


class Fp8Conv2d(_MadeByStore, torch.nn.Conv2d):
    def forward(self, x):
        if self.padding_mode != "zeros":  # pragma: no cover - diffusers' convs are zero-padded
            raise NotImplementedError("fp8 Conv2d supports zero padding only")
        if torch.compiler.is_compiling():
            dtype = _compute_dtype(x)
            return fp8_conv2d(
                x.to(dtype),
                self.weight,
                self.fp8_scale,
                None if self.bias is None else self.bias.to(dtype),
                list(self.stride),
                list(self.padding),
                list(self.dilation),
                self.groups,
            )
        return _Fp8Conv2d.apply(
            x, self.weight, self.fp8_scale, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


def convertible(m: torch.nn.Module, name: str, skip: tuple[str, ...] = ()) -> type | None:
    """The fp8 class ``m`` (named ``name`` in its model) becomes, or None where it stays as it is: frozen
    Linear / zero-padded Conv2d layers only, not those ``skip`` names (fnmatch patterns; a LoRA-wrapped layer's
    weight sits in ``<name>.base_layer``: the layer's own name is matched)."""
    kind = {torch.nn.Linear: Fp8Linear, torch.nn.Conv2d: Fp8Conv2d}.get(type(m))
    plain = name.removesuffix(".base_layer")
    if kind is None or any(fnmatch.fnmatch(plain, pat) for pat in skip):
        return None
    if kind is Fp8Conv2d and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
        return None
    return kind


def store(m: torch.nn.Module, w8: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype) -> None:
    """Make ``m`` (a layer :func:`convertible` accepts) an fp8 layer holding ``w8`` and its ``scale``.

    ``compute_dtype``: the dtype the weight had, which peft reads (a layer's ``compute_dtype``, as bitsandbytes'
    layers have) to give LoRA adapters added over it that dtype rather than fp8's: the adapter's initial weights
    are rounded as over a bf16 layer, whether the fp8 copy was made before the adapter (the streaming load) or
    after it."""
    kind = convertible(m, "")
    assert kind is not None, f"{type(m).__name__} has no fp8 form"
    m.weight = own_parameter(w8, requires_grad=False)  # w8 may be a view into a pinned slab (block swap)
    m.register_buffer("fp8_scale", scale)
    m.compute_dtype = compute_dtype  # type: ignore[assignment]  # a plain attribute (Module types unknown ones)
    m.__class__ = kind


def convert(module: torch.nn.Module, device, per_channel: bool = False, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Store every frozen Linear/Conv2d weight of ``module`` in fp8 on ``device``, layer by layer.

    The module may sit on the CPU: each layer is quantized on ``device`` and only
    its fp8 copy stays there, so GPU memory never holds the high-precision model.
    Returns {"fp8_params": n, "kept_params": n}.
    """
    counts = {"fp8_params": 0, "kept_params": 0}
    with torch.no_grad():
        for name, m in module.named_modules():
            if convertible(m, name, skip) is None or m.weight.requires_grad:
                continue
            dtype = m.weight.dtype
            w8, scale = quantize(m.weight.to(device), per_channel)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(m.bias.to(device), requires_grad=False)
            store(m, w8, scale, dtype)
            counts["fp8_params"] += w8.numel()
    module.to(device)  # everything else (norms, embeddings, LoRA, skipped layers) as it is
    counts["kept_params"] = sum(p.numel() for p in module.parameters() if p.dtype != FP8)
    return counts
