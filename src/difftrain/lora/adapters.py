"""LoRA adapters through peft, the way the diffusers training examples add them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from peft import LoraConfig

from ..config.schema import LoraConfig as LoraSettings


def add_lora(module: torch.nn.Module, settings: LoraSettings, targets: Sequence[str]) -> list[torch.nn.Parameter]:
    """Add a LoRA adapter to ``module``; return its trainable parameters (kept in fp32)."""
    cfg = LoraConfig(
        r=settings.rank,
        # peft annotates an int, but a float alpha works as it is only divided by the rank
        lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        init_lora_weights="gaussian" if settings.init == "gaussian" else True,
        target_modules=list(targets),
    )
    module.add_adapter(cfg)  # type: ignore[operator]  # diffusers' PeftAdapterMixin, unknown to Module's type
    params = []
    for p in module.parameters():
        if p.requires_grad:
            # trainable weights in fp32 whatever the base dtype: the optimizer update
            # of a small LoRA delta would round away in bf16
            p.data = p.data.float()
            params.append(p)
    if not params:
        raise ValueError(f"no module of {type(module).__name__} matched the LoRA targets {targets}")
    return params


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def export_layers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights in peft naming (``<module>.lora_A.weight``), which load_lora_weights reads.

    Not diffusers' ``convert_state_dict_to_diffusers``: it rewrites Linear LoRA keys to
    the old ``lora.down`` naming but leaves Conv2d ones as ``lora_A``, and a file that
    mixes both loads only half its layers.
    """
    from peft.utils import get_peft_model_state_dict

    # save_embedding_layers=False: no embedding is trained, and "auto" looks the base model up (a hub call)
    # contiguous: speed.channels_last leaves conv LoRA weights in a layout safetensors will not write
    return {k: v.contiguous() for k, v in get_peft_model_state_dict(module, save_embedding_layers=False).items()}


def adapter_metadata(module: torch.nn.Module) -> dict:
    """The LoRA config (rank, alpha, targets) that diffusers stores in the file header."""
    return module.peft_config["default"].to_dict()  # type: ignore[index,union-attr]  # set by add_adapter
