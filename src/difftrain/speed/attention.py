"""speed.attention: the scaled-dot-product-attention kernel a step runs (torch's SDPA backends, or FlashAttention-4
for the long attention through ``fa4``), and a check that the chosen one runs on this device."""

from __future__ import annotations

import contextlib

import torch

from ..config.schema import SpeedConfig
from ..errors import BackendUnavailable

_SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def attention_context(speed: SpeedConfig, device: torch.device, avoid_cudnn: bool = False):
    """A context choosing the scaled-dot-product-attention kernel (held over forward and backward: checkpointed
    blocks recompute their forward inside backward). ``auto`` leaves torch's choice, but for a family whose shapes
    cuDNN's kernel fails on (``avoid_cudnn``: Flux) it lets torch choose among the others."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # torch's choice among all but cuDNN, for auto and for the calls fa4 leaves to SDPA
    no_cudnn = None
    if avoid_cudnn and device.type == "cuda" and speed.attention in ("auto", "fa4"):
        others = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        no_cudnn = sdpa_kernel(others, set_priority=True)
    if speed.attention == "auto":
        return no_cudnn or contextlib.nullcontext()

    if speed.attention == "fa4":  # FA4 for long self-attention, SDPA (torch's choice) for the rest: fa4.py
        from . import fa4

        if no_cudnn is None:
            return fa4.routed()
        stack = contextlib.ExitStack()
        stack.enter_context(fa4.routed())
        stack.enter_context(no_cudnn)
        return stack
    if device.type != "cuda" and speed.attention in ("cudnn", "efficient"):
        raise BackendUnavailable(
            f"speed.attention {speed.attention} runs on CUDA GPUs only.",
            hint="Use speed.attention: auto (or flash / math) on this device.",
        )
    return sdpa_kernel(getattr(SDPBackend, _SDPA[speed.attention]))


def check_attention(speed: SpeedConfig, device: torch.device) -> None:
    """Run the chosen kernel once on a small input, so an unsupported choice is named before the model loads."""
    if speed.attention == "auto":
        return
    if speed.attention == "fa4":
        from . import fa4

        fa4.check(device)
        return
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, 64, 64, device=device, dtype=dtype, requires_grad=True)
    try:
        with attention_context(speed, device):
            torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    except RuntimeError as e:
        raise BackendUnavailable(
            f"speed.attention {speed.attention} does not run on this device: {str(e).splitlines()[0][:200]}",
            hint="Use speed.attention: auto.",
        ) from None
