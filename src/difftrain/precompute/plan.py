"""The plan: what precompute caches, item by item, decided before anything is encoded.

Scanning the data folder (images, or clips for a video family), DreamBooth's instance prompt and class images,
the bucket of each item (dropping what fits none, with the reason), then the cache keys of its latent and its
captions (:mod:`difftrain.data.keys`). Every process of a distributed run makes the same plan.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config.schema import Config, DataConfig
from ..data.buckets import Bucket, choose_bucket, make_buckets
from ..data.cache import DataCache
from ..data.captions import CaptionAugment, caption_variants
from ..data.index import CacheIndex, IndexItem, TextKeys
from ..data.keys import CacheKeys
from ..data.sources import ImageRecord, scan_dataset
from ..errors import UsageError
from ..families.base import ModelFamily
from ..runtime.distributed import World
from ..runtime.distributed import barrier as dist_barrier
from ..utils import sha256_file
from .prior import ensure_class_images

if TYPE_CHECKING:
    from typing import TypeAlias

    from ..data.video import VideoRecord

Record: TypeAlias = "ImageRecord | VideoRecord"
Skipped: TypeAlias = "list[tuple[str, str]]"  # (path, why) of each file left out


@dataclass(frozen=True)
class Buckets:
    """The buckets items are sorted into: sizes, and a video family's frame counts (empty for images)."""

    sizes: list[Bucket]
    frames: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """A record in its bucket: all a plan without keys (``precompute --plan``) needs."""

    record: Record
    bucket: Bucket  # (width, height)
    prior: bool = False  # a DreamBooth class image
    frames: int | None = None  # video: the frame bucket
    indices: list[int] | None = None  # video: the frames taken

    @property
    def size_name(self) -> str:
        return f"{self.bucket[0]}x{self.bucket[1]}"

    @property
    def shape_name(self) -> str:
        """The size and, for a clip, the frame count: ``96x64x9f``."""
        return self.size_name + (f"x{self.frames}f" if self.frames else "")


@dataclass(frozen=True, kw_only=True)
class PlanItem(Placement):
    """A placed record with the cache keys of its entries: what is encoded, and one item of index.json."""

    latent: str  # its latent entry's key
    image_sha256: str
    texts: TextKeys  # its caption's entry key per text stage
    variants: tuple[TextKeys, ...] = ()  # caption augmentation: each cached variant's keys

    @property
    def shape(self) -> tuple[Bucket, int]:
        """What a batch of latents never mixes: the bucket and the frame count (1 for an image)."""
        return (self.bucket, self.frames or 1)

    def index_item(self) -> IndexItem:
        r = self.record
        return IndexItem(
            key=r.key,
            latent=self.latent,
            texts=self.texts,
            bucket=self.bucket,
            caption=r.caption,
            image=str(r.path),
            original_size=(r.height, r.width),
            image_sha256=self.image_sha256,
            frames=self.frames,
            text_variants=self.variants,
            prior=self.prior,
        )


@dataclass
class Plan:
    """Every item to cache, the keys they were named by, and the caption each text entry encodes."""

    items: list[PlanItem]
    keys: CacheKeys
    captions: dict[str, str]  # text entry key -> the caption it encodes
    empty_text: TextKeys | None = None  # the empty caption's keys, for the caption dropout
    skipped: Skipped = field(default_factory=list)  # what the bucketing dropped

    def text_sets(self) -> list[TextKeys]:
        """Every caption entry the items use ({stage: key} each): their captions, augmented variants, the empty
        caption."""
        sets = [t for p in self.items for t in (p.texts, *p.variants)]
        return sets + ([self.empty_text] if self.empty_text else [])

    def index(self, cfg: Config, aug: CaptionAugment) -> CacheIndex:
        """index.json: the items and what their entries were made with."""
        return CacheIndex(
            family=self.keys.family,
            model=str(cfg.model.path),
            vae=self.keys.vae,
            text_stages=self.keys.stages,
            vae_dtype=cfg.precompute.vae_dtype,
            text_encoder_dtype=cfg.precompute.text_encoder_dtype,
            captions=aug.record(),
            empty_text=self.empty_text or None,
            items=[p.index_item() for p in self.items],
        )


