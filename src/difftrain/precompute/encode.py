"""Encoding the planned entries the cache lacks: VAE latents, then text embeddings one stage at a time.

Each group's encoders are loaded only when something of it is missing, and freed after. On several processes
each encodes every N-th missing entry into its own shards, and after each phase the first process folds their
manifests into the cache's (:func:`merge_shards`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.schema import Config
from ..console import progress
from ..data.cache import DataCache, merge_manifests
from ..distributed import World
from ..distributed import barrier as dist_barrier
from ..errors import DataError
from ..families.base import ModelFamily
from ..utils import to_dtype
from .pipeline import decoded_batches, default_workers, to_unit_range
from .plan import Plan, PlanItem, Skipped


@dataclass
class LatentsDone:
    """What encoding this process's share of the latents gave: the entries it could not read (and why)."""

    unreadable: set[str] = field(default_factory=set)  # latent keys
    skipped: Skipped = field(default_factory=list)
    seconds: float | None = None  # decode + encode + write, the encoder's loading excluded; None when none were due


def encode_latents(
    cfg: Config, family: ModelFamily, cache: DataCache, items: list[PlanItem], mine: set[str], device: torch.device
) -> LatentsDone:
    """Encode the latents of ``mine`` (keys of ``items``' latents), an entry per distinct key, in batches of one
    bucket; the cache is flushed after."""
    done = LatentsDone()
    if not mine:
        return done
    pc = cfg.precompute
    comps = family.load(cfg.model, [family.image_encoder], dtype=to_dtype(pc.vae_dtype), device=device)
    todo = sorted((p for p in items if p.latent in mine), key=lambda p: p.shape)
    with progress() as bar, torch.no_grad():
        seen: set[str] = set()
        unique: list[PlanItem] = []
        for p in todo:  # equal pixels: once
            if p.latent not in seen:
                seen.add(p.latent)
                unique.append(p)
        jobs = [(p.latent, p.record, p.bucket, p.indices, p.image_sha256) for p in unique]
        task = bar.add_task("encoding latents", total=len(jobs))
        batches = decoded_batches(
            jobs,
            [p.shape for p in unique],
            pc.batch_size,
            video=family.video,
            random_crop=cfg.data.random_crop,
            workers=pc.num_workers if pc.num_workers is not None else default_workers(),
            pin=device.type == "cuda",
        )
        t_lat = time.perf_counter()
        for b in batches:
            for key, path, why in b["errors"]:
                done.skipped.append((path, why))
                done.unreadable.add(key)
            if b["pixels"] is not None:
                _encode_batch(family, comps, b, cache, device)
            bar.advance(task, len(b["keys"]) + len(b["errors"]))
    cache.flush()
    done.seconds = time.perf_counter() - t_lat
    del comps
    free_memory(device)
    return done


def _encode_batch(
    family: ModelFamily, comps: dict[str, Any], b: dict[str, Any], cache: DataCache, device: torch.device
) -> None:
    """One decoded batch of :func:`~difftrain.precompute.pipeline.decoded_batches` into the cache."""
    pix = to_unit_range(b["pixels"].to(device, non_blocking=True))
    lat = family.encode_images(comps, pix)
    extra = {}
    if family.image_conditioned:
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


def encode_texts(
    cfg: Config, family: ModelFamily, cache: DataCache, plan: Plan, world: World, device: torch.device
) -> int:
    """Encode every caption entry of ``plan`` the cache lacks (this process's share of each stage), text stages
    one after another so that only one stage's encoders are loaded at a time. Returns how many were missing
    (on all processes)."""
    pc, opts = cfg.precompute, cfg.text_encoders
    text_sets = plan.text_sets()
    encoded = 0
    for stage in family.enabled_stages(opts):
        missing_all = cache.missing(sorted({t[stage] for t in text_sets}))
        encoded += len(missing_all)
        missing = missing_all[world.rank :: world.size]  # this process's share
        if missing:
            comps = family.load(
                cfg.model,
                list(family.text_stages[stage]),
                dtype=to_dtype(pc.text_encoder_dtype),
                device=device,
                precision=family.stage_precision(stage, opts),
            )
            with progress() as bar, torch.no_grad():
                task = bar.add_task(f"encoding captions ({stage})", total=len(missing))
                for i in range(0, len(missing), pc.batch_size):
                    chunk = missing[i : i + pc.batch_size]
                    out = family.encode_prompts(comps, [plan.captions[k] for k in chunk], stage, opts)
                    for j, k in enumerate(chunk):
                        cache.put(k, {name: t[j].float().cpu() for name, t in out.items()})
                    bar.advance(task, len(chunk))
            cache.flush()
            del comps
            free_memory(device)
        merge_shards(cache, world)
    return encoded


def free_memory(device: torch.device) -> None:
    """After an encoder is dropped: its memory back to the system (and to CUDA's cache's owner)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gather(values: list[Any], world: World) -> list[Any]:
    """Every process's list, concatenated in rank order, on every process."""
    import torch.distributed as dist

    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, values)
    return [v for part in out for v in part]


def merge_shards(cache: DataCache, world: World) -> None:
    """After a phase: the first process folds the others' manifests into manifest.json; all read it again."""
    if not world.distributed:
        return
    dist_barrier(world)
    if world.main:
        merge_manifests(cache.root)
    dist_barrier(world)
    cache.reload()
