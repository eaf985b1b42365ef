"""What a config trains and loads, and the planner's estimate for it: no weight is read.

``difftrain plan``, ``train``'s memory pre-check, ``bench`` and ``doctor`` ask these questions before anything
loads, and the trainer asks the same ones when it builds the parts (trainers/setup.py): one answer for all,
without importing the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config.schema import Config
from .families.registry import get_family

if TYPE_CHECKING:
    from .families.base import ModelFamily
    from .memory.planner import Estimate


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


def memory_hints(cfg: Config) -> dict:
    """The family's plain numbers for the memory planner (parameter counts, measured activation data)."""
    family = get_family(cfg.family)
    parts, lrs = plan_parts(cfg, family)
    video = {"frames": cfg.data.frames} if family.video else {}
    return family.memory_hints(
        cfg.model, cfg.lora.targets, cfg.lora.rank, cfg.data.resolution, parts, list(lrs), cfg.train.method, **video
    )


def plan_memory(cfg: Config) -> Estimate:
    """The planner's estimate for a config: no weight is loaded."""
    from .memory.planner import estimate
    from .speed import graphs_possible

    hints = memory_hints(cfg)
    if not graphs_possible(cfg):  # no CUDA graphs, no pool of theirs
        hints["cuda_graph_pool"] = 0.0
    return estimate(cfg, hints)