# ------------------------------------------------------------------ scanning
def scan(
    cfg: Config, family: ModelFamily, world: World, device: torch.device, *, plan_only: bool = False
) -> tuple[list[tuple[Record, bool]], Skipped]:
    """The records to cache, each with whether it is a DreamBooth class image, and the files the scans left
    out. Missing class images are generated first (by the first process; never for a plan)."""
    records, skipped = _scan_data(cfg, family.video)
    db = cfg.dreambooth
    if family.video and db.with_prior_preservation:
        raise UsageError(
            "dreambooth.with_prior_preservation is not available for video families yet "
            "(class clips would have to be generated).",
            hint="Set dreambooth.with_prior_preservation: false.",
        )
    instance_prompt = db.instance_prompt
    if instance_prompt:
        records = [
            replace(r, caption=r.caption if (db.use_captions and r.caption) else instance_prompt) for r in records
        ]
    out: list[tuple[Record, bool]] = [(r, False) for r in records]
    if db.with_prior_preservation and not plan_only:  # (a plan does not generate class images)
        class_records, class_skipped = _class_images(cfg, family, world, device)
        skipped += class_skipped
        out += [(r, True) for r in class_records]
    return out, skipped


def _scan_data(cfg: Config, video: bool) -> tuple[list[Record], Skipped]:
    d = cfg.data
    assert d.dir is not None  # precompute refuses a config without one before planning
    if video:
        from ..data.video import frame_buckets, scan_videos

        clips, skipped = scan_videos(
            Path(d.dir), caption_ext=d.caption_ext, buckets=frame_buckets(d.frames), allow_outside=d.allow_outside_paths
        )
        return list(clips), [(str(p), why) for p, why in skipped]
    images, skipped = scan_dataset(
        Path(d.dir),
        metadata=d.metadata,
        caption_ext=d.caption_ext,
        tag_ext=d.tag_ext,
        caption_source=d.caption_source,
        caption_fallback=d.caption_fallback,
        allow_outside=d.allow_outside_paths,
    )
    return list(images), [(str(p), why) for p, why in skipped]


def _class_images(
    cfg: Config, family: ModelFamily, world: World, device: torch.device
) -> tuple[list[ImageRecord], Skipped]:
    """The DreamBooth class images as records (key ``class:...``, caption the class prompt); the first process
    generates the missing ones, the others then find them."""
    class_prompt = cfg.dreambooth.class_prompt
    assert class_prompt is not None  # the config's validator requires it with prior preservation
    if not world.main:
        dist_barrier(world)
    folder = ensure_class_images(cfg, family, device)
    if world.main:
        dist_barrier(world)
    records, skipped = scan_dataset(folder)
    return [replace(r, key="class:" + r.key, caption=class_prompt) for r in records], [
        (str(p), why) for p, why in skipped
    ]


# ------------------------------------------------------------------ buckets
def buckets_for(d: DataConfig, video: bool) -> Buckets:
    if video:
        from ..data.video import frame_buckets, video_size_buckets

        return Buckets(video_size_buckets(d.resolution, d.bucket_step, d.min_side, d.max_side), frame_buckets(d.frames))
    return Buckets(make_buckets(d.resolution, d.bucket_step, d.min_side, d.max_side))


def place(record: Record, prior: bool, d: DataConfig, buckets: Buckets) -> Placement | str:
    """``record`` in its bucket, or why it fits none."""
    frames, indices = None, None
    try:
        if isinstance(record, ImageRecord):
            bucket = choose_bucket(
                record.width,
                record.height,
                buckets.sizes,
                resolution=d.resolution,
                step=d.bucket_step,
                no_upscale=d.no_upscale,
            )
        else:
            from ..data.video import (
                choose_frames,
                choose_video_bucket,
                frame_rate_varies,
                frames_at_rate,
                resampled_indices,
                sample_frame_indices,
            )

            bucket = choose_video_bucket(record.width, record.height, buckets.sizes)
            rate = d.fps if d.fps and not record.is_image else None
            if rate is not None and record.fps <= 0:
                raise ValueError("its frame rate is unknown (the file states none), so data.fps cannot resample it")
            if rate is not None and frame_rate_varies(record.path):
                raise ValueError(
                    "its frame rate varies (its frames are not evenly spaced in time), so data.fps cannot resample "
                    f"it: re-encode it at a constant rate (ffmpeg -i IN -vf fps={rate:g} OUT)"
                )
            n = record.frames if rate is None else frames_at_rate(record.frames, record.fps, rate)
            frames = choose_frames(n, buckets.frames, is_image=record.is_image)
            if frames is None:
                at = "" if rate is None else f" ({n} at data.fps {rate:g}, from {record.frames} at {record.fps:g} fps)"
                raise ValueError(
                    f"{record.frames} frames{at}: shorter than the smallest frame bucket ({buckets.frames[1]})"
                )
            if rate is None:
                indices = sample_frame_indices(record.frames, frames, mode=d.frame_sampling)
            else:
                indices = resampled_indices(record.frames, record.fps, rate, frames)
    except ValueError as e:  # e.g. smaller than one bucket step with no_upscale
        return str(e)
    enlarge = max(bucket[0] / record.width, bucket[1] / record.height)
    if d.max_upscale is not None and enlarge > d.max_upscale:
        return (
            f"too small: {record.width}x{record.height} would be enlarged {enlarge:.1f}x to fill "
            f"its bucket {bucket[0]}x{bucket[1]} (data.max_upscale is {d.max_upscale:g})"
        )
    return Placement(record, bucket, prior, frames, indices)


