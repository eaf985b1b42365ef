"""precompute: dataset -> buckets -> VAE latents and text embeddings, cached once.

Only entries whose content key is not in the cache are encoded; the encoders
are loaded only when something is missing, one group at a time, and freed
after. The result is ``index.json`` in the cache: the items training reads.

The rooms: :mod:`.plan` decides what to cache (scan, class images, buckets,
keys from :mod:`difftrain.data.keys`), :mod:`.encode` encodes what the cache
lacks, and this module runs them in order and reports.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config.schema import Config
from ..console import warn
from ..data.cache import DataCache, cache_dir_for
from ..data.captions import CaptionAugment
from ..data.sources import ImageRecord
from ..data.subsets import Subset, resolve_subsets
from ..errors import DataError, UsageError
from ..families.base import ModelFamily
from ..families.registry import get_family
from ..runtime.distributed import World, world_from_env
from ..runtime.distributed import barrier as dist_barrier
from ..runtime.distributed import init as dist_init
from ..utils import cap_gpu_memory, fix_malloc_mmap_threshold, pick_device
from .encode import encode_latents, encode_texts, gather, merge_shards
from .plan import Placement, Plan, buckets_for, make_plan, place_all, scan


@dataclass
class SubsetRow:
    """One subset in the plan's table."""

    name: str
    origin: str  # kohya layout, reg_dir, data.subsets
    repeats: int
    is_reg: bool
    images: int = 0
    captions: dict[str, int] = field(default_factory=dict)  # where its items' captions came from, counted


