"""Batches from the precompute cache: the index's items, held-out and class items, the epoch's batches, and the
tensors of a micro-batch (cached latents and text embeddings, or captions encoded live when an encoder trains).

Every choice here is a function of (seed, epoch, batch position) and the items, never of a running generator,
so a resumed run, or one on another number of processes, feeds exactly what an uninterrupted one would.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config.schema import Config
from ..console import info
from ..data.batches import BucketBatchSampler
from ..data.cache import DataCache, cache_dir_for
from ..data.captions import CaptionAugment, live_caption, pick_text
from ..data.index import CacheIndex, IndexItem
from ..data.masks import masks_wanted
from ..errors import CacheMismatch, ConfigError
from ..families.base import ModelFamily, host_stack

#: encodes captions of one text stage on the fly (a trained encoder): (stage, captions) -> its tensors
LiveEncoder = Callable[[str, list[str]], dict[str, torch.Tensor]]


def open_index(cfg: Config, family: ModelFamily) -> tuple[DataCache, CacheIndex]:
    """The cache and its index, refused when there is nothing to train on or it was made for another family."""
    cache = DataCache(cache_dir_for(cfg))
    raw = cache.read_json("index.json")
    index = CacheIndex.from_json(raw, cache.root / "index.json") if raw else None
    if index is None or not index.items:
        raise CacheMismatch(
            f"No precomputed data in {cache.root}.",
            hint="Run `difftrain precompute` with the same recipe/config first.",
        )
    if index.family != family.name:
        raise CacheMismatch(
            f"The cache at {cache.root} was made for {index.family!r}, not {family.name!r}.",
            hint="Point data.cache_dir at the cache of this model family, or run precompute again.",
        )
    return cache, index


def recut(batches: list[list[int]], keys: list, size: int) -> list[list[int]]:
    """The items of ``batches`` (in order) cut into batches of ``size`` within each bucket: every item once,
    buckets in the order they first appear. How an epoch continues when the global batch changes."""
    order: dict = {}
    for b in batches:
        for i in b:
            order.setdefault(keys[i], []).append(i)
    return [items[j : j + size] for items in order.values() for j in range(0, len(items), size)]


def flip_drawn(item: IndexItem, seed: int, epoch: int) -> bool:
    """flip_aug: whether ``item`` is fed mirrored in ``epoch`` (half the time, as sd-scripts flips each image it
    loads with probability 0.5). A function of the seed, the epoch and the item (each repeat its own draw) only,
    as the caption draws are, so a resumed run, or one on another number of processes, draws the same."""
    return item.flipped is not None and random.Random(f"difftrain-flip:{seed}:{epoch}:{item.draw_key}").random() < 0.5


@dataclass
class Position:
    """Where training is: the optimizer step, and the sampler's epoch and batch (what a checkpoint stores)."""

    step: int = 0
    epoch: int = 0
    batch_pos: int = 0
    plan: tuple[int, list[list[int]]] | None = None  # (epoch, batches) of an epoch re-cut on resume


