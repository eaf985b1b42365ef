"""Aspect-ratio buckets: the bucket list, bucket choice (incl. no-upscale) and fitting."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from difftrain.data.buckets import (
    choose_bucket,
    fit_to_bucket,
    make_buckets,
    nearest_bucket,
    no_upscale_bucket,
    resize_to_cover,
)

RES, STEP = 1024, 64
MAX_AREA = RES * RES


def _sd_scripts_reference(max_area: int, min_size: int, max_size: int, divisible: int) -> list[tuple[int, int]]:
    """sd-scripts' library/model_util.make_bucket_resolutions, restated for comparison."""
    resos = {(int(math.sqrt(max_area) // divisible) * divisible,) * 2}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


# ----------------------------------------------------------------- make_buckets
@pytest.mark.parametrize(
    ("resolution", "step", "min_side", "max_side"),
    [(1024, 64, 256, 2048), (512, 64, 256, 1024), (768, 64, 320, 1536), (1024, 32, 512, 2048), (1024, 64, 512, 1024)],
)
def test_matches_sd_scripts_make_bucket_resolutions(resolution, step, min_side, max_side):
    assert make_buckets(resolution, step, min_side, max_side) == _sd_scripts_reference(
        resolution * resolution, min_side, max_side, step
    )


@settings(max_examples=60, deadline=None, database=None)
@given(
    step=st.sampled_from([8, 16, 32, 64, 48]),
    resolution=st.integers(64, 2048),
    min_side=st.integers(8, 1024),
    extra=st.integers(0, 2048),
)
def test_every_bucket_respects_area_step_and_sides(step, resolution, min_side, extra):
    max_side = max(min_side, resolution) + extra
    smallest = -(-min_side // step) * step
    if not (step <= resolution and min_side <= resolution and smallest <= min(max_side, resolution)):
        with pytest.raises(ValueError):
            make_buckets(resolution, step, min_side, max_side)
        return
    buckets = make_buckets(resolution, step, min_side, max_side)
    assert buckets and buckets == sorted(set(buckets))
    max_area = resolution * resolution
    square = resolution - resolution % step

    def maximal(a: int, b: int) -> bool:  # b is the largest step multiple with a*b in bounds
        return b + step > max_side or a * (b + step) > max_area

    for w, h in buckets:
        assert w * h <= max_area
        assert w % step == 0 and h % step == 0
        assert min_side <= w <= max_side and min_side <= h <= max_side
        assert (h, w) in buckets  # both orientations
        assert maximal(w, h) or maximal(h, w) or w == h == square


def test_default_buckets_at_1024():
    buckets = make_buckets(RES)
    assert (1024, 1024) in buckets
    for b in [(1344, 768), (768, 1344), (1216, 832), (832, 1216), (1152, 896), (896, 1152), (2048, 512)]:
        assert b in buckets
    assert max(w * h for w, h in buckets) <= MAX_AREA


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1024, 0, 256, 2048), "step must be a positive integer"),
        ((1024, 64, 1024, 512), "min_side .* larger than max_side"),
        ((32, 64, 16, 2048), "smaller than the bucket step"),
        ((1024, 64, 256, 512), "between min_side"),
        ((256, 64, 512, 2048), "between min_side"),
        ((1024, 64.0, 256, 2048), "step must be a positive integer"),
        ((-5, 64, 256, 2048), "resolution must be a positive integer"),
        ((100, 64, 70, 120), "no multiple of step"),
        ((65, 8, 65, 72), "exceeds resolution"),
    ],
)
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        make_buckets(*args)


# ----------------------------------------------------------------- choose_bucket
@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((1024, 1024), (1024, 1024)),
        ((512, 512), (1024, 1024)),  # upscaled in the default mode
        # 1920x1080: aspect 1.778. Nearest buckets: (1344, 768) = 1.750 (|ln| 0.016),
        # (1280, 768) = 1.667 (0.065), (1408, 704) = 2.000 (0.118) -> (1344, 768), as sd-scripts.
        ((1920, 1080), (1344, 768)),
        ((1080, 1920), (768, 1344)),
        ((768, 1344), (768, 1344)),  # a bucket size itself
        ((1536, 2688), (768, 1344)),  # same ratio 4:7, larger
        # 800x1200 = 0.667: (832, 1216) = 0.684 (|ln| 0.026) beats (768, 1280) = 0.600 (0.105)
        ((800, 1200), (832, 1216)),
        ((4000, 3000), (1152, 896)),  # 1.333 -> 1.286 (0.036) beats (1216, 832) = 1.462 (0.092)
        ((10000, 100), (2048, 256)),  # extreme ratios go to the most extreme bucket
    ],
)
def test_known_aspect_ratios_map_to_known_buckets(size, expected):
    buckets = make_buckets(RES, STEP)
    assert choose_bucket(*size, buckets, resolution=RES, step=STEP) == expected


def test_ties_go_to_the_larger_area_and_exact_size_wins():
    buckets = [(512, 512), (1024, 1024), (640, 320)]
    assert nearest_bucket(700, 700, buckets) == (1024, 1024)
    assert nearest_bucket(512, 512, buckets) == (512, 512)  # exact size beats larger area
    with pytest.raises(ValueError, match="empty"):
        nearest_bucket(5, 5, [])


