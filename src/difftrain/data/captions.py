"""Caption augmentation: keep_tokens, tag shuffling, tag dropout and caption dropout (sd-scripts' names).

sd-scripts rewrites the caption every time an image is drawn, and so refuses to combine shuffling with
cached text-encoder outputs. difftrain keeps both: precompute encodes ``caption_variants`` augmented
versions of each caption (and the empty caption once, when ``caption_dropout_rate > 0``), and training
draws one of them per image per epoch. With the text encoders running live (trained), the caption is
augmented afresh on every draw instead, as sd-scripts does.

What an augmentation does (sd-scripts' ``process_caption``, without token warm-up or wildcards):

* the caption is split at ``caption_separator`` (default ``,``) into tags, each stripped;
* the first ``keep_tokens`` tags stay first, in order; with ``keep_tokens_separator`` present in the
  caption, everything before it is kept instead (the separator itself is removed), and with a second one,
  everything after that stays last (``fixed ||| shuffled ||| fixed``);
* each remaining tag is dropped with probability ``caption_tag_dropout_rate``;
* with ``shuffle_caption`` the remaining tags are shuffled;
* the tags are joined with ``", "``.

Caption dropout (an empty caption, which teaches the model the unconditional case that classifier-free
guidance needs) is drawn at training time, before any of this.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..utils import sha256_text

if TYPE_CHECKING:
    from .index import IndexItem


@dataclass(frozen=True)
class CaptionAugment:
    shuffle: bool = False
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    separator: str = ","
    tag_dropout_rate: float = 0.0
    dropout_rate: float = 0.0
    variants: int = 8
    """How many augmented versions of each caption precompute caches (when the augmentation varies)."""

    @classmethod
    def from_config(cls, data) -> CaptionAugment:
        """From a :class:`~difftrain.config.schema.DataConfig`."""
        return cls(
            shuffle=data.shuffle_caption,
            keep_tokens=data.keep_tokens,
            keep_tokens_separator=data.keep_tokens_separator,
            separator=data.caption_separator,
            tag_dropout_rate=data.caption_tag_dropout_rate,
            dropout_rate=data.caption_dropout_rate,
            variants=data.caption_variants,
        )

    @property
    def varies(self) -> bool:
        """Whether a caption's tags change from draw to draw (the caption dropout aside)."""
        return self.shuffle or self.tag_dropout_rate > 0

    def record(self) -> dict:
        """What decides the cached variants: stored in the cache's index, compared by training."""
        if not self.varies:
            return {"variants": 0, "dropout": self.dropout_rate > 0}
        return {
            "variants": self.variants,
            "shuffle": self.shuffle,
            "keep_tokens": self.keep_tokens,
            "keep_tokens_separator": self.keep_tokens_separator,
            "separator": self.separator,
            "tag_dropout_rate": self.tag_dropout_rate,
            "dropout": self.dropout_rate > 0,
        }


def augment_caption(caption: str, aug: CaptionAugment, rng: random.Random) -> str:
    """One augmented version of ``caption`` (tags kept, dropped and shuffled as ``aug`` says). The caption
    dropout is not applied here: see :func:`pick_text`."""
    if not aug.varies:
        return caption
    suffix: list[str] = []
    if aug.keep_tokens_separator and aug.keep_tokens_separator in caption:
        fixed_part, flex_part = caption.split(aug.keep_tokens_separator, 1)
        if aug.keep_tokens_separator in flex_part:  # a second one: what follows it stays last (sd-scripts)
            flex_part, suffix_part = flex_part.split(aug.keep_tokens_separator, 1)
            suffix = [t.strip() for t in suffix_part.split(aug.separator) if t.strip()]
        fixed = [t.strip() for t in fixed_part.split(aug.separator) if t.strip()]
        flex = [t.strip() for t in flex_part.split(aug.separator) if t.strip()]
    else:
        tokens = [t.strip() for t in caption.strip().split(aug.separator) if t.strip()]
        fixed, flex = tokens[: aug.keep_tokens], tokens[aug.keep_tokens :]
    if aug.tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= aug.tag_dropout_rate]
    if aug.shuffle:
        rng.shuffle(flex)
    return ", ".join(fixed + flex + suffix)


def caption_variants(caption: str, aug: CaptionAugment) -> list[str]:
    """The distinct augmented versions of ``caption`` that precompute caches, in a fixed order. Variant
    ``i`` is seeded by the caption text and ``i`` alone, so equal captions share their cached embeddings
    and a rerun finds them again; a draw equal to an earlier one is drawn again (up to ``4 * variants``
    draws in all), so a caption with too few tags to give ``variants`` distinct versions gives fewer. Without augmentation: ``[caption]``."""
    if not aug.varies:
        return [caption]
    out: list[str] = []
    for i in range(4 * aug.variants):  # draws that repeat an earlier variant are retried, a bounded number of times
        v = augment_caption(caption, aug, random.Random(sha256_text("caption-variant", caption, str(i))))
        if v not in out:
            out.append(v)
            if len(out) == aug.variants:
                break
    return out


def pick_text(item: IndexItem, aug: CaptionAugment, seed: int, epoch: int, empty: dict | None) -> dict:
    """The cached text-entry keys (``{stage: key}``) one index item uses in ``epoch``: the empty caption
    with probability ``aug.dropout_rate`` (``empty``: its keys), else one of its cached variants. The draw
    depends on the seed, the epoch and the item only, so a resumed run, or one on another number of GPUs,
    draws the same."""
    rng = random.Random(f"difftrain-caption:{seed}:{epoch}:{item.draw_key}")
    empty = item.empty_texts or empty  # edit training: the empty instruction with the item's own references
    if aug.dropout_rate > 0 and empty is not None and rng.random() < aug.dropout_rate:
        return empty
    variants = item.text_variants
    if aug.varies and variants:
        return variants[rng.randrange(len(variants))]
    return item.texts


def live_caption(caption: str, aug: CaptionAugment, seed: int, epoch: int, key: str) -> str:
    """The caption a live (trained) text encoder sees for one item in ``epoch``: dropped, or augmented
    afresh (not limited to the cached variants)."""
    rng = random.Random(f"difftrain-caption:{seed}:{epoch}:{key}")
    if aug.dropout_rate > 0 and rng.random() < aug.dropout_rate:
        return ""
    return augment_caption(caption, aug, rng)
