"""Masked loss's masks (data/masks.py): found by name, read as sd-scripts reads them, fitted to the bucket as the
image is, area-averaged to the latent; and their cache keys."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.config.schema import DataConfig
from difftrain.data.buckets import fit_to_bucket
from difftrain.data.keys import latent_key, mask_key
from difftrain.data.masks import (
    MaskSource,
    MaskSpec,
    alpha_present,
    check_mask_size,
    fit_mask,
    masks_wanted,
    read_mask,
    same_aspect,
    to_latent,
)
from difftrain.errors import DataError


def _grey(path, size=(40, 30), value=None, mode="L"):
    w, h = size
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (h, w), dtype=np.uint8) if value is None else np.full((h, w), value, np.uint8)
    Image.fromarray(a, "L").convert(mode).save(path)
    return path


def test_the_spec_from_the_data_config_and_what_the_index_records(tmp_path):
    assert not MaskSpec.from_config(DataConfig()).enabled and masks_wanted(DataConfig()) is None
    assert masks_wanted(DataConfig(alpha_mask=True)) == {"source": "alpha"}
    d = DataConfig(mask_dir=tmp_path, mask_suffix="-m")
    assert masks_wanted(d) == {"source": "files", "dir": str(tmp_path), "suffix": "-m"}
    with pytest.raises(ValueError, match="keep one"):
        DataConfig(alpha_mask=True, mask_dir=tmp_path)


def test_masks_are_found_by_the_images_name_sub_folder_and_suffix(tmp_path):
    images, masks = tmp_path / "images", tmp_path / "masks"
    (images / "sub").mkdir(parents=True)
    (masks / "sub").mkdir(parents=True)
    img = _grey(images / "sub" / "a.jpg")
    _grey(masks / "sub" / "a.PNG")
    spec = MaskSpec(folder=masks)
    assert spec.find("sub/a", img) == MaskSource("file", masks / "sub" / "a.PNG")
    assert spec.find("a", img) is None  # the sub-folder is part of the name
    # OneTrainer: photo-masklabel.png beside photo.jpg
    beside = MaskSpec(suffix="-masklabel")
    _grey(images / "sub" / "a-masklabel.png")
    assert beside.find("sub/a", img) == MaskSource("file", images / "sub" / "a-masklabel.png")
    assert beside.is_mask_file(images / "sub" / "a-masklabel.png") and not beside.is_mask_file(img)
    assert MaskSpec(alpha=True).find("sub/a", img) == MaskSource("alpha", img)


def test_a_mask_link_leading_outside_its_folder_is_refused(tmp_path):
    masks, elsewhere = tmp_path / "masks", tmp_path / "elsewhere"
    masks.mkdir()
    elsewhere.mkdir()
    (masks / "a.png").symlink_to(_grey(elsewhere / "secret.png"))
    with pytest.raises(DataError, match="outside"):
        MaskSpec(folder=masks).find("a", tmp_path / "a.png", root=tmp_path)


def test_masks_are_read_as_sd_scripts_reads_them(tmp_path):
    grey, colour = _grey(tmp_path / "g.png"), tmp_path / "c.png"
    rgb = np.zeros((30, 40, 3), np.uint8)
    rgb[..., 0], rgb[..., 1] = 200, 50
    Image.fromarray(rgb).save(colour)
    got, in_colour = read_mask(grey, "file")
    assert got is not None and not in_colour and np.array_equal(np.asarray(got), np.asarray(Image.open(grey)))
    got, in_colour = read_mask(colour, "file")
    assert got is not None and in_colour and np.asarray(got).max() == 200  # the red channel
    # a mask file's own alpha is not read (sd-scripts converts it to RGB): its colour is
    rgba = Image.new("RGBA", (40, 30), (255, 255, 255, 0))
    rgba.save(tmp_path / "rgba.png")
    got, _ = read_mask(tmp_path / "rgba.png", "file")
    assert got is not None and np.asarray(got).min() == 255
    # an image's alpha channel, and none on an image without one (learned everywhere)
    assert alpha_present(tmp_path / "rgba.png") and not alpha_present(grey)
    got, _ = read_mask(tmp_path / "rgba.png", "alpha")
    assert got is not None and np.asarray(got).max() == 0
    assert read_mask(grey, "alpha") == (None, False)
    # 16-bit greyscale is scaled to 8 bits, as the images are
    Image.fromarray(np.full((30, 40), 65535, np.uint16)).save(tmp_path / "16.png")
    got, _ = read_mask(tmp_path / "16.png", "file")
    assert got is not None and np.asarray(got).min() == 255
    (tmp_path / "bad.png").write_bytes(b"\x89PNG nothing")
    with pytest.raises(DataError, match="cannot read the mask"):
        read_mask(tmp_path / "bad.png", "file")


def test_a_mask_of_another_shape_is_an_error_naming_both_files(tmp_path):
    assert same_aspect((1000, 750), (500, 375)) and same_aspect((1000, 750), (333, 250))
    assert not same_aspect((1000, 750), (500, 400))
    half = _grey(tmp_path / "half.png", (20, 15))
    check_mask_size(MaskSource("file", half), tmp_path / "img.png", (40, 30))  # resized: no error
    tall = _grey(tmp_path / "tall.png", (30, 40))
    with pytest.raises(DataError, match=r"tall\.png is 30x40, its image .*img\.png is 40x30"):
        check_mask_size(MaskSource("file", tall), tmp_path / "img.png", (40, 30))


@pytest.mark.parametrize("random_crop", [False, True])
def test_a_mask_is_fitted_with_its_images_resize_and_crop(tmp_path, random_crop):
    """The alpha channel through fit_mask with the image's crop offsets equals the image's own fit_to_bucket (same
    filter, same crop): a mask lies on its image pixel for pixel."""
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (70, 130, 4), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA")
    bucket = (64, 48)
    fitted, crop = fit_to_bucket(image, bucket, rng=random.Random(7) if random_crop else None)
    mask = fit_mask(image.getchannel("A"), image.size, bucket, crop)
    assert mask.shape == (48, 64)
    want = torch.from_numpy(np.asarray(fitted.getchannel("A"), dtype=np.float32) / 255)
    torch.testing.assert_close(mask, want)
    # a mask drawn at half size is resized to the image first, then fitted the same way
    half = image.getchannel("A").resize((65, 35))
    assert fit_mask(half, image.size, bucket, crop).shape == (48, 64)


def test_the_mask_is_area_averaged_to_the_latent():
    px = torch.rand(16, 24)
    lat = to_latent(px, (4, 2, 3))
    assert lat.shape == (1, 2, 3)
    torch.testing.assert_close(lat[0, 1, 2], px[8:16, 16:24].mean())
    # a clip: latent frame 0 is frame 0, each further one the mean of the next 4 frames (4k + 1 frames)
    frames = torch.rand(9, 16, 24)
    lat = to_latent(frames, (4, 3, 2, 3))
    assert lat.shape == (1, 3, 2, 3)
    torch.testing.assert_close(lat[0, 0, 0, 0], frames[0, :8, :8].mean())
    torch.testing.assert_close(lat[0, 2, 1, 2], frames[5:9, 8:16, 16:24].mean())
    assert to_latent(px, (4, 3, 2, 3)).shape == (1, 1, 2, 3)  # one mask for all frames: broadcasts


def test_a_masks_key_is_its_latents_and_its_content():
    lat = latent_key("sdxl", "vae", "fp32", (64, 64), "center", "img")
    assert mask_key(lat, "file", "m1") != mask_key(lat, "file", "m2")  # a changed mask: a new entry
    other = latent_key("sdxl", "vae", "fp32", (64, 64), "random", "img")
    assert mask_key(lat, "file", "m1") != mask_key(other, "file", "m1")  # another crop: another entry
    assert mask_key(lat, "alpha", "") != mask_key(lat, "file", "")


def test_a_clips_mask_video_or_folder_must_have_its_frame_count(tmp_path):
    pytest.importorskip("av")
    from conftest import grey_video

    masks = tmp_path / "masks"
    (masks / "clip").mkdir(parents=True)
    for f in range(3):
        _grey(masks / "clip" / f"{f}.png", (64, 48))
    folder = MaskSpec(folder=masks).find("clip", tmp_path / "clip.mp4", video=True)
    assert folder == MaskSource("frames", masks / "clip")
    check_mask_size(folder, tmp_path / "clip.mp4", (64, 48), frames=3)
    with pytest.raises(DataError, match=r"holds 3 images, its clip .*clip\.mp4 has 9 frames"):
        check_mask_size(folder, tmp_path / "clip.mp4", (64, 48), frames=9)
    grey_video(masks / "other.mp4", [np.zeros(64)] * 5)
    video = MaskSpec(folder=masks).find("other", tmp_path / "other.mp4", video=True)
    assert video == MaskSource("video", masks / "other.mp4")
    check_mask_size(video, tmp_path / "other.mp4", (128, 96), frames=5)  # twice the size, the same shape
    with pytest.raises(DataError, match=r"mask video .*other\.mp4 has 5 frames, its clip .*other\.mp4 has 9"):
        check_mask_size(video, tmp_path / "other.mp4", (64, 48), frames=9)
    with pytest.raises(DataError, match=r"is 64x48, its clip .* is 48x64: another aspect ratio"):
        check_mask_size(video, tmp_path / "other.mp4", (48, 64), frames=5)