@dataclass
class PrecomputeReport:
    cache_dir: Path
    items: int = 0
    latents_encoded: int = 0
    texts_encoded: int = 0
    latents_reused: int = 0
    masks: dict[str, int] = field(default_factory=dict)
    """Masked loss: items per mask source (alpha channel, mask file, mask per frame, none); empty without masks."""
    unmasked: list[tuple[str, str]] = field(default_factory=list)
    """Masked loss: (path, why) of the items without a mask (learned everywhere)."""
    masks_encoded: int = 0
    colour_masks: list[str] = field(default_factory=list)
    """Mask files in colour: their red channel is the weight (as sd-scripts reads them)."""
    texts_reused: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    buckets: dict[str, int] = field(default_factory=dict)
    converted: dict[str, int] = field(default_factory=dict)
    """Images of another pixel mode than RGB (CMYK, P, RGBA, I;16 ...) converted on the way, by mode."""
    captions: dict[str, int] = field(default_factory=dict)
    """Where the items' captions came from: caption, tags, caption+tags, or the fallback (empty, filename)."""
    subsets: list[SubsetRow] = field(default_factory=list)
    """Each folder read (kohya's layout, data.subsets, data.reg_dir) with its repeats, images and captions' sources;
    empty for data.dir read as one folder."""
    report_file: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of the phases: plan (scan, hashes, keys), latents (decode + encode + write, the encoder's
    loading excluded), texts; benchmarks/data_pipeline.py reads them."""


def precompute(cfg: Config, strict: bool = False, plan_only: bool = False) -> PrecomputeReport:
    """Encode what the cache lacks. On several processes (``difftrain precompute --gpus N``, or torchrun) each
    encodes every N-th missing latent and caption on its own GPU into its own shards; the first process
    merges their manifests after each phase and alone writes index.json. The plan (scan, buckets, keys) is
    made identically by every process. ``plan_only``: scan and bucket (image headers only, no hashing, no
    encoder) and return the bucket counts and what was dropped and why; nothing is written."""
    if cfg.data.dir is None and not cfg.data.subsets:
        raise UsageError(
            "No data folder was given.",
            hint="Set data.dir (--set data.dir=/path/to/images), or give a dataset config (--dataset-config FILE.toml).",
        )
    family = get_family(cfg.family)
    world = world_from_env()
    device = pick_device(cfg.precompute.device)
    if world.distributed and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", world.local_rank)
    dist_init(world, device)
    # the training's cap holds here too: a tier's precompute is checked on a bigger GPU as its card would leave it
    cap_gpu_memory(device, cfg.train.gpu_memory_limit_gib)
    cache = DataCache(cache_dir_for(cfg), shard_max_bytes=int(cfg.precompute.shard_max_mb * 2**20), writer=world.rank)
    if plan_only or not world.main:  # a plan writes nothing; the first process holds the lock for all of them
        return _precompute(cfg, family, world, device, cache, strict, plan_only)
    from ..runtime.locks import writer_lock

    with writer_lock(cache.root, "cache"):
        return _precompute(cfg, family, world, device, cache, strict, plan_only)


def _precompute(
    cfg: Config,
    family: ModelFamily,
    world: World,
    device: torch.device,
    cache: DataCache,
    strict: bool,
    plan_only: bool,
) -> PrecomputeReport:
    report = PrecomputeReport(cache_dir=cache.root)
    t_start = time.perf_counter()
    fix_malloc_mmap_threshold()  # host RAM flat however many images pass through (see its docstring)

    records, report.skipped = scan(cfg, family, world, device, plan_only=plan_only)
    subsets = resolve_subsets(cfg.data)
    if plan_only:
        placed, dropped = place_all(records, cfg.data, buckets_for(cfg.data, family.video), subsets)
        report.skipped += dropped
        report.subsets = subset_rows(subsets, placed)
        _plan_masks(report, placed, cfg)
        return _plan_report(report, placed)
    plan = make_plan(records, cfg, family, cache, world)
    report.skipped += plan.skipped
    report.seconds["plan"] = time.perf_counter() - t_start

    missing_lat = set(cache.missing(k for p in plan.items for k, _ in p.latent_jobs()))  # flip_aug's mirrored too
    mine_lat = set(sorted(missing_lat)[world.rank :: world.size])  # this process's share
    done = encode_latents(cfg, family, cache, plan.items, mine_lat, device)
    if done.seconds is not None:
        report.seconds["latents"] = done.seconds
    bad, newly_skipped = done.unreadable, done.skipped
    if world.distributed:  # every process learns which items the others could not read
        bad = set(gather(sorted(bad), world))
        newly_skipped = [(path, why) for path, why in gather(newly_skipped, world)]
        merge_shards(cache, world)
    report.skipped += newly_skipped
    plan.items = [p for p in plan.items if not any(k in bad for k, _ in p.latent_jobs())]
    entries = [k for p in plan.items for k, _ in p.latent_jobs()]
    report.latents_encoded = len({k for k in entries if k in missing_lat})
    report.latents_reused = len(entries) - sum(k in missing_lat for k in entries)
    _masks_phase(report, plan, cache, world)

    n_text_keys = len({k for t in plan.text_sets() for k in t.values()})
    t_txt = time.perf_counter()
    report.texts_encoded = encode_texts(cfg, family, cache, plan, world, device)
    report.texts_reused = n_text_keys - report.texts_encoded
    report.seconds["texts"] = time.perf_counter() - t_txt

    report.subsets = subset_rows(subsets, plan.items)
    _finish_report(report, plan, cache, cfg, world, strict)
    if world.main:  # the first process writes the index
        cache.write_json("index.json", plan.index(cfg, CaptionAugment.from_config(cfg.data)).to_json())
    dist_barrier(world)
    return report


def subset_rows(subsets: list[Subset], placed: Sequence[Placement]) -> list[SubsetRow]:
    """The table of subsets: none for data.dir read as one folder."""
    if [s.name for s in subsets] == [""]:
        return []
    rows = {s.name: SubsetRow(s.name, s.origin, s.repeats, s.is_reg) for s in subsets}
    for p in placed:
        row = rows.get(p.record.subset)
        if row is None:
            continue  # a DreamBooth class image
        row.images += 1
        origin = getattr(p.record, "caption_from", None) or ("caption" if p.record.caption else "empty")
        row.captions[origin] = row.captions.get(origin, 0) + 1
    return list(rows.values())


def _plan_report(report: PrecomputeReport, placed: list[Placement]) -> PrecomputeReport:
    """``precompute --plan``: the bucket counts (with the frame count of a clip's bucket)."""
    for p in placed:
        report.buckets[p.shape_name] = report.buckets.get(p.shape_name, 0) + 1
    report.items = len(placed)
    return report


def _plan_masks(report: PrecomputeReport, placed: list[Placement], cfg: Config) -> None:
    """``precompute --plan-only``: where the masks come from and which items have none (masks found, not read)."""
    from .plan import find_masks

    found = find_masks(placed, cfg)
    if found.record is not None:
        report.masks = found.counts()
        report.unmasked = found.unmasked


def _masks_phase(report: PrecomputeReport, plan: Plan, cache: DataCache, world: World) -> None:
    """Masked loss: the masks the cache lacks fitted to their latents (this process's share), the items whose mask
    cannot be read skipped, and the counts reported."""
    from .masks import encode_masks
    from .plan import MaskPlan

    if plan.masks is None:
        return
    missing = set(cache.missing(sorted({k for p in plan.items for k in (p.mask, p.flipped_mask) if k})))
    done = encode_masks(cache, plan.items, set(sorted(missing)[world.rank :: world.size]))
    bad, skipped, colour = done.unreadable, done.skipped, done.colour
    if world.distributed:
        bad = set(gather(sorted(bad), world))
        skipped = [(path, why) for path, why in gather(skipped, world)]
        colour = gather(colour, world)
        merge_shards(cache, world)
    report.skipped += skipped
    plan.items = [p for p in plan.items if p.mask not in bad and p.flipped_mask not in bad]
    report.masks_encoded = len(missing - bad)
    report.masks = MaskPlan([p.mask_source for p in plan.items if not p.prior or p.mask]).counts()
    report.unmasked = plan.unmasked
    report.colour_masks = sorted(colour)


def _finish_report(
    report: PrecomputeReport, plan: Plan, cache: DataCache, cfg: Config, world: World, strict: bool
) -> None:
    """The conversions and caption sources counted, precompute-report.json written, the skipped files warned
    of; DataError when nothing is usable, or something was skipped under ``strict``; then the bucket counts."""
    for p in plan.items:
        r = p.record
        if isinstance(r, ImageRecord) and r.mode != "RGB":
            report.converted[r.mode] = report.converted.get(r.mode, 0) + 1
        if not p.prior and isinstance(r, ImageRecord) and r.caption_from:
            report.captions[r.caption_from] = report.captions.get(r.caption_from, 0) + 1
    if world.main:
        report.report_file = _write_report(cache, cfg, report, len(plan.items))
    for path, why in report.skipped[:20]:
        warn(f"skipped {path}: {why}")
    for path, why in report.unmasked[:20]:
        warn(f"masked loss: {path}: {why}")
    if len(report.unmasked) > 20:
        warn(f"masked loss: ... and {len(report.unmasked) - 20} more without a mask (learned everywhere)")
    if len(report.skipped) > 20:
        warn(f"... and {len(report.skipped) - 20} more skipped (all of them: {cache.root / 'precompute-report.json'})")
    if not plan.items:
        raise DataError(
            f"No usable images in {cfg.data.dir or ', '.join(str(s.dir) for s in cfg.data.subsets)}"
            + (f" ({len(report.skipped)} skipped)" if report.skipped else "")
            + ".",
            hint="Add .png/.jpg/.webp images with caption files, or check the skipped list above.",
        )
    if strict and report.skipped:
        raise DataError(
            f"{len(report.skipped)} image(s) could not be used and --strict is set.", hint="Fix or remove them."
        )
    for p in plan.items:
        report.buckets[p.size_name] = report.buckets.get(p.size_name, 0) + 1
    report.items = len(plan.items)


def _write_report(cache: DataCache, cfg: Config, report: PrecomputeReport, usable: int) -> Path:
    """precompute-report.json in the cache: every skipped file with the reason, the conversions and where
    the captions came from (written atomically, before a run with nothing usable fails)."""
    import datetime

    path = cache.root / "precompute-report.json"
    cache.write_json(
        path.name,
        {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "data_dir": str(cfg.data.dir),
            "usable": usable,
            "skipped": [{"path": p, "reason": why} for p, why in report.skipped],
            "converted": report.converted,
            "captions": report.captions,
            "latents_encoded": report.latents_encoded,
            "latents_reused": report.latents_reused,
            **(
                {"masks": report.masks, "unmasked": [{"path": p, "reason": why} for p, why in report.unmasked]}
                if report.masks
                else {}
            ),
        },
    )
    return path
