"""The masks phase (masked loss): each planned mask the cache lacks, fitted to its latent and cached beside it.

Runs after the latents: a mask is placed by its latent entry (the crop offsets the image was cut at, the latent's
size), so no encoder is loaded, and a changed mask is made again without its latent (its key holds the mask's
content, :func:`difftrain.data.keys.mask_key`). What it does to a mask is :mod:`difftrain.data.masks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..console import progress
from ..data.cache import DataCache
from ..data.masks import fit_mask, read_mask, read_mask_video, to_latent
from ..errors import DataError
from .plan import PlanItem, Skipped

#: masks are weights in [0, 1]: half precision keeps 1/255 steps (2^-11 relative) at half the bytes
MASK_DTYPE = torch.float16


@dataclass
class MasksDone:
    """What this process's share of the masks gave: the items whose mask could not be read (and why), and the
    colour masks whose red channel was taken."""

    unreadable: set[str] = field(default_factory=set)  # mask keys
    skipped: Skipped = field(default_factory=list)
    colour: list[str] = field(default_factory=list)


def encode_masks(cache: DataCache, items: list[PlanItem], mine: set[str]) -> MasksDone:
    """Make the mask entries of ``mine`` (keys of ``items``' masks, flip_aug's mirrored ones included), each once;
    the cache is flushed after."""
    done = MasksDone()
    todo: dict[str, tuple[PlanItem, bool]] = {}
    for p in items:
        for key, mirrored in ((p.mask, False), (p.flipped_mask, True)):
            if key is not None and key in mine:
                todo.setdefault(key, (p, mirrored))
    if not todo:
        return done
    with progress() as bar:
        task = bar.add_task("fitting masks", total=len(todo))
        for key, (p, mirrored) in todo.items():
            try:
                mask = mask_entry(cache, p, done.colour)
                # flip_aug: the mirrored latent's mask is the mask mirrored (its crop is the unflipped one's)
                cache.put(key, {"mask": mask.flip(-1) if mirrored else mask})
            except DataError as e:
                done.unreadable.add(key)
                done.skipped.append((str(p.record.path), e.message))
            bar.advance(task)
    cache.flush()
    return done


def mask_entry(cache: DataCache, p: PlanItem, colour: list[str] | None = None) -> torch.Tensor:
    """``p``'s mask at its latent's resolution: ``[1, h, w]`` (an image, or one mask for all of a clip's frames:
    ``[1, 1, h, w]``) or ``[1, f, h, w]`` (a mask per frame), broadcasting over the latent's channels."""
    source = p.mask_source
    assert source is not None and p.mask is not None  # only items with a mask come here
    latent = cache.get(p.latent)
    shape = tuple(latent["latents"].shape)
    top, left = (int(v) for v in latent["crop"].tolist())
    files = source.files()
    if source.kind == "frames":
        files = [files[i] for i in (p.indices or range(len(files)))]
    size = (p.record.width, p.record.height)
    frames = []
    if source.kind == "video":
        n = getattr(p.record, "frames", 1)
        for image in read_mask_video(source.path, list(p.indices or range(n)), n):
            frames.append(fit_mask(image, size, p.bucket, (top, left)))
        return to_latent(torch.stack(frames), shape).to(MASK_DTYPE)
    for f in files:
        mask, in_colour = read_mask(f, source.kind)
        if mask is None:  # alpha gone since the plan read the header: learned everywhere
            mask = _opaque(size)
        if in_colour and colour is not None and str(f) not in colour:
            colour.append(str(f))
        frames.append(fit_mask(mask, size, p.bucket, (top, left)))
    pixels = frames[0] if len(frames) == 1 else torch.stack(frames)
    return to_latent(pixels, shape).to(MASK_DTYPE)


def _opaque(size: tuple[int, int]):
    from PIL import Image

    return Image.new("L", size, 255)
