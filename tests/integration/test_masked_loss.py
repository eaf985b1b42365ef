"""Masked loss end to end on the tiny SDXL (and a tiny video family): masks cached beside the latents at latent
resolution with the image's crop, a changed mask fitted again without its latent, training reading them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import grey_video, tiny_sets
from difftrain.config.load import resolve
from difftrain.data.buckets import fit_to_bucket
from difftrain.data.cache import DataCache
from difftrain.errors import CacheMismatch
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train
from difftrain.utils import sha256_file


def _cfg(model, data, out, **extra):
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(model, data, out, **extra)).config


def _rgba(path, size, seed):
    """An RGBA image whose alpha has structure (a bright block, a ramp) to tell crops apart."""
    w, h = size
    rng = np.random.default_rng(seed)
    px = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    alpha = np.tile(np.linspace(0, 255, w, dtype=np.uint8), (h, 1))
    alpha[h // 4 : h // 2, w // 3 : w // 2] = 255
    px[..., 3] = alpha
    Image.fromarray(px, "RGBA").save(path)
    return path


@pytest.mark.parametrize("random_crop", [False, True])
def test_alpha_masks_are_cached_at_latent_resolution_with_the_images_crop(tiny_model, tmp_path, random_crop):
    data = tmp_path / "images"
    data.mkdir()
    for i, size in enumerate([(300, 190), (170, 260), (256, 256)]):
        _rgba(data / f"{i}.png", size, i)
        (data / f"{i}.caption").write_text(f"image {i}")
    Image.new("RGB", (256, 256), "white").save(data / "opaque.png")  # no alpha: learned everywhere
    cfg = _cfg(tiny_model, data, tmp_path, **{"data.alpha_mask": "true", "data.random_crop": str(random_crop).lower()})
    report = precompute(cfg)
    assert report.masks == {"alpha channel": 3, "none": 1}
    assert report.unmasked == [(str(data / "opaque.png"), "no alpha channel: learned everywhere")]
    cache = DataCache(tmp_path / "cache")
    index = cache.read_json("index.json")
    assert index["masks"] == {"source": "alpha"}
    checked = 0
    for it in index["items"]:
        if it["key"] == "opaque":
            assert "mask" not in it
            continue
        latent = cache.get(it["latent"])
        mask = cache.get(it["mask"])["mask"]
        h, w = latent["latents"].shape[-2:]
        assert mask.shape == (1, h, w)
        # the reference: the image fitted as precompute fits it (its crop seeded by its content), its alpha
        # area-averaged to the latent (sd-scripts' apply_masked_loss)
        image = Image.open(it["image"])
        rng = random.Random(sha256_file(it["image"])) if random_crop else None
        fitted, crop = fit_to_bucket(image, tuple(it["bucket"]), rng=rng)
        assert tuple(latent["crop"].tolist()) == crop
        alpha = torch.from_numpy(np.asarray(fitted.getchannel("A"), dtype=np.float32) / 255)
        want = F.interpolate(alpha[None, None], size=(h, w), mode="area")[0]
        torch.testing.assert_close(mask.float(), want, atol=1e-3, rtol=0)
        checked += 1
    assert checked == 3


@pytest.mark.slow
def test_a_changed_mask_is_fitted_again_without_its_latent_and_training_reads_the_masks(tiny_model, dataset, tmp_path):
    masks = tmp_path / "masks"
    masks.mkdir()
    images = sorted(dataset.glob("*.png"))
    for p in images[:3]:
        w, h = Image.open(p).size
        a = np.zeros((h, w), np.uint8)
        a[:, : w // 2] = 255
        Image.fromarray(a).save(masks / p.name)
    w3, h3 = Image.open(images[3]).size
    half = (h3 // 2, w3 // 2)
    Image.fromarray(np.full(half, 255, np.uint8)).convert("RGB").save(masks / images[3].name)  # drawn at half size
    sets = {"data.mask_dir": masks, "train.max_steps": 2, "train.loss_type": "smooth_l1"}
    cfg = _cfg(tiny_model, dataset, tmp_path, **sets)
    first = precompute(cfg)
    assert first.masks == {"mask file": 4, "none": len(images) - 4} and first.masks_encoded == 4
    before = {it["key"]: it for it in DataCache(tmp_path / "cache").read_json("index.json")["items"]}
    Image.fromarray(np.zeros(half, np.uint8)).save(masks / images[3].name)  # now nothing of it is learned
    again = precompute(cfg)
    assert (again.latents_encoded, again.texts_encoded, again.masks_encoded) == (0, 0, 1)
    cache = DataCache(tmp_path / "cache")
    after = {it["key"]: it for it in cache.read_json("index.json")["items"]}
    changed = [k for k in after if after[k].get("mask") != before[k].get("mask")]
    assert changed == [images[3].stem] and after[images[3].stem]["latent"] == before[images[3].stem]["latent"]
    assert cache.get(after[images[3].stem]["mask"])["mask"].max() == 0
    losses = train(cfg).losses
    assert len(losses) == 2 and all(np.isfinite(losses))


@pytest.mark.slow
def test_training_with_masks_on_a_cache_made_without_them_is_refused(tiny_model, dataset, tmp_path):
    precompute(_cfg(tiny_model, dataset, tmp_path))
    with pytest.raises(CacheMismatch, match=r"the alpha channel .*the cache holds none"):
        train(_cfg(tiny_model, dataset, tmp_path, **{"data.alpha_mask": "true", "train.max_steps": 1}))


@pytest.mark.slow
def test_video_masks_one_for_all_frames_one_per_frame_and_a_mask_video(tmp_path):
    """A clip with one mask image: [1, 1, h, w], broadcast over its latent frames; a clip with a folder of a mask per
    frame, or a mask video: each latent frame the mean of the frames it stands for (frame 0 alone, then 4 each);
    they train."""
    pytest.importorskip("av")
    from test_cogvideox_training import _clip

    from difftrain.families.cogvideox import CogVideoX

    model = CogVideoX().build_tiny(tmp_path / "tiny-cog", seed=0)
    clips, masks = tmp_path / "clips", tmp_path / "masks"
    for i in range(3):
        _clip(clips / f"clip{i}.mp4", 9, seed=i)
        (clips / f"clip{i}.txt").write_text(f"a square {i}")
    masks.mkdir()
    _mask_image = np.zeros((48, 64), np.uint8)
    _mask_image[:, 32:] = 255
    Image.fromarray(_mask_image).save(masks / "clip0.png")
    (masks / "clip1").mkdir()
    for f in range(9):  # frame f: its left f/8 learned
        a = np.zeros((48, 64), np.uint8)
        a[:, : 8 * f] = 255
        Image.fromarray(a).save(masks / "clip1" / f"{f:03d}.png")
    grey_video(masks / "clip2.mp4", [np.where(np.arange(64) < 8 * f, 255, 0) for f in range(9)])
    sets = tiny_sets(model, clips, tmp_path, **{"data.caption_ext": ".txt", "data.mask_dir": masks})
    cfg = resolve(recipe="tiny-cogvideox-lora", sets=sets + ["train.max_steps=2"]).config
    report = precompute(cfg)
    assert report.masks == {"mask file": 1, "mask per frame": 1, "mask video": 1}
    cache = DataCache(tmp_path / "cache")
    items = {it["key"]: it for it in cache.read_json("index.json")["items"]}
    lat_shape = cache.get(items["clip0"]["latent"])["latents"].shape  # [C, 3, h, w]: 9 frames -> 3
    one = cache.get(items["clip0"]["mask"])["mask"].float()
    assert one.shape == (1, 1, *lat_shape[-2:])
    per = cache.get(items["clip1"]["mask"])["mask"].float()
    assert per.shape == (1, 3, *lat_shape[-2:])
    learned = per.mean(dim=(2, 3))[0]  # the share learned of each latent frame: frame 0, then frames 1-4, 5-8
    want = torch.tensor([0.0, (1 + 2 + 3 + 4) / 4 / 8, (5 + 6 + 7 + 8) / 4 / 8])
    torch.testing.assert_close(learned, want, atol=2e-3, rtol=0)
    from_video = cache.get(items["clip2"]["mask"])["mask"].float().mean(dim=(2, 3))[0]  # lossy: within 3%
    torch.testing.assert_close(from_video, want, atol=0.03, rtol=0)
    assert len(train(cfg).losses) == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, builder",
    [
        ("tiny-sd3-lora", "sd3:SD3"),
        ("tiny-flux-lora", "flux:Flux"),
        ("tiny-zimage-lora", "zimage:ZImage"),
        ("tiny-qwen-image-lora", "qwenimage:QwenImage"),
    ],
)
def test_masks_reach_the_loss_of_every_image_family(recipe, builder, tmp_path):
    """Flow families, packed (Flux, Z-Image, Qwen-Image: 2x2 patches) or not: the prediction comes back in the
    latent's layout, so the mask weights it there. Fully transparent images train with a loss of exactly 0; half
    transparent ones with a loss above 0."""
    import importlib

    module, cls = builder.split(":")
    model = getattr(importlib.import_module(f"difftrain.families.{module}"), cls)().build_tiny(tmp_path / "m", seed=0)
    losses = {}
    for alpha in (0, 128):
        data = tmp_path / f"images{alpha}"
        data.mkdir()
        for i in range(2):
            px = np.random.default_rng(i).integers(0, 256, (128, 128, 4), dtype=np.uint8)
            px[..., 3] = alpha
            Image.fromarray(px, "RGBA").save(data / f"{i}.png")
            (data / f"{i}.caption").write_text(f"image {i}")
        sets = {"data.alpha_mask": "true", "train.max_steps": 2, "train.loss_type": "huber"}
        cfg = resolve(recipe=recipe, sets=tiny_sets(model, data, tmp_path / f"out{alpha}", **sets)).config
        assert precompute(cfg).masks == {"alpha channel": 2}
        losses[alpha] = train(cfg).losses
    assert losses[0] == [0.0, 0.0]
    assert all(v > 0 for v in losses[128])
