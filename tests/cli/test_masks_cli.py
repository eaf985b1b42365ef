"""Masked loss's bad input through the console script: a mask of another shape, a mask folder matching nothing,
two mask sources at once; and what the plan says of images without a mask and of mask files in the data folder."""

from __future__ import annotations

import subprocess

import numpy as np
from PIL import Image

from conftest import CliResult, clean_failure, console_script, set_args, tiny_sets


def _precompute(*args: str) -> CliResult:
    r = subprocess.run(
        [console_script(), "precompute", "--recipe", "tiny-sdxl-lora", "--plan-only", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return CliResult(r.returncode, r.stdout, r.stderr)


def _mask(path, size, value=255):
    w, h = size
    Image.fromarray(np.full((h, w), value, np.uint8)).save(path)


def test_the_plan_lists_images_without_a_mask_and_leaves_mask_files_out(tiny_model, dataset, tmp_path):
    images = sorted(dataset.glob("*.png"))
    masks = dataset / "masks"  # inside the data folder: its files are masks, not training images
    masks.mkdir()
    for p in images[:2]:
        _mask(masks / p.name, Image.open(p).size)
    _mask(dataset / "extra-masklabel.png", (64, 64))  # a OneTrainer mask, with masks from mask_dir
    r = _precompute(*set_args(tiny_sets(tiny_model, dataset, tmp_path, **{"data.mask_dir": masks})))
    assert r.code == 0, r
    text = " ".join(r.err.split())
    assert f"bucket plan ({len(images)} usable" in text
    assert f"masks: mask file 2, none {len(images) - 2} (learned everywhere)" in text
    assert f"no mask for {images[2]}: no mask file: learned everywhere" in text
    assert f"dropped {masks / images[0].name}: a mask (in data.mask_dir), not a training image" in text
    assert "extra-masklabel.png: a OneTrainer mask; to train with it, set data.mask_suffix: -masklabel" in text


def test_onetrainer_masks_beside_the_images(tiny_model, dataset, tmp_path):
    images = sorted(dataset.glob("*.png"))
    for p in images:
        _mask(p.with_name(p.stem + "-masklabel.png"), Image.open(p).size)
    r = _precompute(*set_args(tiny_sets(tiny_model, dataset, tmp_path, **{"data.mask_suffix": "-masklabel"})))
    assert r.code == 0, r
    text = " ".join(r.err.split())
    assert f"bucket plan ({len(images)} usable" in text and f"masks: mask file {len(images)}" in text


def test_alpha_mask_on_images_without_alpha_learns_them_everywhere(tiny_model, dataset, tmp_path):
    r = _precompute(*set_args(tiny_sets(tiny_model, dataset, tmp_path, **{"data.alpha_mask": "true"})))
    assert r.code == 0, r
    text = " ".join(r.err.split())
    assert "masks: none" in text and "no alpha channel: learned everywhere" in text


def test_a_mask_of_another_aspect_ratio_is_an_error_naming_both_files(tiny_model, dataset, tmp_path):
    image = sorted(dataset.glob("*.png"))[1]
    w, h = Image.open(image).size
    masks = tmp_path / "masks"
    masks.mkdir()
    _mask(masks / image.name, (h, w))  # turned sideways
    r = _precompute(*set_args(tiny_sets(tiny_model, dataset, tmp_path, **{"data.mask_dir": masks})))
    clean_failure(
        r, 1, f"the mask {masks / image.name} is {h}x{w}, its image {image} is {w}x{h}", "another aspect ratio"
    )


def test_a_mask_folder_matching_no_image_is_an_error(tiny_model, dataset, tmp_path):
    masks = tmp_path / "masks"
    masks.mkdir()
    _mask(masks / "someone_else.png", (64, 64))
    r = _precompute(*set_args(tiny_sets(tiny_model, dataset, tmp_path, **{"data.mask_dir": masks})))
    clean_failure(r, 1, f"no image has a mask file in {masks}", "check data.mask_dir and data.mask_suffix")


def test_two_mask_sources_at_once_are_a_config_error(tiny_model, dataset, tmp_path):
    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"data.alpha_mask": "true", "data.mask_dir": tmp_path})
    r = _precompute(*set_args(sets))
    assert r.code == 2, r
    assert "data.alpha_mask and data.mask_dir / mask_suffix both name where masks come from" in " ".join(r.err.split())
    assert "Traceback" not in r.err


def test_a_kohya_layout_finds_masks_mirrored_or_in_one_flat_folder(tiny_model, dataset, tmp_path):
    images = sorted(dataset.glob("*.png"))
    data, masks = tmp_path / "img", tmp_path / "masks"
    (data / "10_sks dog").mkdir(parents=True)
    (data / "1_dog").mkdir()
    (masks / "1_dog").mkdir(parents=True)
    for p in images[:2]:
        (data / "10_sks dog" / p.name).write_bytes(p.read_bytes())
        _mask(masks / p.name, Image.open(p).size)  # flat: by the name alone
    for p in images[2:4]:
        (data / "1_dog" / p.name).write_bytes(p.read_bytes())
    _mask(masks / "1_dog" / images[2].name, Image.open(images[2]).size)  # mirrored
    r = _precompute(*set_args(tiny_sets(tiny_model, data, tmp_path, **{"data.mask_dir": masks})))
    assert r.code == 0, r
    text = " ".join(r.err.split())
    assert "masks: mask file 3, none 1 (learned everywhere)" in text, r
    assert f"no mask for {data / '1_dog' / images[3].name}" in text
