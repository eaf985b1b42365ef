"""SDXL's GEGLU gate (``h * gelu(g)`` over the two halves of the projection) with its backward as one Triton kernel.

Why our own kernel: under torch.compile inductor fuses the gate's backward (the two halves' gradients and their
concatenation) into one kernel, but on an H100 that kernel runs at under half its memory roofline: 0.145 ms
against 0.063 at SDXL's 1280-channel shape (batch 4, 32x32), 0.290 against 0.125 at the 640-channel one (64x64);
this kernel takes 0.072 and 0.146 (``benchmarks/geglu.py``, docs/benchmarks.md). It reads the projection and the
gradient once and writes both halves of the projection's gradient. It is a torch custom op
(``torch.library.triton_op``): inductor keeps it as it is inside compiled regions and CUDA graphs record it. The
forward stays diffusers' own, which inductor fuses well.

The arithmetic is inductor's: bf16 in, fp32 inside, one rounding on the way out (exact erf GELU, as ``F.gelu``
with ``approximate="none"``). Where Triton or CUDA is missing the module is left as diffusers wrote it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def _block(inner: int) -> int:
    """The widest power of two up to 1,024 that divides ``inner`` (no masked tail), else 1,024."""
    b = 1024
    while b > 64 and inner % b:
        b //= 2
    return b if inner % b == 0 else 1024


@functools.cache
def _ops() -> Any:
    """Defines the backward's custom op on first use (Triton is imported only here: CPU installs have none)."""
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _bwd(p_ptr, d_ptr, o_ptr, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inner
        base = p_ptr + row * 2 * inner
        h = tl.load(base + cols, mask=m).to(tl.float32)
        g = tl.load(base + inner + cols, mask=m).to(tl.float32)
        d = tl.load(d_ptr + row * inner + cols, mask=m).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327
        out = o_ptr + row * 2 * inner
        tl.store(out + cols, (d * g * cdf).to(o_ptr.dtype.element_ty), mask=m)
        tl.store(out + inner + cols, (d * h * (cdf + g * pdf)).to(o_ptr.dtype.element_ty), mask=m)

    @triton_op("difftrain::geglu_gate_backward", mutates_args=())
    def gate_backward(proj: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        inner = proj.shape[-1] // 2
        out = torch.empty_like(proj)
        rows, b = proj.numel() // proj.shape[-1], _block(inner)
        wrap_triton(_bwd)[(rows, triton.cdiv(inner, b))](proj, grad, out, inner, BLOCK=b, num_warps=4)
        return out

    return gate_backward


def _backward_reference(proj: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gate's backward in torch ops (the kernel's arithmetic: fp32 inside, one rounding)."""
    h, g = proj.float().chunk(2, dim=-1)
    d = grad.float()
    cdf = 0.5 * (1.0 + torch.erf(g * 0.7071067811865476))
    pdf = torch.exp(-0.5 * g * g) * 0.3989422804014327
    return torch.cat([d * g * cdf, d * h * (cdf + g * pdf)], dim=-1).to(proj.dtype)


class _Gate(torch.autograd.Function):
    """The forward is diffusers' (inductor fuses it well: 0.039 ms against the Triton kernel's 0.045 at SDXL's
    1280-channel shape), the backward the kernel."""

    @staticmethod
    def forward(ctx: Any, proj: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(proj)
        return gate_reference(proj)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (proj,) = ctx.saved_tensors
        if proj.is_cuda:
            return torch.ops.difftrain.geglu_gate_backward(proj.contiguous(), grad.contiguous())
        return _backward_reference(proj, grad)


def gate_reference(proj: torch.Tensor) -> torch.Tensor:
    """diffusers' GEGLU gate, the kernels' reference."""
    h, g = proj.chunk(2, dim=-1)
    return h * F.gelu(g)


def available(device: torch.device) -> str | None:
    """Why the fused gate cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 7:  # Triton's oldest target is Volta
        return f"compute capability {major}.{minor} (Triton needs 7.0 or newer)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def _forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return _Gate.apply(self.proj(hidden_states))


def count(module: torch.nn.Module) -> int:
    """How many of diffusers' GEGLUs (fused or not) are under ``module``."""
    from diffusers.models.activations import GEGLU

    return sum(isinstance(m, GEGLU) for m in module.modules())


def use_fused(module: torch.nn.Module) -> int:
    """Gives every diffusers GEGLU under ``module`` (itself included) the fused gate; returns how many. The
    weights and their names are untouched (only the forward changes), so checkpoints and LoRAs are as before."""
    from diffusers.models.activations import GEGLU

    n = 0
    for m in module.modules():
        if type(m) is GEGLU:
            m.__class__ = fused_class()
            n += 1
    if n and torch.cuda.is_available():
        _ops()  # registered before anything is traced
    return n


@functools.cache
def fused_class() -> type:
    """diffusers' GEGLU with the fused gate (built on first use: importing diffusers is slow)."""
    from diffusers.models.activations import GEGLU

    return type("FusedGEGLU", (GEGLU,), {"forward": _forward, "__module__": __name__})


def __getattr__(name: str) -> Any:  # pickle and copy find the class by its name
    if name == "FusedGEGLU":
        return fused_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
