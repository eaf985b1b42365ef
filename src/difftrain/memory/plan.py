"""The memory plan: techniques applied in a fixed order to the loaded modules.

Order: load (weights dtype) -> adapters (done by the trainer) -> activations
-> offload -> engine -> optimizer. This first version holds the techniques
that need no optional engine: the storage dtype of frozen weights and
gradient checkpointing. Each later technique is one module here.
"""

from __future__ import annotations

import torch

from ..config.schema import MemoryConfig
from .optimizers import make_optimizer  # noqa: F401  (the plan's optimizer step)

WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def weights_dtype(mem: MemoryConfig) -> torch.dtype:
    return WEIGHT_DTYPES[mem.weights.kind]


def apply_activations(mem: MemoryConfig, module: torch.nn.Module) -> None:
    """Gradient checkpointing through the module's own switch (diffusers or transformers)."""
    if mem.activations.kind != "checkpoint":
        return
    if hasattr(module, "enable_gradient_checkpointing"):
        module.enable_gradient_checkpointing()
    elif hasattr(module, "gradient_checkpointing_enable"):
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:  # pragma: no cover - every family's trainable module has one of the two
        raise TypeError(f"{type(module).__name__} has no gradient checkpointing switch")
