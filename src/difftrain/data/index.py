"""The cache's ``index.json``: what precompute wrote for training to read, as typed items.

One :class:`IndexItem` per training image or clip (and per DreamBooth class image), written by precompute and
read back by the trainer, ``difftrain cache`` and the bench's synthetic caches; :class:`CacheIndex` is the whole
file. The JSON is unchanged from the untyped dicts these replace (tests/integration/test_cache_format.py reads
a cache written before them): optional fields are written only when set, and fields an older or a synthetic
index lacks take the defaults :func:`~difftrain.data.cache.check_index` has always allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import check_index

#: text-entry keys of one caption: {text stage: cache key}
TextKeys = dict[str, str]


@dataclass(frozen=True)
class IndexItem:
    key: str  # the item's name in the dataset (the image's path stem, "class:..." for class images)
    latent: str  # cache key of its latent entry
    texts: TextKeys  # cache keys of its caption's embeddings, per text stage
    bucket: tuple[int, int]  # (width, height) in pixels
    caption: str = ""
    image: str = ""  # the source file
    original_size: tuple[int, int] = (1, 1)  # (height, width) of the source, SDXL's micro-conditioning
    image_sha256: str | None = None
    frames: int | None = None  # video families: the frame bucket
    text_variants: tuple[TextKeys, ...] = ()  # caption augmentation: keys of each cached variant
    prior: bool = False  # a DreamBooth class image
    mask: str | None = None  # masked loss: cache key of its mask at latent resolution (none: learned everywhere)
    subset: str = ""  # the subset it was read from (data.subsets or a kohya folder; "" for data.dir read whole)
    repeats: int = 1  # times it is seen per epoch (its subset's num_repeats)
    #: edit training's caption dropout: the keys of the empty instruction encoded with this item's references
    empty_texts: TextKeys | None = None
    flipped: str | None = None  # flip_aug: cache key of its latent mirrored left-right (none: no flip_aug)
    flipped_mask: str | None = None  # flip_aug with masked loss: its mask mirrored, fitted to the flipped latent
    draw: int = field(default=0, compare=False)
    """Which of its repeats in an epoch this is (the trainer's copies; never written): each draws its own caption."""

    @property
    def draw_key(self) -> str:
        """What seeds this copy's caption draws: its key, and for a repeat after the first its number too."""
        return self.key if not self.draw else f"{self.key}#{self.draw}"

    @property
    def bucket_key(self) -> tuple[int, int, int]:
        """(width, height, frames): a batch never mixes two of these."""
        return (self.bucket[0], self.bucket[1], self.frames or 1)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> IndexItem:
        return cls(
            key=d["key"],
            latent=d["latent"],
            texts=dict(d["texts"]),
            bucket=(d["bucket"][0], d["bucket"][1]),
            caption=d.get("caption", ""),
            image=d.get("image", ""),
            original_size=tuple(d.get("original_size", (1, 1))),
            image_sha256=d.get("image_sha256"),
            frames=d.get("frames"),
            text_variants=tuple(dict(t) for t in d.get("text_variants", ())),
            prior=bool(d.get("prior", False)),
            mask=d.get("mask"),
            subset=str(d.get("subset", "")),
            repeats=int(d.get("repeats", 1)),
            empty_texts=dict(d["empty_texts"]) if d.get("empty_texts") else None,
            flipped=d.get("flipped"),
            flipped_mask=d.get("flipped_mask"),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "image": self.image,
            "caption": self.caption,
            "bucket": list(self.bucket),
        }
        if self.frames:
            out["frames"] = self.frames
        out["original_size"] = list(self.original_size)
        out["latent"] = self.latent
        if self.image_sha256 is not None:
            out["image_sha256"] = self.image_sha256
        out["texts"] = dict(self.texts)
        if self.text_variants:
            out["text_variants"] = [dict(t) for t in self.text_variants]
        if self.prior:
            out["prior"] = True
        if self.mask is not None:
            out["mask"] = self.mask
        if self.subset:
            out["subset"] = self.subset
        if self.repeats != 1:
            out["repeats"] = self.repeats
        if self.empty_texts:
            out["empty_texts"] = dict(self.empty_texts)
        if self.flipped is not None:
            out["flipped"] = self.flipped
        if self.flipped_mask is not None:
            out["flipped_mask"] = self.flipped_mask
        return out

    def entry_keys(self) -> set[str]:
        """Every cache entry this item uses: its latent, and its captions' embeddings (variants included)."""
        keys = {self.latent} | ({self.mask} if self.mask else set())
        keys |= {k for k in (self.flipped, self.flipped_mask) if k}  # flip_aug
        for texts in (self.texts, *self.text_variants, self.empty_texts or {}):
            keys.update(texts.values())
        return keys


@dataclass
class CacheIndex:
    """index.json: the family and encoders the entries were made with, the caption augmentation they cover,
    and the items. Fields left None are not written (a bench's synthetic index has family and items only)."""

    items: list[IndexItem]
    family: str | None = None
    model: str | None = None
    vae: str | None = None  # the image encoder's fingerprint
    text_stages: dict[str, str] | None = None  # text stage -> fingerprint
    vae_dtype: str | None = None
    text_encoder_dtype: str | None = None
    captions: dict[str, Any] | None = None  # CaptionAugment.record() of the cached variants
    empty_text: TextKeys | None = None  # the empty caption's keys (caption dropout)
    masks: dict[str, Any] | None = None  # masked loss: data.masks.MaskSpec.record() of the items' masks
    extra: dict[str, Any] = field(default_factory=dict)  # fields this difftrain does not know, kept as read

    @classmethod
    def from_json(cls, d: Any, path: Path) -> CacheIndex:
        """A parsed index.json, its shape checked first (:func:`check_index`: CacheMismatch naming ``path``)."""
        check_index(d, path)
        known = {
            "items",
            "family",
            "model",
            "vae",
            "text_stages",
            "vae_dtype",
            "text_encoder_dtype",
            "captions",
            "empty_text",
            "masks",
        }
        return cls(
            items=[IndexItem.from_json(it) for it in d.get("items", [])],
            family=d.get("family"),
            model=d.get("model"),
            vae=d.get("vae"),
            text_stages=d.get("text_stages"),
            vae_dtype=d.get("vae_dtype"),
            text_encoder_dtype=d.get("text_encoder_dtype"),
            captions=d.get("captions"),
            empty_text=d.get("empty_text") or None,
            masks=d.get("masks"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in (
            "family",
            "model",
            "vae",
            "text_stages",
            "vae_dtype",
            "text_encoder_dtype",
            "captions",
            "empty_text",
            "masks",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out["items"] = [it.to_json() for it in self.items]
        return {**self.extra, **out}

    def entry_keys(self) -> set[str]:
        """Every cache entry the index uses (what ``cache prune`` keeps)."""
        keys = set((self.empty_text or {}).values())
        for it in self.items:
            keys |= it.entry_keys()
        return keys
