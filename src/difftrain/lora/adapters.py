"""LoRA adapters through peft, the way the diffusers training examples add them: LoRA, DoRA (LoraConfig(use_dora=True)),
and LyCORIS' LoHa and LoKr (peft's LoHaConfig / LoKrConfig, ports of LyCORIS' modules computing the same weights;
the lycoris-lora package is not on the index difftrain installs from, and peft's layers work with everything else
difftrain does to a peft model: state dicts, merging, diffusers' add_adapter)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from peft import LoraConfig, PeftConfig

from ..config.schema import LoraConfig as LoraSettings


def peft_config(module: torch.nn.Module, settings: LoraSettings, targets: Sequence[str]) -> PeftConfig:
    """The peft config of ``settings.type`` (and use_dora) over ``targets``."""
    from peft import LoHaConfig, LoKrConfig

    # peft annotates an int alpha, but a float works: it is only divided by the rank
    alpha = settings.alpha if settings.alpha is not None else settings.rank
    if settings.type == "loha":
        return LoHaConfig(
            r=settings.rank,
            alpha=alpha,  # type: ignore[arg-type]
            rank_dropout=settings.rank_dropout,
            module_dropout=settings.module_dropout,
            use_effective_conv2d=settings.use_tucker,
            target_modules=list(targets),
        )
    if settings.type == "lokr":
        rank = settings.rank
        if settings.full_matrix:
            # LyCORIS' full_matrix: both Kronecker factors full, scale 1. peft keeps a factor full where the rank is at
            # least half its larger side, so a rank that covers every layer of the module does the same
            rank = alpha = full_matrix_rank(module, settings.factor)
        return LoKrConfig(
            r=rank,
            alpha=alpha,  # type: ignore[arg-type]
            decompose_both=settings.decompose_both,
            decompose_factor=settings.factor,
            rank_dropout=settings.rank_dropout,
            module_dropout=settings.module_dropout,
            use_effective_conv2d=settings.use_tucker,
            target_modules=list(targets),
        )
    return LoraConfig(
        r=settings.rank,
        lora_alpha=alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        init_lora_weights="gaussian" if settings.init == "gaussian" else True,
        use_dora=settings.use_dora,
        target_modules=list(targets),
    )


def full_matrix_rank(module: torch.nn.Module, factor: int) -> int:
    """A LoKr rank at which peft keeps the second Kronecker factor of every Linear/Conv2d of ``module`` full."""
    from peft.tuners.lokr.layer import factorization

    need = 1
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            sizes = (m.out_features, m.in_features)
        elif isinstance(m, torch.nn.Conv2d):
            sizes = (m.out_channels, m.in_channels // m.groups)
        else:
            continue
        need = max(need, *(2 * factorization(n, factor)[1] for n in sizes))
    return need


def add_lora(module: torch.nn.Module, settings: LoraSettings, targets: Sequence[str]) -> list[torch.nn.Parameter]:
    """Add the adapter of ``settings`` (LoRA, DoRA, LoHa or LoKr) to ``module``; return its trainable parameters
    (kept in fp32)."""
    cfg = peft_config(module, settings, targets)
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
    """The adapter's peft config (type, rank, alpha, targets) that diffusers stores in the file header."""
    return module.peft_config["default"].to_dict()  # type: ignore[index,union-attr]  # set by add_adapter
