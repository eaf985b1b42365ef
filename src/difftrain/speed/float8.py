"""speed.float8: torchao's float8 training on the Linear layers fp8 matmuls take."""

from __future__ import annotations

import torch

from ..errors import BackendUnavailable


def float8_training(module: torch.nn.Module, device: torch.device) -> int:
    """torchao's float8 training on every Linear whose sizes fp8 matmuls take (multiples of 16); returns how many.
    Why torchao: it is the fp8 training recipe PyTorch maintains (dynamic scaling, FSDP-aware), nothing to rewrite."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise BackendUnavailable(
            "speed.float8 needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper).",
            hint="Set speed.float8: false on this device.",
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise BackendUnavailable(
            "speed.float8 needs torchao, which is not installed.",
            hint="pip install 'difftrain[torchao]', or set speed.float8: false",
        ) from None
    before = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
    # pad_inner_dim: a weight gradient's inner dimension is the token count (SDXL's 77 text tokens, SD3's 333),
    # which an fp8 matmul takes only in multiples of 16 (measured: the tiny SDXL's 2 x 77 failed without it)
    convert_to_float8_training(module, config=Float8LinearConfig(pad_inner_dim=True), module_filter_fn=float8_eligible)
    return before - sum(type(m) is torch.nn.Linear for m in module.modules())


def float8_eligible(mod: torch.nn.Module, fqn: str) -> bool:
    """Linear layers over tokens with fp8-sized features. Not the embedding and adaptive-norm layers (``*emb*``,
    ``*norm*``): they take one vector per sample, and an fp8 matmul needs the rows (the batch) in multiples of 16."""
    name = fqn.lower()
    return (
        isinstance(mod, torch.nn.Linear)
        and mod.in_features % 16 == 0
        and mod.out_features % 16 == 0
        and "emb" not in name
        and "norm" not in name
    )