def place_all(records: list[tuple[Record, bool]], d: DataConfig, buckets: Buckets) -> tuple[list[Placement], Skipped]:
    """Every record that fits a bucket, placed; and those that do not, with the reason, in the records' order."""
    placed: list[Placement] = []
    skipped: Skipped = []
    for r, prior in records:
        p = place(r, prior, d, buckets)
        if isinstance(p, str):
            skipped.append((str(r.path), p))
        else:
            placed.append(p)
    return placed, skipped


# ------------------------------------------------------------------ keys
def cache_keys(cfg: Config, family: ModelFamily, cache: DataCache, world: World) -> CacheKeys:
    """The keys of this config's entries: they need the encoders' weight hashes, memoised in the cache's
    fingerprints.json (which the first process writes back). Each text stage has its own key: a changed T5
    precision re-encodes T5 only."""
    memo = cache.read_json("fingerprints.json", {})
    keys = CacheKeys.for_config(family, cfg, memo, video=family.video)
    if world.main:
        cache.write_json("fingerprints.json", memo)
    return keys


def hash_images(records: list[tuple[Record, bool]]) -> dict[Path, str]:
    """The files' sha256 (their latents' keys), read by threads: hashing releases the GIL, and one thread at a
    time would leave a fast disk idle."""
    paths = [r.path for r, _ in records]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(paths, pool.map(sha256_file, paths)))


def make_plan(
    records: list[tuple[Record, bool]], cfg: Config, family: ModelFamily, cache: DataCache, world: World
) -> Plan:
    """The full plan: buckets, fingerprints, the files' hashes, and every entry's key."""
    buckets = buckets_for(cfg.data, family.video)
    keys = cache_keys(cfg, family, cache, world)
    aug = CaptionAugment.from_config(cfg.data)
    hashes = hash_images(records)
    placed, skipped = place_all(records, cfg.data, buckets)
    plan = Plan(items=[], keys=keys, captions={}, skipped=skipped)
    if aug.dropout_rate > 0:  # the empty caption, once, for the caption dropout
        plan.empty_text = keys.texts("")
        plan.captions.update((k, "") for k in plan.empty_text.values())
    for p in placed:
        plan.items.append(_keyed(p, keys, hashes[p.record.path], aug, plan.captions))
    return plan


def _keyed(p: Placement, keys: CacheKeys, sha: str, aug: CaptionAugment, captions: dict[str, str]) -> PlanItem:
    """``p`` with its entries' keys; the captions they encode are added to ``captions``."""
    caption = p.record.caption
    texts = keys.texts(caption)
    captions.update((k, caption) for k in texts.values())
    variants: list[TextKeys] = []
    if aug.varies and not p.prior:  # augmented captions, each cached like any caption
        for v in caption_variants(caption, aug):
            variants.append(keys.texts(v))
            captions.update((k, v) for k in variants[-1].values())
    return PlanItem(
        record=p.record,
        bucket=p.bucket,
        prior=p.prior,
        frames=p.frames,
        indices=p.indices,
        latent=keys.latent(p.bucket, sha, p.frames),
        image_sha256=sha,
        texts=texts,
        variants=tuple(variants),
    )
