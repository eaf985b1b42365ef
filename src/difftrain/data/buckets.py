"""Aspect-ratio buckets: which training size each image gets, and how it is fitted to it.

Bucket list (:func:`make_buckets`), following sd-scripts' ``make_bucket_resolutions``:

* ``max_area = resolution ** 2``; sides are multiples of ``step`` (default 64) within
  ``[min_side, max_side]``.
* For every width ``w`` that is a multiple of ``step`` with ``min_side <= w <= max_side``, the
  height is ``h = min(floor(max_side / step) * step, floor(max_area / w / step) * step)``, i.e. the
  largest multiple of ``step`` with ``w * h <= max_area`` (capped at ``max_side``); the pair is kept
  when ``h >= min_side``, in both orientations ``(w, h)`` and ``(h, w)``.
* The square ``(s, s)`` with ``s = floor(resolution / step) * step`` is added too.
* The result is de-duplicated and sorted by ``(width, height)``. Every bucket therefore has
  ``w * h <= max_area``, ``w % step == h % step == 0`` and ``min_side <= w, h <= max_side``.
  (sd-scripts adds the square even outside ``[min_side, max_side]``; we require
  ``min_side <= resolution <= max_side`` instead, so that case cannot arise.)

Choosing a bucket (:func:`choose_bucket`):

* Default mode: an image whose exact size is a bucket uses it. Otherwise it goes to the bucket
  whose aspect ratio is nearest its own, measured as ``|log(w_b / h_b) - log(w / h)|`` (so 2:1 and
  1:2 are equally far from 1:1; sd-scripts compares linear ratios, which favours landscape);
  ties go to the larger area. The image may be scaled up or down to reach the bucket.
* ``no_upscale`` (sd-scripts' ``bucket_no_upscale``): the predefined list is not used, and
  ``min_side``/``max_side`` do not apply. An image with ``w * h <= max_area`` gets the bucket
  ``(floor(w / step) * step, floor(h / step) * step)``. A larger image is scaled by
  ``sqrt(max_area / (w * h))`` (keeping its aspect ratio) and each side is then rounded down to a
  multiple of ``step`` (computed in exact integer arithmetic, so the area never exceeds
  ``max_area``). Either way the bucket is never larger than the image in either side, so the
  resize factor of :func:`fit_to_bucket` is never above 1. An image thinner than one ``step``
  (after that scaling) has no bucket: ``ValueError``.

Fitting (:func:`fit_to_bucket`): the image is resized by the smallest factor that makes it cover
the bucket, ``scale = max(w_b / w, h_b / h)`` (the side that fixes the scale becomes exactly the
bucket side; the other is rounded to nearest and never below the bucket side), then cropped to the
bucket -- centred, or at a uniformly random offset when a ``random.Random`` is given. The crop's
``(top, left)`` in resized coordinates is returned, as SDXL's ``crops_coords_top_left``
conditioning expects.

Resampling: ``LANCZOS`` when shrinking (Pillow widens the kernel with the scale factor, so it
anti-aliases like an area filter while staying the sharpest of Pillow's filters); ``BICUBIC``
when enlarging, because Lanczos' extra lobes add visible ringing/halos around edges at upscale
factors, and the model would learn those artefacts. Same size: no resampling at all.
"""

from __future__ import annotations

import math
import random

from PIL import Image

Bucket = tuple[int, int]
"""(width, height) in pixels."""


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _floor_to(value: int, step: int) -> int:
    return value - value % step


