"""The planner's estimate for a config (peak GPU memory and host RAM, per GPU of N) and what precompute will do on
a card: the family's plain numbers handed to memory/planner.py, no weight read."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..config.schema import Config
from ..errors import DifftrainError
from ..families.registry import get_family
from .parts import plan_parts

if TYPE_CHECKING:
    from ..memory.planner import Estimate


def memory_hints(cfg: Config) -> dict:
    """The family's plain numbers for the memory planner (parameter counts, measured activation data)."""
    family = get_family(cfg.family)
    parts, lrs = plan_parts(cfg, family)
    video = {"frames": cfg.data.frames} if family.video else {}
    return family.memory_hints(
        cfg.model, cfg.lora.targets, cfg.lora.rank, cfg.data.resolution, parts, list(lrs), cfg.train.method, **video
    )


def plan_memory(cfg: Config, processes: int = 1) -> Estimate:
    """The planner's estimate for a config, per GPU of ``processes``: no weight is loaded."""
    from ..memory.planner import estimate
    from ..speed.auto import CompileCost, graphs_possible

    hints = memory_hints(cfg)
    hints["graphs"] = graphs_possible(cfg, CompileCost(**get_family(cfg.family).compile_cost))
    return estimate(cfg, hints, processes)


def precompute_lines(cfg: Config, card_gib: float) -> list[str]:
    """What precompute will do on a card of ``card_gib`` (what the card leaves torch): how many images of the
    config's resolution its VAE encodes at a time, or that one does not fit; and whether T5-XXL's stage, or the
    language model's, fits at its precision. Video families' VAE tiles its encode (no VAE line)."""
    from ..memory.card import allocator_budget, stored_overhead
    from ..memory.planner import GIB, T5_PRECOMPUTE_GIB, VAE_ENCODE_BYTES_PER_PIXEL, VAE_PARAMS, vae_chunk

    family = get_family(cfg.family)
    pc, res = cfg.precompute, cfg.data.resolution
    budget = allocator_budget(card_gib, stored_overhead())
    lines = []
    if not family.video:
        weights = VAE_PARAMS * (4 if pc.vae_dtype == "fp32" else 2) / GIB
        one = VAE_ENCODE_BYTES_PER_PIXEL[pc.vae_dtype] * res * res / GIB
        if one + weights > budget:
            lines.append(
                f"[yellow]note:[/yellow] precompute: one {res}x{res} image needs ~{one + weights:.1f} GiB with the VAE "
                f"in {pc.vae_dtype}, more than the {budget:.2f} GiB a {card_gib:g} GiB card leaves torch: set "
                + ("precompute.vae_dtype: bf16, or " if pc.vae_dtype == "fp32" else "")
                + "precompute.device: cpu"
            )
        else:
            n = vae_chunk(pc.batch_size, pc.vae_dtype, res * res, (budget - weights) * GIB)
            lines.append(
                f"precompute: the VAE encodes {n} {res}x{res} image(s) at a time in {pc.vae_dtype} on this card "
                f"(~{one:.1f} GiB each; precompute.batch_size {pc.batch_size})"
            )
    t5 = cfg.text_encoders.t5
    if "t5" in family.enabled_stages(cfg.text_encoders):
        need = T5_PRECOMPUTE_GIB[t5.precision]
        if need > budget:
            lines.append(
                f"[yellow]note:[/yellow] precompute: T5-XXL in {t5.precision} takes ~{need:.1f} GiB (measured), more "
                f"than the {budget:.2f} GiB a {card_gib:g} GiB card leaves torch: precompute once on a larger GPU "
                "(the cache is the same), or on the CPU (precompute.device: cpu with text_encoders.t5.precision: "
                "bf16, ~9 GB of host RAM, slow)"
            )
        else:
            lines.append(f"precompute: T5-XXL in {t5.precision} fits this card (~{need:.1f} GiB, one stage at a time)")
    llm = llm_precompute_gib(cfg)
    if llm is not None:
        name, billions, need = llm
        prec = cfg.text_encoders.llm.precision
        what = f"{name} ({billions:.1f} B) in {prec} takes ~{need:.1f} GiB (estimated from its parameters)"
        if need > budget:
            smaller = "" if prec == "nf4" else "set text_encoders.llm.precision: nf4, or "
            lines.append(
                f"[yellow]note:[/yellow] precompute: {what}, more than the {budget:.2f} GiB a {card_gib:g} GiB card "
                f"leaves torch: {smaller}precompute once on a larger GPU (the cache is the same), or on the CPU "
                f"(precompute.device: cpu with text_encoders.llm.precision: bf16, ~{billions * 2.2:.0f} GB of host "
                "RAM, slow)"
            )
        else:
            lines.append(f"precompute: {what}: fits this card, one stage at a time")
    return lines


def llm_precompute_gib(cfg: Config) -> tuple[str, float, float] | None:
    """(class name, billions of parameters, GiB) of precompute's language-model stage at the config's precision
    (memory/planner.py LLM_QUANT_BYTES, LLM_MARGIN_GIB: estimated); None where the family has no such encoder or its
    architecture cannot be built here."""
    from ..families.llm_image import LLMImageFamily
    from ..memory.planner import BYTES, llm_stage_gib

    family = get_family(cfg.family)
    if not isinstance(family, LLMImageFamily):
        return None
    try:
        name, linear, other = _llm_elements(cfg.family, cfg.model.model_dump_json())
    except (DifftrainError, OSError, ValueError, KeyError, ImportError, RuntimeError):  # a folder not here, an
        # architecture this transformers cannot build: no line
        return None
    prec = cfg.text_encoders.llm.precision
    # a float precision loads the whole encoder in it; bitsandbytes leaves the rest in the load's dtype
    other_bytes = BYTES[prec if prec in ("bf16", "fp16", "fp32") else cfg.precompute.text_encoder_dtype]
    return name, (linear + other) / 1e9, llm_stage_gib(linear, other, prec, other_bytes)


@functools.lru_cache(maxsize=8)
def _llm_elements(family_name: str, model_json: str) -> tuple[str, int, int]:
    """(class name, elements of the Linear weights bitsandbytes quantizes, all other elements) of the family's
    language model, built on the meta device from its config."""
    import torch

    from ..config.schema import ModelConfig

    family = get_family(family_name)
    with torch.device("meta"):
        m = family.empty_part(ModelConfig.model_validate_json(model_json), "text_encoder")
    get_out = getattr(m, "get_output_embeddings", None)  # transformers' output embedding: not quantized
    out = get_out() if callable(get_out) else None
    linear = sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear) and x is not out)
    return type(m).__name__, linear, sum(p.numel() for p in m.parameters()) - linear