def test_choose_bucket_rejects_bad_sizes():
    with pytest.raises(ValueError, match="width"):
        choose_bucket(0, 10, make_buckets(RES), resolution=RES, step=STEP)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((1024, 1024), (1024, 1024)),
        ((800, 600), (768, 576)),  # small: own size rounded down, never enlarged
        ((100, 70), (64, 64)),
        # 4000x3000 > max area: x sqrt(1024^2 / 12e6) = 0.2956 -> 1182.4 x 886.8 -> (1152, 832)
        ((4000, 3000), (1152, 832)),
        ((2048, 2048), (1024, 1024)),
    ],
)
def test_no_upscale_examples(size, expected):
    assert choose_bucket(*size, make_buckets(RES), resolution=RES, step=STEP, no_upscale=True) == expected


def test_no_upscale_too_thin_image_has_no_bucket():
    with pytest.raises(ValueError, match="under one bucket step"):
        no_upscale_bucket(2000, 40, resolution=RES, step=STEP)
    with pytest.raises(ValueError, match="under one bucket step"):
        no_upscale_bucket(1_000_000, 100, resolution=RES, step=STEP)  # 100 * 0.1 < 64 after shrinking


@settings(max_examples=400, deadline=None, database=None)
@given(
    width=st.integers(64, 8000),
    height=st.integers(64, 8000),
    resolution=st.sampled_from([512, 768, 1024, 1536]),
    step=st.sampled_from([8, 32, 64]),
)
def test_no_upscale_never_enlarges(width, height, resolution, step):
    try:
        bucket = choose_bucket(width, height, [], resolution=resolution, step=step, no_upscale=True)
    except ValueError:
        # only an image with a side under one step after the area fit has no bucket
        scale = min(1.0, math.sqrt(resolution * resolution / (width * height)))
        assert min(width, height) * scale < step + 1e-6
        return
    bw, bh = bucket
    assert 0 < bw <= width and 0 < bh <= height
    assert bw % step == 0 and bh % step == 0
    assert bw * bh <= resolution * resolution
    if width * height <= resolution * resolution:
        assert bucket == (width - width % step, height - height % step)
    new_w, new_h = resize_to_cover(width, height, bucket)
    assert bw <= new_w <= width and bh <= new_h <= height  # resize factor <= 1


# ----------------------------------------------------------------- fitting
@settings(max_examples=300, deadline=None, database=None)
@given(
    width=st.integers(1, 5000),
    height=st.integers(1, 5000),
    bw=st.integers(1, 40).map(lambda k: k * 64),
    bh=st.integers(1, 40).map(lambda k: k * 64),
)
def test_resize_to_cover_covers_with_smallest_scale(width, height, bw, bh):
    new_w, new_h = resize_to_cover(width, height, (bw, bh))
    assert new_w >= bw and new_h >= bh
    assert new_w == bw or new_h == bh  # one side is fitted exactly: smallest covering scale
    scale = max(bw / width, bh / height)
    assert abs(new_w - width * scale) <= 1 and abs(new_h - height * scale) <= 1


def _stripes(size: tuple[int, int]) -> Image.Image:
    """Left half red, right half blue."""
    img = Image.new("RGB", size, (255, 0, 0))
    img.paste((0, 0, 255), (size[0] // 2, 0, size[0], size[1]))
    return img


def test_fit_to_bucket_1920x1080_center_crop():
    img = _stripes((1920, 1080))
    out, (top, left) = fit_to_bucket(img, (1344, 768))
    assert out.size == (1344, 768)
    # resized to 1365x768 (1920 * 768/1080 = 1365.3), 21 extra columns -> centred left offset 10
    assert (top, left) == (0, 10)
    assert out.getpixel((5, 384))[0] > 200 and out.getpixel((1338, 384))[2] > 200


def test_fit_to_bucket_portrait_and_upscale():
    out, (top, left) = fit_to_bucket(Image.new("RGB", (300, 500), "white"), (1024, 1024))
    assert out.size == (1024, 1024)
    # scale 1024/300: height 500 -> 1707, 683 rows extra -> top 341
    assert (top, left) == (341, 0)


def test_fit_to_bucket_same_size_is_untouched():
    img = _stripes((768, 1344))
    out, crop = fit_to_bucket(img, (768, 1344))
    assert crop == (0, 0) and out.tobytes() == img.tobytes()


def test_fit_to_bucket_random_crop_is_in_range_and_reproducible():
    img = Image.new("RGB", (2000, 1000), "gray")
    resized_w, resized_h = resize_to_cover(2000, 1000, (1024, 1024))
    assert (resized_w, resized_h) == (2048, 1024)
    seen = set()
    for seed in range(30):
        out, (top, left) = fit_to_bucket(img, (1024, 1024), rng=random.Random(seed))
        assert out.size == (1024, 1024)
        assert top == 0 and 0 <= left <= resized_w - 1024
        again = fit_to_bucket(img, (1024, 1024), rng=random.Random(seed))[1]
        assert again == (top, left)
        seen.add(left)
    assert len(seen) > 1


@settings(max_examples=40, deadline=None, database=None)
@given(width=st.integers(1, 400), height=st.integers(1, 400), seed=st.integers(0, 10))
def test_fit_to_bucket_output_size_exact(width, height, seed):
    buckets = make_buckets(256, 32, 64, 512)
    bucket = choose_bucket(width, height, buckets, resolution=256, step=32)
    img = Image.new("RGB", (width, height), (1, 2, 3))
    for rng in (None, random.Random(seed)):
        out, (top, left) = fit_to_bucket(img, bucket, rng=rng)
        assert out.size == bucket
        new_w, new_h = resize_to_cover(width, height, bucket)
        assert 0 <= top <= new_h - bucket[1] and 0 <= left <= new_w - bucket[0]
