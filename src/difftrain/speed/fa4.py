"""speed.attention ``fa4``: FlashAttention-4 (the ``flash-attn-4`` package's CuTe-DSL kernels, Hopper and Blackwell)
for the long self-attention it measured faster on, torch's SDPA for the rest.

Why our own wrapper: torch 2.11's SDPA hook for FA4 (``torch.nn.attention.activate_flash_attention_impl("FA4")``)
calls an older FA4 API and fails against flash-attn-4 4.0.0b36 ("too many values to unpack"), and the package's
own ``flash_attn_func`` is an autograd.Function that torch.compile would trace into. Here FA4's forward and backward
are two torch custom ops (opaque to the compiler, with shape-only fake versions), joined by ``register_autograd``.

Measured on an H100 (2026-11-26, ``benchmarks/attention_kernels.py``, bf16, head size 64, forward + backward):
CogVideoX-2b's 17,776-token self-attention 15.7 ms against cuDNN's 20.2 and flash's 29.4; SDXL's 4,096-token
self-attention at batch 4 1.15 ms against 1.32 (cuDNN) and 2.12 (flash); at 1,024 tokens and for the 77-key
cross-attention FA4 was slower than SDPA (0.67 against 0.46-0.51 ms; 0.55-0.60 against 0.38-0.45), so calls with
fewer than ``MIN_KEYS`` keys stay on SDPA.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from ..errors import BackendUnavailable

#: the fewest keys a call needs to go to FA4 (measured: 4,096 faster, 1,024 and 77 slower than SDPA)
MIN_KEYS = 4096
_SDPA = F.scaled_dot_product_attention
_HINT = (
    "pip install flash-attn-4 (FlashAttention-4: CUDA compute capability 9.0 or newer), or use speed.attention: auto."
)


def _interface():
    try:
        from flash_attn.cute import interface  # optional: flash-attn-4, GPU machines only
    except ImportError as e:
        raise BackendUnavailable(f"speed.attention fa4 needs the flash-attn-4 package ({e}).", hint=_HINT) from None
    return interface


#: FA4 forward calls run so far in this process (the custom op's own code runs on every call, compiled or not; a
#: CUDA graph's replays skip it, its recording does not): a run with speed.attention fa4 says after its first step
#: whether any attention reached FA4 (one that silently ran SDPA measured exactly as fast as cuDNN)
calls = 0


@torch.library.custom_op("difftrain::fa4_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    global calls
    calls += 1
    out, lse = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]
    return out, lse


@_forward.register_fake
def _(q, k, v, scale):
    b, s, h, _ = q.shape
    return q.new_empty(b, s, h, v.shape[-1]), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("difftrain::fa4_backward", mutates_args=())
def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, False)[:3]
    return dq, dk, dv


@_backward.register_fake
def _(q, k, v, out, dout, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _grad(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward(q, k, v, out, dout, lse, ctx.scale)
    return dq, dk, dv, None


_forward.register_autograd(_grad, setup_context=_setup)


def _bhsd(shape) -> tuple[int, ...]:
    b, s, h, d = shape
    return (b, h, s, d)


# model FLOPs as torch counts SDPA's (bench's MFU), from FA4's [batch, tokens, heads, head size] shapes
@register_flop_formula(torch.ops.difftrain.fa4_forward)
def _forward_flops(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    return sdpa_flop_count(_bhsd(q_shape), _bhsd(k_shape), _bhsd(v_shape))


@register_flop_formula(torch.ops.difftrain.fa4_backward)
def _backward_flops(q_shape, k_shape, v_shape, o_shape, dout_shape, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(_bhsd(dout_shape), _bhsd(q_shape), _bhsd(k_shape), _bhsd(v_shape))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FA4 on SDPA's layout ([batch, heads, tokens, head size]; FA4 reads [batch, tokens, heads, head size], which
    is how diffusers' processors lay q, k and v out before their transpose, so no copy is made there)."""
    t = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    out, _ = _forward(*t, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(1, 2)


def eligible(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> bool:
    """Whether one SDPA call goes to FA4: CUDA, bf16/fp16, no mask, dropout or causality, the same heads for q, k
    and v, a head size FA4 takes, and at least MIN_KEYS keys."""
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.dtype == k.dtype == v.dtype
        and attn_mask is None
        and not dropout_p
        and not is_causal
        and not enable_gqa
        and q.dim() == 4
        and q.shape[1] == k.shape[1] == v.shape[1]
        and q.shape[-1] == k.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and k.shape[-2] >= MIN_KEYS
    )


def _as_autocast_casts(q, k, v):
    """q, k and v as SDPA sees them under autocast (it runs in the autocast dtype): training runs under autocast,
    where CogVideoX's q/k norms (LayerNorm, an fp32 op there) hand SDPA fp32 queries and keys beside bf16 values."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return q.to(dt), k.to(dt), v.to(dt)
    return q, k, v


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's ``scaled_dot_product_attention`` with FA4 taking the calls it measured faster on. The inputs are cast
    once, as autocast casts them for SDPA, and the cast ones go to either kernel (SDPA's own cast is then a no-op)."""
    q, k, v = _as_autocast_casts(q, k, v)
    if eligible(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return attention(q, k, v, scale)
    return _SDPA(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


@contextlib.contextmanager
def routed():
    """``torch.nn.functional.scaled_dot_product_attention`` is ``sdpa`` inside (diffusers' processors look it up
    on the module at each call; torch.compile traces ``sdpa`` and keeps the custom ops opaque). The same function
    object every time, so compiled code's guard on it holds from step to step."""
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA


def first_step_line(before: int) -> tuple[bool, str]:
    """After a run's first step: (whether FA4 ran, the line that says so). ``before``: ``calls`` at the step's start
    (the device check runs FA4 once before it)."""
    n = calls - before
    if n:
        return True, f"speed.attention fa4: FlashAttention-4 ran {n} attention calls in the first step"
    return False, (
        f"speed.attention fa4: no attention call of the first step reached FlashAttention-4 (it takes attention over "
        f"{MIN_KEYS:,} keys or more, without a mask or dropout, in bf16/fp16): this run's attention is SDPA's"
    )


def installed() -> bool:
    """Whether the flash-attn-4 package is importable (without importing its kernels)."""
    import importlib.util

    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # find_spec imports the parent package, flash_attn, which may fail
        return False


def unavailable(device: torch.device) -> str | None:
    """Why speed.attention ``auto`` does not take FA4 on this device (None: nothing stands in the way; ``check``
    then runs it once)."""
    if device.type != "cuda":
        return f"the device is {device.type}"
    if not installed():
        return "flash-attn-4 is not installed"
    return capability_problem(torch.cuda.get_device_capability(device))


def capability_problem(capability: tuple[int, int]) -> str | None:
    """Why a GPU of this compute capability has no FA4 kernels (None: it has)."""
    major, minor = capability
    if major not in (9, 10):  # FA4's kernels: sm90 (Hopper) and sm100/sm103 (Blackwell data-centre GPUs)
        return (
            f"FlashAttention-4 runs on compute capability 9.x and 10.x (Hopper, Blackwell); this GPU is {major}.{minor}"
        )
    return None


def check(device: torch.device) -> None:
    """FA4 runs forward and backward once on this device (its kernels compile on first use), or a clear error."""
    if device.type != "cuda":
        raise BackendUnavailable(f"speed.attention fa4 runs on CUDA GPUs only, not {device.type}.", hint=_HINT)
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise BackendUnavailable(
            f"speed.attention fa4 needs compute capability 9.0 or newer (Hopper, Blackwell); this GPU is "
            f"{major}.{minor}.",
            hint="Use speed.attention: auto.",
        )
    _interface()
    q = torch.randn(1, 2, MIN_KEYS, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        attention(q, q, q).float().sum().backward()
    except Exception as e:  # noqa: BLE001  # the kernel's compile or launch, in whatever form the DSL raises it
        raise BackendUnavailable(
            f"speed.attention fa4 does not run on this device: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
            hint="Use speed.attention: auto.",
        ) from None
