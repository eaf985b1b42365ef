"""Every cache address in one place: the formulas precompute names its entries by, and training checks against.

A cache entry is found by a key that hashes everything that went into it, so a changed input is a new entry
and never a stale one:

- a latent (:func:`latent_key`): the family, the image encoder's weights (:func:`cache_fingerprints`), the
  encoder's dtype, the bucket, the crop mode, the image's content (sha256 of the file) and, for a video
  family, the frames taken (:func:`clip_tag`);
- a mask at latent resolution (:func:`mask_key`, masked loss only): its latent's key (all that places the mask:
  bucket, crop, frames and the latent's size) and the mask's source and content; a changed mask is a new mask
  entry beside the same latent, and caches without masks have no such keys;
- a caption's embedding of one text stage (:func:`text_key`): the family, the stage, the stage's fingerprint
  (its encoders' weights, ``precompute.text_encoder_dtype`` and the stage's options) and the caption.

sd-scripts' flip_aug (``data.flip_aug``) adds a second latent entry per item, of the image mirrored left-right
after its crop: its key has ``:flip`` after the crop mode (an entry without the flip keeps the key it always had),
and its mask's key is made from that key as any mask's.

Edit training (a family with reference images) adds the references' content (sha256, in order) to both: to the
latent's image hash (the references' latents are cached in the target's entry) and to the caption (the instruction
is encoded with the references).

These formulas are the cache's on-disk format: tests/unit/test_cache_keys.py pins them against the cache in
tests/fixtures/cache-v1. The family is taken as an argument (data/ does not import families/:
:class:`KeyedFamily` is what of it is read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config.schema import Config, ModelConfig, TextEncodersConfig
from ..utils import sha256_text
from .index import TextKeys


class KeyedFamily(Protocol):
    """What the keys read of a model family (``difftrain.families.base.ModelFamily``)."""

    @property
    def name(self) -> str: ...

    @property
    def image_encoder(self) -> str: ...

    @property
    def text_stages(self) -> Mapping[str, tuple[str, ...]]: ...

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str: ...

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str: ...

    def enabled_stages(self, options: TextEncodersConfig) -> list[str]: ...


def cache_fingerprints(family: KeyedFamily, cfg: Config, memo: dict[str, str]) -> tuple[str, dict[str, str]]:
    """What precompute keys its entries by and records in the cache's index, and what training checks the
    cache against: the image encoder's weights hash, and one hash per enabled text stage of its encoders'
    weights, ``precompute.text_encoder_dtype`` and the stage's options (T5 precision and length). ``memo``
    keeps each weight file's hash by path, size and mtime (the cache's fingerprints.json)."""
    vae = family.fingerprint(cfg.model, family.image_encoder, memo)
    stages = {
        s: sha256_text(
            *(family.fingerprint(cfg.model, p, memo) for p in family.text_stages[s]),
            cfg.precompute.text_encoder_dtype,
            family.text_stage_tag(s, cfg.text_encoders),
        )
        for s in family.enabled_stages(cfg.text_encoders)
    }
    return vae, stages


def crop_mode(random_crop: bool) -> str:
    """How an image is cropped to its bucket: ``random`` (seeded by its content) or ``center``."""
    return "random" if random_crop else "center"


def clip_tag(frames: int | None, frame_sampling: str) -> str:
    """The frames a video family takes of a clip: part of what is encoded, so part of its latent's key (an image
    family's latent keys have an empty clip tag)."""
    return f"{frames}:{frame_sampling}"


def latent_key(
    family: str,
    vae_fingerprint: str,
    vae_dtype: str,
    bucket: tuple[int, int],
    crop: str,
    image_sha256: str,
    clip: str = "",
) -> str:
    """The cache key of an image's (or a clip's) latent: ``crop`` from :func:`crop_mode`, ``clip`` from
    :func:`clip_tag` for a video family, empty otherwise."""
    return sha256_text(
        "latent", family, vae_fingerprint, vae_dtype, f"{bucket[0]}x{bucket[1]}", crop, image_sha256, clip
    )


def mask_key(latent: str, kind: str, mask_sha256: str) -> str:
    """The cache key of a mask fitted to the latent ``latent`` (its key): ``kind`` alpha (the image's own channel,
    whose content the latent key holds; ``mask_sha256`` empty), file or frames (``mask_sha256`` of the mask
    file, or of its frame files' hashes)."""
    return sha256_text("mask", latent, kind, mask_sha256)


def text_key(family: str, stage: str, stage_fingerprint: str, caption: str) -> str:
    """The cache key of ``caption``'s embedding by one text stage."""
    return sha256_text("text", family, stage, stage_fingerprint, caption)


@dataclass(frozen=True)
class CacheKeys:
    """The key formulas bound to one config: the family, the encoders' fingerprints and the settings that
    address an entry. What precompute names its entries by and writes into index.json."""

    family: str
    vae: str  # the image encoder's fingerprint
    stages: dict[str, str]  # enabled text stage -> its fingerprint
    vae_dtype: str
    crop: str  # crop_mode(data.random_crop)
    frame_sampling: str | None = None  # a video family's data.frame_sampling; None for an image family

    @classmethod
    def for_config(cls, family: KeyedFamily, cfg: Config, memo: dict[str, str], *, video: bool) -> CacheKeys:
        """The keys ``cfg`` gives its entries (weight hashes not in ``memo`` are computed and added to it)."""
        vae, stages = cache_fingerprints(family, cfg, memo)
        return cls(
            family=family.name,
            vae=vae,
            stages=stages,
            vae_dtype=cfg.precompute.vae_dtype,
            crop=crop_mode(cfg.data.random_crop),
            # data.fps takes other frames: part of the clip tag, and of nothing else (keys without it are unchanged)
            frame_sampling=(cfg.data.frame_sampling if not cfg.data.fps else f"{cfg.data.fps:g}fps") if video else None,
        )

    def latent(
        self,
        bucket: tuple[int, int],
        image_sha256: str,
        frames: int | None = None,
        references: Sequence[str] = (),
        *,
        flip: bool = False,
    ) -> str:
        """``references``: edit training's reference images' sha256, in order (their latents live in the target's
        entry); none: the key as always. ``flip``: the key of the image mirrored left-right after its crop
        (flip_aug's second entry)."""
        clip = "" if self.frame_sampling is None else clip_tag(frames, self.frame_sampling)
        content = sha256_text(image_sha256, *references) if references else image_sha256
        crop = f"{self.crop}:flip" if flip else self.crop
        return latent_key(self.family, self.vae, self.vae_dtype, bucket, crop, content, clip)

    def texts(self, caption: str, references: Sequence[str] = ()) -> TextKeys:
        """``caption``'s entry key per enabled text stage; ``references``: the sha256 of the reference images it is
        encoded with (edit training), in order."""
        text = "\x00".join((caption, *references)) if references else caption
        return {s: text_key(self.family, s, fp, text) for s, fp in self.stages.items()}
