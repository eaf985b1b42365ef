"""Decoding and resizing in worker processes while the encoder runs, a batch per bucket.

torch's DataLoader does the work (worker processes, a bounded prefetch queue, pinned memory): the main
process only moves finished batches to the GPU and runs the VAE. Images travel as uint8 (a quarter of
float32's bytes through the workers' shared memory and the host-to-device copy) and become floats in
[-1, 1] on the device. Only ``prefetch`` batches per worker are ever decoded ahead, so host RAM does
not grow with the dataset. A file that cannot be decoded comes back as an error in its batch, never as
an exception that would stop the others.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..data.buckets import fit_to_bucket
from ..data.sources import load_rgb
from ..errors import DataError


def default_workers() -> int:
    """Half the CPU cores (the other half feeds the GPU and the writer), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class DecodeSet(Dataset):
    """Item ``i`` of ``jobs`` decoded and fitted to its bucket: ``{"key", "pixels", "crop"}`` or
    ``{"key", "path", "error"}``. A job is ``(latent key, record, bucket, frame indices, image sha256)``, and
    ``mirrored`` after them for flip_aug's second entry: the fitted image (every frame of a clip) flipped left-right
    after its crop, which stays the unflipped one's (sd-scripts keeps SDXL's crop conditioning as it was too)."""

    def __init__(self, jobs: list[tuple], video: bool, random_crop: bool):
        self.jobs, self.video, self.random_crop = jobs, video, random_crop

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, i: int) -> dict:
        key, record, bucket, indices, sha, *rest = self.jobs[i]
        mirrored = bool(rest and rest[0])
        rng = random.Random(sha) if self.random_crop else None  # the crop depends on the content only
        try:
            if self.video:
                from ..data.video import load_clip

                pixels, crop = load_clip(record, indices, bucket, rng=rng)
            else:
                fitted, crop = fit_to_bucket(load_rgb(record.path), bucket, rng=rng)
                pixels = torch.from_numpy(np.asarray(fitted, dtype=np.uint8).copy()).permute(2, 0, 1)
        except DataError as e:
            return {"key": key, "path": str(record.path), "error": e.message}
        if mirrored:  # [C, H, W] or a clip's [C, F, H, W]: the width is the last axis
            pixels = pixels.flip(-1)
        out = {"key": key, "pixels": pixels, "crop": crop}
        refs = getattr(record, "references", ())
        if refs:  # edit training: each reference fitted to the target's bucket, cropped as the target
            fitted_refs = []
            for ref in refs:
                try:
                    img, _ = fit_to_bucket(load_rgb(ref), bucket, rng=random.Random(sha) if self.random_crop else None)
                except DataError as e:
                    return {"key": key, "path": str(record.path), "error": f"its reference image {ref}: {e.message}"}
                fitted_refs.append(torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1))
            out["references"] = torch.stack(fitted_refs)
        return out


def collate(samples: list[dict]) -> dict:
    """One batch: the decoded samples stacked (in the worker, so one tensor crosses the process boundary),
    and the failures listed."""
    good = [s for s in samples if "error" not in s]
    return {
        "keys": [s["key"] for s in good],
        "pixels": torch.stack([s["pixels"] for s in good]) if good else None,
        "crops": [s["crop"] for s in good],
        "errors": [(s["key"], s["path"], s["error"]) for s in samples if "error" in s],
        # edit training: [B, N, 3, H, W] reference images
        "references": torch.stack([s["references"] for s in good]) if good and "references" in good[0] else None,
    }


def shape_batches(shapes: list, batch_size: int) -> list[list[int]]:
    """Consecutive indices of equal shape cut into batches of at most ``batch_size`` (``shapes`` sorted)."""
    out: list[list[int]] = []
    for i, shape in enumerate(shapes):
        if out and shapes[out[-1][0]] == shape and len(out[-1]) < batch_size:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def decoded_batches(
    jobs: list[tuple],
    shapes: list,
    batch_size: int,
    *,
    video: bool,
    random_crop: bool,
    workers: int,
    pin: bool,
    prefetch: int = 4,
) -> Iterator[dict]:
    """Batches of :func:`collate` in the order of ``jobs`` (sorted by ``shapes``), decoded by ``workers``
    processes (0: here), pinned for an asynchronous copy when ``pin``."""
    loader = DataLoader(
        DecodeSet(jobs, video, random_crop),
        batch_sampler=shape_batches(shapes, batch_size),
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin,
        prefetch_factor=prefetch if workers else None,
    )
    yield from loader


def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float in [-1, 1] (video clips already are float)."""
    if pixels.dtype == torch.uint8:
        return pixels.float() / 127.5 - 1.0
    return pixels