class Feed:
    """The items training reads and the tensors of each micro-batch."""

    def __init__(self, cfg: Config, family: ModelFamily, device: torch.device) -> None:
        self.cfg, self.family, self.device = cfg, family, device
        self.cache, self.index = open_index(cfg, family)
        # DreamBooth prior preservation: class images ride along with each instance batch
        self.items = [it for it in self.index.items if not it.prior]
        self.prior_items = [it for it in self.index.items if it.prior]
        if cfg.dreambooth.with_prior_preservation and not self.prior_items:
            raise CacheMismatch(
                "dreambooth.with_prior_preservation is set but the cache has no class images.",
                hint="Run `difftrain precompute` with the same config (it generates and caches them).",
            )
        if not self.items:
            raise CacheMismatch(
                f"The cache at {self.cache.root} holds class images only.", hint="Run precompute with data.dir set."
            )
        self.val_items = self._hold_out()
        # a subset's num_repeats: its items that many times in each epoch's order (sd-scripts' repeats), each copy
        # drawing its own caption variant; the order stays a function of (seed, epoch, position)
        self.items = [it if r == 0 else replace(it, draw=r) for it in self.items for r in range(max(1, it.repeats))]
        self.caption_aug = CaptionAugment.from_config(cfg.data)
        # data.subsets' own caption options; kohya's folders and data.dir read whole use the data section's
        d = cfg.data
        self.subset_augs = {
            d.subset_name(i): CaptionAugment.from_config(d.subset_data(i)) for i in range(len(d.subsets))
        }
        # flip_aug per subset (as the caption options): only where this config asks for it, whatever the cache holds
        self.flips = {d.subset_name(i): d.subset_data(i).flip_aug for i in range(len(d.subsets))}
        self.masked = masks_wanted(cfg.data) is not None  # masked loss: the cache's masks are read
        self.live_stages: list[str] = []
        self.encode_live: LiveEncoder | None = None  # set by the trainer once the trained encoders are built

    # ---------------------------------------------------------------- which items
    def _hold_out(self) -> list[IndexItem]:
        """``validation.loss_items`` items taken out of training for the validation loss: drawn with
        ``validation.seed`` from the items in content order, so every trial of a sweep over one cache
        holds out the same ones whatever its training seed."""
        n = self.cfg.validation.loss_items
        if not n:
            return []
        if n >= len(self.items):
            raise ConfigError(
                f"validation.loss_items is {n}, but the cache has {len(self.items)} training items.",
                hint="Hold out fewer items, so that some are left to train on.",
            )
        order = sorted(range(len(self.items)), key=lambda i: self.items[i].latent)
        pick = set(random.Random(f"difftrain-val:{self.cfg.validation.seed}").sample(order, n))
        held = [it for i, it in enumerate(self.items) if i in pick]
        self.items = [it for i, it in enumerate(self.items) if i not in pick]
        return held

    def bucket_keys(self) -> list[tuple[int, int, int]]:
        """A batch never mixes sizes, nor (video) frame counts."""
        return [it.bucket_key for it in self.items]

    def start(self, global_batch: int) -> BucketBatchSampler:
        """The epochs' batches of ``global_batch`` items (batch_size per process, as the diffusers scripts and
        sd-scripts count it), within buckets."""
        self.global_batch = global_batch
        self.sampler = BucketBatchSampler(self.bucket_keys(), global_batch, self.cfg.train.seed)
        return self.sampler

    def epoch_batches(self, pos: Position) -> list[list[int]]:
        """The batches (item indices) of ``pos.epoch``: the sampler's, or the re-cut rest of a resumed epoch."""
        if pos.plan is not None and pos.plan[0] == pos.epoch:
            return pos.plan[1]
        pos.plan = None
        return self.sampler.epoch(pos.epoch)

    def resume_epoch(self, pos: Position, old_global: int, global_batch: int, plan: list[list[int]] | None) -> None:
        """A checkpoint's epoch continued: with another process count (or batch size) the rest of its items are
        re-cut to the new global batch; a checkpoint of a re-cut epoch stored its batches (``plan``)."""
        if old_global == global_batch and plan is None:
            return
        keys = self.bucket_keys()
        old = plan if plan is not None else BucketBatchSampler(keys, old_global, self.cfg.train.seed).epoch(pos.epoch)
        pos.plan = (pos.epoch, recut(old[pos.batch_pos :], keys, global_batch))
        pos.batch_pos = 0
        info(
            f"the global batch changed from {old_global} to {global_batch}: the rest of epoch {pos.epoch} "
            f"({sum(map(len, pos.plan[1]))} items) is re-cut into {len(pos.plan[1])} batches"
        )

    def prior_batch(self, n: int, epoch: int, batch_pos: int) -> list[IndexItem]:
        """n class items for the instance batch at a position: a function of (seed, epoch, batch), so a resumed
        run draws the same ones. One bucket per batch (the instance batch's when it has one)."""
        rng = random.Random(f"difftrain-prior:{self.cfg.train.seed}:{epoch}:{batch_pos}")
        buckets = sorted({it.bucket_key for it in self.prior_items})
        bucket = rng.choice(buckets)
        # a regularisation folder's repeats weight its images in the draw, as they weight sd-scripts' epoch
        pool = [it for it in self.prior_items if it.bucket_key == bucket for _ in range(max(1, it.repeats))]
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    # ---------------------------------------------------------------- tensors
    def batch(self, items: list[IndexItem], epoch: int = 0, augment: bool = False) -> dict[str, torch.Tensor]:
        """The tensors of a micro-batch. ``augment``: the captions as caption augmentation draws them in ``epoch``
        (the training batches), else as written (validation, prior images)."""
        fam, seed = self.family, self.cfg.train.seed
        augs = [self.subset_augs.get(it.subset, self.caption_aug) for it in items]
        if augment:  # flip_aug: the mirrored latent (and mask) in place of the item's own, drawn per epoch
            items = [
                replace(it, latent=it.flipped or it.latent, mask=it.flipped_mask)
                if self.flips.get(it.subset, self.cfg.data.flip_aug) and flip_drawn(it, seed, epoch)
                else it
                for it in items
            ]
        lat_entries = [self.cache.get(it.latent) for it in items]
        rows = [fam.conditioning(it, le) for it, le in zip(items, lat_entries)]
        to, stack = self.to_device, self.stack_to_device
        batch = {"latents": stack([le["latents"] for le in lat_entries])}
        batch.update({k: stack([r[k] for r in rows]) for k in rows[0]})
        mask = self.masks(items)
        if mask is not None:  # masked loss: read by the objective, never by the denoiser
            batch["loss_mask"] = to(mask)
        texts = [
            pick_text(it, aug, seed, epoch, self.index.empty_text) if augment else it.texts
            for it, aug in zip(items, augs)
        ]
        stages: dict[str, dict[str, Any]] = {}
        for stage in fam.enabled_stages(self.cfg.text_encoders):
            if stage in self.live_stages:
                assert self.encode_live is not None  # set with live_stages
                captions = [
                    live_caption(it.caption, aug, seed, epoch, it.draw_key) if augment else it.caption
                    for it, aug in zip(items, augs)
                ]
                stages[stage] = self.encode_live(stage, captions)
            else:
                entries = [self.cache.get(tx[stage]) for tx in texts]
                stages[stage] = {k: to(v) for k, v in fam.collate_text(stage, entries, pin=self.pins).items()}
        batch.update(fam.combine_texts(stages, self.cfg.text_encoders))
        return batch

    def masks(self, items: list[IndexItem]) -> torch.Tensor | None:
        """The items' loss masks at latent resolution, ``[B, 1, (f,) h, w]``, when the config trains with masks and
        one of the items has one (an item without a mask: ones, learned everywhere); None otherwise."""
        if not self.masked or not any(it.mask for it in items):
            return None
        found = [self.cache.get(it.mask)["mask"].float() if it.mask else None for it in items]
        # one mask for all of a clip's frames ([1, 1, h, w]) beside a mask per frame ([1, f, h, w]): broadcast
        shape = torch.broadcast_shapes(*(m.shape for m in found if m is not None))
        return torch.stack([(m if m is not None else torch.ones(())).expand(shape) for m in found])

    @property
    def pins(self) -> bool:
        """Whether batches are copied to the GPU from pinned host memory (a CUDA GPU, speed.pin_memory)."""
        return self.device.type == "cuda" and self.cfg.speed.pin_memory

    def stack_to_device(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """``torch.stack(xs)`` on the training device; copied from pinned memory, the host stacks straight into it
        (families/base.py host_stack: one host copy where a stack and then pin_memory() make two; the families'
        collate_text do the same for the caption states). What the host spends feeding a batch is time the GPU
        waits whenever a step ends in a sync (FLUX.2 [klein] 4B: 28 ms stacking and pinning in a 250 ms step,
        H200, 2026-11-28)."""
        return self.to_device(host_stack(xs, self.pins))

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A host tensor onto the training device. From pageable memory a copy waits for the GPU to finish its
        queue; from pinned memory it is queued behind it (speed.pin_memory)."""
        if self.pins and x.device.type == "cpu":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    @staticmethod
    def finite(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Whether a batch's cached tensors hold only finite numbers, as a device flag (read at the next flush)."""
        floats = [v for v in batch.values() if v.is_floating_point()]
        return torch.stack([torch.isfinite(v).all() for v in floats]).all()


@dataclass
class Accumulation:
    """The micro-batches of one optimizer step so far (device tensors, read at the next flush)."""

    loss: Any = 0.0
    prior: Any = 0.0
    micro: int = 0
    inputs_finite: torch.Tensor | None = None
