"""Encoding the planned entries the cache lacks: VAE latents, then text embeddings one stage at a time.

Each group's encoders are loaded only when something of it is missing, and freed after. On several processes
each encodes every N-th missing entry into its own shards, and after each phase the first process folds their
manifests into the cache's (:func:`merge_shards`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config.schema import Config
from ..console import info, progress, warn
from ..data.cache import DataCache, merge_manifests
from ..data.sources import load_rgb
from ..errors import DataError
from ..families.base import ModelFamily
from ..memory.planner import VAE_ENCODE_BYTES_PER_PIXEL, vae_chunk
from ..runtime.distributed import World
from ..runtime.distributed import barrier as dist_barrier
from ..utils import free_memory, to_dtype
from .pipeline import decoded_batches, default_workers, to_unit_range
from .plan import Plan, PlanItem, Skipped

if TYPE_CHECKING:
    from PIL import Image

    from ..data.buckets import Bucket


def gpu_room(device: torch.device) -> float:
    """Bytes torch may still allocate on ``device``: what the GPU has free plus this process's cached blocks, within
    a per-process cap (``set_per_process_memory_fraction``) where one is set."""
    idx = device.index if device.index is not None else torch.cuda.current_device()  # "cuda": the current one
    free, total = torch.cuda.mem_get_info(idx)
    allocated = torch.cuda.memory_allocated(idx)
    room = float(free + torch.cuda.memory_reserved(idx) - allocated)
    fraction = torch.cuda.get_per_process_memory_fraction(idx)
    if fraction < 1.0:
        room = min(room, fraction * total - allocated)
    return max(room, 0.0)


@dataclass
class _Chunk:
    """The VAE's batch on this device: planned from free memory, halved where the GPU still runs out."""

    size: int
    said: bool = False


@dataclass
class LatentsDone:
    """What encoding this process's share of the latents gave: the entries it could not read (and why)."""

    unreadable: set[str] = field(default_factory=set)  # latent keys
    skipped: Skipped = field(default_factory=list)
    seconds: float | None = None  # decode + encode + write, the encoder's loading excluded; None when none were due


def encode_latents(
    cfg: Config, family: ModelFamily, cache: DataCache, items: list[PlanItem], mine: set[str], device: torch.device
) -> LatentsDone:
    """Encode the latents of ``mine`` (keys of ``items``' latents, flip_aug's mirrored ones included), an entry per
    distinct key, in batches of one bucket; the cache is flushed after."""
    done = LatentsDone()
    if not mine:
        return done
    pc = cfg.precompute
    comps = family.load(cfg.model, [family.image_encoder], dtype=to_dtype(pc.vae_dtype), device=device)
    todo = sorted(((p, k, m) for p in items for k, m in p.latent_jobs() if k in mine), key=lambda t: t[0].shape)
    with progress() as bar, torch.no_grad():
        seen: set[str] = set()
        unique: list[tuple[PlanItem, str, bool]] = []
        for p, k, m in todo:  # equal pixels: once
            if k not in seen:
                seen.add(k)
                unique.append((p, k, m))
        jobs = [(k, p.record, p.bucket, p.indices, p.image_sha256, m) for p, k, m in unique]
        task = bar.add_task("encoding latents", total=len(jobs))
        batches = decoded_batches(
            jobs,
            [p.shape for p, _, _ in unique],
            pc.batch_size,
            video=family.video,
            random_crop=cfg.data.random_crop,
            workers=pc.num_workers if pc.num_workers is not None else default_workers(),
            pin=device.type == "cuda",
        )
        t_lat = time.perf_counter()
        chunk = _Chunk(pc.batch_size)
        for b in batches:
            for key, path, why in b["errors"]:
                done.skipped.append((path, why))
                done.unreadable.add(key)
            if b["pixels"] is not None:
                _encode_batch(family, comps, b, cache, device, pc.vae_dtype, chunk)
            bar.advance(task, len(b["keys"]) + len(b["errors"]))
    cache.flush()
    done.seconds = time.perf_counter() - t_lat
    del comps
    free_memory(device)
    return done


def _encode_images(
    family: ModelFamily, comps: dict[str, Any], pix: torch.Tensor, device: torch.device, vae_dtype: str, chunk: _Chunk
) -> torch.Tensor:
    """An image family's latents of ``pix`` in as many images at a time as the GPU holds: planned from its free
    memory before the first batch, halved (and said once) if it runs out all the same."""
    if device.type != "cuda" or family.video:  # the video VAE tiles its own encode (families/cogvideox/family.py)
        return family.encode_images(comps, pix)
    n = vae_chunk(chunk.size, vae_dtype, pix.shape[-1] * pix.shape[-2], gpu_room(device))  # at most chunk.size
    out: list[torch.Tensor] = []
    i = 0
    while i < len(pix):
        try:
            out.append(family.encode_images(comps, pix[i : i + n]))
            i += n
        except torch.OutOfMemoryError as e:
            if n == 1:
                raise DataError(
                    f"The VAE ran out of GPU memory encoding one {pix.shape[-2]}x{pix.shape[-1]} image in "
                    f"{vae_dtype} on {device} ({gpu_room(device) / 2**30:.2f} GiB free).",
                    hint=("set precompute.vae_dtype: bf16 (half fp32's memory), " if vae_dtype == "fp32" else "")
                    + "close what else uses the GPU, or set precompute.device: cpu (slower).",
                ) from e
            n //= 2
        else:
            chunk.size = min(chunk.size, n)  # what fitted once stands for the rest of the run
            continue
        # after the except block (the failed batch's tensors live as long as its error; collected for a cycle
        # through it), as flows/bench.py's FLOP count retries
        free_memory(device)
    if len(pix) > n and not chunk.said:
        chunk.said = True
        need = VAE_ENCODE_BYTES_PER_PIXEL[vae_dtype] * pix.shape[-1] * pix.shape[-2] * len(pix) / 2**30
        info(
            f"precompute: the VAE encodes {n} image(s) at a time on {device}: a batch of {len(pix)} would need "
            f"~{need:.1f} GiB in {vae_dtype}, {gpu_room(device) / 2**30:.1f} GiB is free"
        )
    return torch.cat(out) if len(out) > 1 else out[0]


