"""What a config trains and loads: the parts, the learning rate of each trained part, the text stages encoded
on the fly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.schema import Config

if TYPE_CHECKING:
    from ..families.base import ModelFamily


def plan_parts(cfg: Config, family: ModelFamily) -> tuple[list[str], dict[str, float]]:
    """Which parts training loads, and the learning rate of each trained part.

    A text stage runs on the fly when one of its encoders trains; the other
    stages come from the cache (SD3 trains CLIP LoRA over cached T5 embeddings).
    """
    t = cfg.train
    te = family.trainable_text_encoders
    lrs = {}
    if t.method == "lora":
        lrs[family.denoiser] = t.learning_rate
        if t.train_text_encoders:
            lrs.update(dict.fromkeys(te, t.learning_rate))
    else:
        f = cfg.full
        if f.train_unet:
            lrs[family.denoiser] = t.learning_rate
        if f.train_text_encoder_1:
            lrs[te[0]] = f.learning_rate_te1 or t.learning_rate
        if f.train_text_encoder_2:
            lrs[te[1]] = f.learning_rate_te2 or t.learning_rate
    parts = [family.denoiser] + [p for s in live_stages(cfg, family, lrs) for p in family.text_stages[s]]
    return parts, lrs


def live_stages(cfg: Config, family: ModelFamily, lrs: dict) -> list[str]:
    """The text stages encoded each step (one of their encoders trains)."""
    return [s for s in family.enabled_stages(cfg.text_encoders) if any(p in lrs for p in family.text_stages[s])]
