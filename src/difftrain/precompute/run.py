"""precompute: dataset -> buckets -> VAE latents and text embeddings, cached once.

Only entries whose content key is not in the cache are encoded; the encoders
are loaded only when something is missing, one group at a time, and freed
after. The result is ``index.json`` in the cache: the items training reads.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..config.schema import Config
from ..console import progress, warn
from ..data.buckets import choose_bucket, make_buckets
from ..data.cache import DataCache, cache_dir_for, merge_manifests
from ..data.captions import CaptionAugment, caption_variants
from ..data.keys import cache_fingerprints, clip_tag, crop_mode, latent_key, text_key
from ..data.sources import scan_dataset
from ..distributed import barrier as dist_barrier
from ..distributed import init as dist_init
from ..distributed import world_from_env
from ..errors import DataError, UsageError
from ..families.registry import get_family
from ..utils import fix_malloc_mmap_threshold, pick_device, sha256_file, to_dtype
from .pipeline import decoded_batches, default_workers, to_unit_range
from .prior import ensure_class_images


@dataclass
class PrecomputeReport:
    cache_dir: Path
    items: int = 0
    latents_encoded: int = 0
    texts_encoded: int = 0
    latents_reused: int = 0
    texts_reused: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    buckets: dict[str, int] = field(default_factory=dict)
    converted: dict[str, int] = field(default_factory=dict)
    """Images of another pixel mode than RGB (CMYK, P, RGBA, I;16 ...) converted on the way, by mode."""
    captions: dict[str, int] = field(default_factory=dict)
    """Where the items' captions came from: caption, tags, caption+tags, or the fallback (empty, filename)."""
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
    if cfg.data.dir is None:
        raise UsageError("No data folder was given.", hint="Set data.dir (--set data.dir=/path/to/images).")
    family = get_family(cfg.family)
    world = world_from_env()
    device = pick_device(cfg.precompute.device)
    if world.distributed and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", world.local_rank)
    dist_init(world, device)
    cache = DataCache(cache_dir_for(cfg), shard_max_bytes=int(cfg.precompute.shard_max_mb * 2**20), writer=world.rank)
    report = PrecomputeReport(cache_dir=cache.root)
    t_start = time.perf_counter()
    fix_malloc_mmap_threshold()  # host RAM flat however many images pass through (see its docstring)

    video = getattr(family, "video", False)
    if video:
        from ..data.video import frame_buckets, scan_videos

        fbuckets = frame_buckets(cfg.data.frames)
        records, skipped = scan_videos(
            Path(cfg.data.dir),
            caption_ext=cfg.data.caption_ext,
            buckets=fbuckets,
            allow_outside=cfg.data.allow_outside_paths,
        )
    else:
        records, skipped = scan_dataset(
            Path(cfg.data.dir),
            metadata=cfg.data.metadata,
            caption_ext=cfg.data.caption_ext,
            tag_ext=cfg.data.tag_ext,
            caption_source=cfg.data.caption_source,
            caption_fallback=cfg.data.caption_fallback,
            allow_outside=cfg.data.allow_outside_paths,
        )
    report.skipped += [(str(p), why) for p, why in skipped]
    db = cfg.dreambooth
    if video and db.with_prior_preservation:
        raise UsageError(
            "dreambooth.with_prior_preservation is not available for video families yet "
            "(class clips would have to be generated).",
            hint="Set dreambooth.with_prior_preservation: false.",
        )
    if db.instance_prompt:
        records = [
            replace(r, caption=r.caption if (db.use_captions and r.caption) else db.instance_prompt) for r in records
        ]
    records = [(r, False) for r in records]
    if db.with_prior_preservation and not plan_only:  # (a plan does not generate class images)
        if not world.main:  # the first process generates missing class images; the others then find them
            dist_barrier(world)
        folder = ensure_class_images(cfg, family, device)
        if world.main:
            dist_barrier(world)
        class_records, class_skipped = scan_dataset(folder)
        report.skipped += [(str(p), why) for p, why in class_skipped]
        records += [(replace(r, key="class:" + r.key, caption=db.class_prompt), True) for r in class_records]
    d = cfg.data
    if video:
        from ..data.video import video_size_buckets

        buckets = video_size_buckets(d.resolution, d.bucket_step, d.min_side, d.max_side)
    else:
        buckets = make_buckets(d.resolution, d.bucket_step, d.min_side, d.max_side)

    pc = cfg.precompute
    opts = cfg.text_encoders
    stages = family.enabled_stages(opts)
    memo = cache.read_json("fingerprints.json", {})
    vae_fp, stage_fp = None, {}
    if not plan_only:  # the keys need the encoders' weight hashes; a plan needs neither
        # each text stage has its own key: a changed T5 precision re-encodes T5 only
        vae_fp, stage_fp = cache_fingerprints(family, cfg, memo)
        if world.main:
            cache.write_json("fingerprints.json", memo)
    crop = crop_mode(d.random_crop)
    aug = CaptionAugment.from_config(d)
    caption_of: dict[str, str] = {}  # text entry key -> the caption it encodes
    empty_text = None
    if aug.dropout_rate > 0 and not plan_only:  # the empty caption, once, for the caption dropout
        empty_text = {s: text_key(family.name, s, stage_fp[s], "") for s in stages}
        caption_of.update((k, "") for k in empty_text.values())

    # the images' sha256 (their latents' keys), read by threads: hashing releases the GIL, and one
    # thread at a time would leave a fast disk idle
    hashes: dict = {}
    if not plan_only:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=8) as pool:
            hashes = dict(zip((r.path for r, _ in records), pool.map(sha256_file, (r.path for r, _ in records))))
    plan = []
    for r, is_prior in records:
        frames = None
        try:
            if video:
                from ..data.video import choose_frames, choose_video_bucket, sample_frame_indices

                bucket = choose_video_bucket(r.width, r.height, buckets)
                frames = choose_frames(r.frames, fbuckets, is_image=r.is_image)
                if frames is None:
                    raise ValueError(f"{r.frames} frames: shorter than the smallest frame bucket ({fbuckets[1]})")
                indices = sample_frame_indices(r.frames, frames, mode=d.frame_sampling)
            else:
                bucket = choose_bucket(
                    r.width, r.height, buckets, resolution=d.resolution, step=d.bucket_step, no_upscale=d.no_upscale
                )
        except ValueError as e:  # e.g. smaller than one bucket step with no_upscale
            report.skipped.append((str(r.path), str(e)))
            continue
        enlarge = max(bucket[0] / r.width, bucket[1] / r.height)
        if d.max_upscale is not None and enlarge > d.max_upscale:
            report.skipped.append(
                (
                    str(r.path),
                    f"too small: {r.width}x{r.height} would be enlarged {enlarge:.1f}x to fill "
                    f"its bucket {bucket[0]}x{bucket[1]} (data.max_upscale is {d.max_upscale:g})",
                )
            )
            continue
        if plan_only:
            plan.append({"record": r, "bucket": bucket, "frames": frames, "prior": is_prior})
            continue
        img_hash = hashes[r.path]
        clip = clip_tag(frames, d.frame_sampling) if video else ""  # the frames taken are part of what is encoded
        lkey = latent_key(family.name, vae_fp, pc.vae_dtype, bucket, crop, img_hash, clip)
        tkeys = {s: text_key(family.name, s, stage_fp[s], r.caption) for s in stages}
        caption_of.update((k, r.caption) for k in tkeys.values())
        variants = None
        if aug.varies and not is_prior:  # augmented captions, each cached like any caption
            variants = []
            for v in caption_variants(r.caption, aug):
                variants.append({s: text_key(family.name, s, stage_fp[s], v) for s in stages})
                caption_of.update((k, v) for k in variants[-1].values())
        plan.append(
            {
                "record": r,
                "bucket": bucket,
                "latent": lkey,
                "texts": tkeys,
                "image_sha256": img_hash,
                "prior": is_prior,
                "frames": frames,
                "indices": indices if video else None,
                "variants": variants,
            }
        )

    if plan_only:
        for p in plan:
            key = f"{p['bucket'][0]}x{p['bucket'][1]}" + (f"x{p['frames']}f" if p["frames"] else "")
            report.buckets[key] = report.buckets.get(key, 0) + 1
        report.items = len(plan)
        return report
    report.seconds["plan"] = time.perf_counter() - t_start
    n_skipped_before = len(report.skipped)  # the same on every process: what the scan and the plan dropped
    missing_lat = set(cache.missing(p["latent"] for p in plan))
    mine_lat = set(sorted(missing_lat)[world.rank :: world.size])  # this process's share
    if mine_lat:
        comps = family.load(cfg.model, [family.image_encoder], dtype=to_dtype(pc.vae_dtype), device=device)
        todo = [p for p in plan if p["latent"] in mine_lat]
        todo.sort(key=lambda p: (p["bucket"], p["frames"] or 1))
        with progress() as bar, torch.no_grad():
            seen: set[str] = set()
            todo = [p for p in todo if not (p["latent"] in seen or seen.add(p["latent"]))]  # equal pixels: once
            jobs = [(p["latent"], p["record"], p["bucket"], p["indices"], p["image_sha256"]) for p in todo]
            task = bar.add_task("encoding latents", total=len(jobs))
            workers = pc.num_workers if pc.num_workers is not None else default_workers()
            batches = decoded_batches(
                jobs,
                [(p["bucket"], p["frames"] or 1) for p in todo],
                pc.batch_size,
                video=video,
                random_crop=d.random_crop,
                workers=workers,
                pin=device.type == "cuda",
            )
            unreadable: set[str] = set()
            t_lat = time.perf_counter()
            for b in batches:
                for key, path, why in b["errors"]:
                    report.skipped.append((path, why))
                    unreadable.add(key)
                if b["pixels"] is None:
                    bar.advance(task, len(b["errors"]))
                    continue
                pix = to_unit_range(b["pixels"].to(device, non_blocking=True))
                lat = family.encode_images(comps, pix)
                extra = {}
                if getattr(family, "image_conditioned", False):
                    # image-to-video: the noise-augmented first frame, seeded by the clip's content; only its
                    # first latent frame is stored (the rest are zeros, added back at training time)
                    g = torch.Generator().manual_seed(int(b["keys"][0][:15], 16))
                    extra["image_latents"] = family.encode_first_frame(comps, pix, generator=g)[:, :, :1]
                if not torch.isfinite(lat).all():
                    raise DataError(
                        "The VAE produced NaN/inf latents.",
                        hint="SDXL's VAE overflows in fp16: set precompute.vae_dtype: fp32 (or bf16).",
                    )
                for j, (key, crop) in enumerate(zip(b["keys"], b["crops"])):
                    # the crop offsets are SDXL conditioning: they live with the latent
                    entry = {"latents": lat[j], "crop": torch.tensor(crop, dtype=torch.int64)}
                    entry.update({k: v[j] for k, v in extra.items()})
                    cache.put(key, entry)
                bar.advance(task, len(b["keys"]) + len(b["errors"]))
            for p in plan:
                if p["latent"] in unreadable:
                    p["bad"] = True
        cache.flush()
        report.seconds["latents"] = time.perf_counter() - t_lat
        del comps
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if world.distributed:  # every process learns which items the others could not read
        bad_keys = set(_gather([p["latent"] for p in plan if p.get("bad")], world))
        report.skipped = report.skipped[:n_skipped_before] + [
            tuple(x) for x in _gather(report.skipped[n_skipped_before:], world)
        ]
        for p in plan:
            if p["latent"] in bad_keys:
                p["bad"] = True
        _merge(cache, world)
    plan = [p for p in plan if not p.get("bad")]
    report.latents_encoded = len({p["latent"] for p in plan if p["latent"] in missing_lat})
    report.latents_reused = len(plan) - sum(p["latent"] in missing_lat for p in plan)

    # every caption entry the items use ({stage: key} each): their captions, augmented variants, the empty caption
    text_sets = [t for p in plan for t in (p["texts"], *(p["variants"] or ()))] + ([empty_text] if empty_text else [])
    n_text_keys = len({k for t in text_sets for k in t.values()})
    t_txt = time.perf_counter()
    # text stages one after another: only one stage's encoders are loaded at a time
    for stage in stages:
        keys = sorted({t[stage] for t in text_sets})
        missing_all = cache.missing(keys)
        report.texts_encoded += len(missing_all)
        missing_txt = missing_all[world.rank :: world.size]  # this process's share
        if not missing_txt:
            _merge(cache, world)
            continue
        comps = family.load(
            cfg.model,
            list(family.text_stages[stage]),
            dtype=to_dtype(pc.text_encoder_dtype),
            device=device,
            precision=family.stage_precision(stage, opts),
        )
        with progress() as bar, torch.no_grad():
            task = bar.add_task(f"encoding captions ({stage})", total=len(missing_txt))
            for i in range(0, len(missing_txt), pc.batch_size):
                chunk = missing_txt[i : i + pc.batch_size]
                out = family.encode_prompts(comps, [caption_of[k] for k in chunk], stage, opts)
                for j, k in enumerate(chunk):
                    cache.put(k, {name: t[j].float().cpu() for name, t in out.items()})
                bar.advance(task, len(chunk))
        cache.flush()
        del comps
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _merge(cache, world)
    report.texts_reused = n_text_keys - report.texts_encoded
    report.seconds["texts"] = time.perf_counter() - t_txt

    for p in plan:
        r = p["record"]
        mode = getattr(r, "mode", "RGB")
        if mode != "RGB":
            report.converted[mode] = report.converted.get(mode, 0) + 1
        if not p["prior"] and getattr(r, "caption_from", None):
            report.captions[r.caption_from] = report.captions.get(r.caption_from, 0) + 1
    if world.main:
        report.report_file = _write_report(cache, cfg, report, len(plan))
    for path, why in report.skipped[:20]:
        warn(f"skipped {path}: {why}")
    if len(report.skipped) > 20:
        warn(f"... and {len(report.skipped) - 20} more skipped (all of them: {cache.root / 'precompute-report.json'})")
    if not plan:
        raise DataError(
            f"No usable images in {cfg.data.dir}"
            + (f" ({len(report.skipped)} skipped)" if report.skipped else "")
            + ".",
            hint="Add .png/.jpg/.webp images with caption files, or check the skipped list above.",
        )
    if strict and report.skipped:
        raise DataError(
            f"{len(report.skipped)} image(s) could not be used and --strict is set.", hint="Fix or remove them."
        )

    for p in plan:
        bucket = f"{p['bucket'][0]}x{p['bucket'][1]}"
        report.buckets[bucket] = report.buckets.get(bucket, 0) + 1
    report.items = len(plan)
    if not world.main:  # the first process writes the index
        dist_barrier(world)
        return report
    items = []
    for p in plan:
        r, (bw, bh) = p["record"], p["bucket"]
        items.append(
            {
                "key": r.key,
                "image": str(r.path),
                "caption": r.caption,
                "bucket": [bw, bh],
                **({"frames": p["frames"]} if p["frames"] else {}),
                "original_size": [r.height, r.width],
                "latent": p["latent"],
                "image_sha256": p["image_sha256"],
                "texts": p["texts"],
                **({"text_variants": p["variants"]} if p["variants"] else {}),
                **({"prior": True} if p["prior"] else {}),
            }
        )
    cache.write_json(
        "index.json",
        {
            "family": family.name,
            "model": str(cfg.model.path),
            "vae": vae_fp,
            "text_stages": stage_fp,
            "vae_dtype": pc.vae_dtype,
            "text_encoder_dtype": pc.text_encoder_dtype,
            "captions": aug.record(),
            **({"empty_text": empty_text} if empty_text else {}),
            "items": items,
        },
    )
    dist_barrier(world)
    return report


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
        },
    )
    return path


def _gather(values: list, world) -> list:
    """Every process's list, concatenated in rank order, on every process."""
    import torch.distributed as dist

    out = [None] * world.size
    dist.all_gather_object(out, values)
    return [v for part in out for v in part]


def _merge(cache: DataCache, world) -> None:
    """After a phase: the first process folds the others' manifests into manifest.json; all read it again."""
    if not world.distributed:
        return
    dist_barrier(world)
    if world.main:
        merge_manifests(cache.root)
    dist_barrier(world)
    cache.reload()