def _encode_batch(
    family: ModelFamily,
    comps: dict[str, Any],
    b: dict[str, Any],
    cache: DataCache,
    device: torch.device,
    vae_dtype: str,
    chunk: _Chunk,
) -> None:
    """One decoded batch of :func:`~difftrain.precompute.pipeline.decoded_batches` into the cache."""
    pix = to_unit_range(b["pixels"].to(device, non_blocking=True))
    lat = _encode_images(family, comps, pix, device, vae_dtype, chunk)
    extra = {}
    if family.image_conditioned:
        # image-to-video: the family's image conditioning (the noise-augmented first frame), seeded by the clip's
        # content
        g = torch.Generator().manual_seed(int(b["keys"][0][:15], 16))
        refs = b.get("references")  # edit training: the reference images, fitted to the target's bucket
        more = {} if refs is None else {"references": to_unit_range(refs.to(device, non_blocking=True))}
        extra.update(family.image_condition_entries(comps, pix, generator=g, **more))
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
            option = _smaller_precision(cfg, family, stage)
            need = _stage_gib(cfg, family, stage) if device.type == "cuda" else None
            room = gpu_room(device) / 2**30 if need is not None else 0.0
            if need is not None and need > room:
                warn(
                    f"precompute: the {stage} text encoder at its precision takes ~{need:.1f} GiB and "
                    f"{room:.1f} GiB is free on {device}: it may run out of memory"
                    + (f" (a smaller precision: {option})" if option else "")
                )
            comps: dict[str, Any] | None = None
            try:
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
                        captions = [plan.captions[k] for k in chunk]
                        if family.references:  # edit training: each caption encoded with its reference images
                            images = [
                                [_text_reference(p, plan.reference_fit.get(k)) for p in plan.references[k]]
                                for k in chunk
                            ]
                            out = family.encode_prompts_with_images(comps, captions, images, stage, opts, cfg.model)
                        else:
                            out = family.encode_prompts(comps, captions, stage, opts)
                        for j, k in enumerate(chunk):
                            cache.put(k, {name: t[j].float().cpu() for name, t in out.items()})
                        bar.advance(task, len(chunk))
            except torch.OutOfMemoryError as e:
                cache.flush()  # the captions encoded before it ran out are kept: a rerun encodes the rest
                comps = None
                free_memory(device)
                need = _stage_gib(cfg, family, stage)
                raise DataError(
                    f"precompute: the {stage} text encoder ran out of GPU memory on {device}"
                    + (f" (it takes ~{need:.1f} GiB at its precision)" if need is not None else "")
                    + "; the captions encoded before are kept in the cache.",
                    hint=(f"set {option}, or " if option else "")
                    + "close what else uses the GPU, precompute once on a larger GPU (the cache is the same), or set "
                    "precompute.device: cpu (slow).",
                ) from e
            cache.flush()
            del comps
            free_memory(device)
        merge_shards(cache, world)
    return encoded


def _text_reference(path: Path, fit: tuple[Bucket, str | None] | None) -> Image.Image:
    """A reference image for the caption's encoding: as read, or fitted to the bucket ``fit`` names and cropped as
    the decoder crops it for its latents (precompute/pipeline.py: the crop seeded by the target's sha256)."""
    image = load_rgb(path)
    if fit is None:
        return image
    import random

    from ..data.buckets import fit_to_bucket

    bucket, seed = fit
    return fit_to_bucket(image, bucket, rng=random.Random(seed) if seed is not None else None)[0]


def _stage_gib(cfg: Config, family: ModelFamily, stage: str) -> float | None:
    """GiB the stage's encoder takes at its precision: T5-XXL's as measured, a language model's as estimated from its
    parameters (built on the meta device); None where not known."""
    from ..families.llm_image import LLMImageFamily
    from ..memory.planner import T5_PRECOMPUTE_GIB
    from ..planning.estimate import llm_precompute_gib

    if isinstance(family, LLMImageFamily):
        llm = llm_precompute_gib(cfg)
        return llm[2] if llm else None
    return T5_PRECOMPUTE_GIB[cfg.text_encoders.t5.precision] if stage == "t5" else None


def _smaller_precision(cfg: Config, family: ModelFamily, stage: str) -> str | None:
    """The setting that loads the stage's encoder in less memory, if there is a smaller precision than its own."""
    from ..families.llm_image import LLMImageFamily

    opts = cfg.text_encoders
    if isinstance(family, LLMImageFamily):
        return None if opts.llm.precision == "nf4" else "text_encoders.llm.precision: nf4"
    if stage == "t5":
        return None if opts.t5.precision == "nf4" else "text_encoders.t5.precision: nf4"
    return None


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