def validate_bucket_args(resolution: int, step: int, min_side: int, max_side: int) -> None:
    """Raise ``ValueError`` with a clear message for arguments that give no sensible bucket list."""
    _check_positive(resolution=resolution, step=step, min_side=min_side, max_side=max_side)
    if min_side > max_side:
        raise ValueError(f"min_side ({min_side}) is larger than max_side ({max_side})")
    if resolution < step:
        raise ValueError(f"resolution ({resolution}) is smaller than the bucket step ({step})")
    if not min_side <= resolution <= max_side:
        raise ValueError(
            f"resolution ({resolution}) must lie between min_side ({min_side}) and max_side ({max_side}); "
            "otherwise the square bucket does not fit"
        )
    smallest = -(-min_side // step) * step  # smallest multiple of step >= min_side
    if smallest > max_side:
        raise ValueError(f"no multiple of step {step} lies between min_side ({min_side}) and max_side ({max_side})")
    if smallest > resolution:
        raise ValueError(
            f"min_side ({min_side}) rounded up to the step ({smallest}) exceeds resolution ({resolution}): "
            "no bucket fits the area"
        )


def make_buckets(resolution: int, step: int = 64, min_side: int = 256, max_side: int = 2048) -> list[Bucket]:
    """All buckets ``(width, height)`` for ``max_area = resolution ** 2``, sorted (see module docstring)."""
    validate_bucket_args(resolution, step, min_side, max_side)
    max_area = resolution * resolution
    top = _floor_to(max_side, step)
    buckets: set[Bucket] = set()

    square = _floor_to(resolution, step)
    if square >= min_side:
        buckets.add((square, square))

    width = -(-min_side // step) * step  # smallest multiple of step >= min_side
    while width <= top:
        height = min(top, _floor_to(max_area // width, step))
        if height >= min_side:
            buckets.add((width, height))
            buckets.add((height, width))
        width += step
    return sorted(buckets)  # never empty: validate_bucket_args guarantees the square fits


def _aspect_error(bucket: Bucket, log_aspect: float) -> float:
    return abs(math.log(bucket[0] / bucket[1]) - log_aspect)


def nearest_bucket(width: int, height: int, buckets: list[Bucket]) -> Bucket:
    """The bucket with the nearest log aspect ratio (exact size first; ties -> larger area)."""
    if not buckets:
        raise ValueError("the bucket list is empty")
    if (width, height) in buckets:
        return (width, height)
    log_aspect = math.log(width / height)
    # round() makes mirror-image errors that differ only in the last float bit count as ties
    return min(buckets, key=lambda b: (round(_aspect_error(b, log_aspect), 12), -b[0] * b[1], b))


def no_upscale_bucket(width: int, height: int, *, resolution: int, step: int) -> Bucket:
    """sd-scripts' ``bucket_no_upscale`` bucket: the image's own size, shrunk to the max area if
    needed, each side rounded down to ``step``. Never larger than the image in either side."""
    _check_positive(width=width, height=height, resolution=resolution, step=step)
    max_area = resolution * resolution
    if width * height <= max_area:
        bw, bh = _floor_to(width, step), _floor_to(height, step)
    else:
        # side * sqrt(max_area / (w*h)) == sqrt(side^2 * max_area / (w*h)); isqrt(floor(x)) == floor(sqrt(x))
        bw = _floor_to(math.isqrt(width * max_area // height), step)
        bh = _floor_to(math.isqrt(height * max_area // width), step)
    if bw == 0 or bh == 0:
        raise ValueError(
            f"image {width}x{height} has a side under one bucket step ({step}px) after fitting the "
            f"{resolution}x{resolution} area, so it has no no-upscale bucket"
        )
    return bw, bh


def choose_bucket(
    width: int,
    height: int,
    buckets: list[Bucket],
    *,
    resolution: int,
    step: int,
    no_upscale: bool = False,
) -> Bucket:
    """The bucket for a ``width`` x ``height`` image (see module docstring for the rule).

    ``buckets`` (from :func:`make_buckets`) is used only when ``no_upscale`` is false.
    """
    _check_positive(width=width, height=height, resolution=resolution, step=step)
    if no_upscale:
        return no_upscale_bucket(width, height, resolution=resolution, step=step)
    return nearest_bucket(width, height, buckets)


def resize_to_cover(width: int, height: int, bucket: Bucket) -> tuple[int, int]:
    """Size ``(w, h)`` of the image after the smallest uniform resize that covers ``bucket``."""
    _check_positive(width=width, height=height, bucket_width=bucket[0], bucket_height=bucket[1])
    bw, bh = bucket
    if width * bh >= height * bw:  # image at least as wide as the bucket: match heights
        return max(bw, (2 * width * bh + height) // (2 * height)), bh
    return bw, max(bh, (2 * height * bw + width) // (2 * width))


def _crop_offset(excess: int, rng: random.Random | None) -> int:
    return excess // 2 if rng is None else rng.randint(0, excess)


def fit_to_bucket(
    image: Image.Image, bucket: Bucket, rng: random.Random | None = None
) -> tuple[Image.Image, tuple[int, int]]:
    """Resize ``image`` to cover ``bucket`` and crop it to exactly the bucket size.

    Returns the ``bucket``-sized image and ``(crop_top, crop_left)`` in resized coordinates.
    The crop is centred, or uniformly random when ``rng`` is given.
    """
    new_w, new_h = resize_to_cover(image.width, image.height, bucket)
    if (new_w, new_h) != image.size:
        shrinking = new_w < image.width or new_h < image.height
        resample = Image.Resampling.LANCZOS if shrinking else Image.Resampling.BICUBIC
        image = image.resize((new_w, new_h), resample=resample)
    bw, bh = bucket
    top, left = _crop_offset(new_h - bh, rng), _crop_offset(new_w - bw, rng)
    if (bw, bh) != (new_w, new_h):
        image = image.crop((left, top, left + bw, top + bh))
    return image, (top, left)
