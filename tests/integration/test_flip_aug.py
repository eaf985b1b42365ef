"""flip_aug (sd-scripts' horizontal flip) on the tiny SDXL: each image cached a second time mirrored after its crop,
its mask mirrored with it, keys without the flip unchanged, and training drawing one of the two per epoch, seeded."""

from __future__ import annotations

import random
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import console_script, script_train, set_args, tiny_sets
from difftrain.config.load import resolve
from difftrain.data.buckets import fit_to_bucket
from difftrain.data.cache import DataCache
from difftrain.data.index import IndexItem
from difftrain.data.sources import load_rgb
from difftrain.families.registry import get_family
from difftrain.precompute.pipeline import to_unit_range
from difftrain.precompute.run import precompute
from difftrain.trainers.cache_check import cache_differences
from difftrain.trainers.feed import Feed, flip_drawn, open_index
from difftrain.utils import sha256_file


def _cfg(model, data, out, **extra):
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(model, data, out, **extra)).config


def _rgba(path, size, seed):
    """An RGBA image, its alpha a left-to-right ramp with a block: a mirrored mask differs from the mask."""
    w, h = size
    px = np.random.default_rng(seed).integers(0, 256, (h, w, 4), dtype=np.uint8)
    alpha = np.tile(np.linspace(0, 255, w, dtype=np.uint8), (h, 1))
    alpha[h // 4 : h // 2, w // 8 : w // 3] = 255
    px[..., 3] = alpha
    Image.fromarray(px, "RGBA").save(path)


def test_flip_drawn_is_seeded_by_seed_epoch_and_repeat_and_draws_both():
    item = IndexItem(key="a", latent="L", texts={}, bucket=(64, 64), flipped="F")
    draws = [flip_drawn(item, 3, e) for e in range(40)]
    assert 8 < sum(draws) < 32  # both versions over the epochs
    assert draws == [flip_drawn(item, 3, e) for e in range(40)]  # the same sequence after a resume
    assert draws != [flip_drawn(item, 4, e) for e in range(40)]  # another seed: another sequence
    second = IndexItem(key="a", latent="L", texts={}, bucket=(64, 64), flipped="F", draw=1)
    assert draws != [flip_drawn(second, 3, e) for e in range(40)]  # each repeat draws its own
    plain = IndexItem(key="a", latent="L", texts={}, bucket=(64, 64))
    assert not any(flip_drawn(plain, 3, e) for e in range(40))  # no flip_aug: never mirrored


@pytest.mark.parametrize("random_crop", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flipped_entries_are_the_mirrored_crop_encoded_and_keys_without_flip_unchanged(
    tiny_model, tmp_path, random_crop
):
    data = tmp_path / "images"
    data.mkdir()
    for i, size in enumerate([(300, 190), (170, 260)]):
        _rgba(data / f"{i}.png", size, i)
        (data / f"{i}.caption").write_text(f"image {i}")
    sets = {"data.alpha_mask": "true", "data.random_crop": str(random_crop).lower()}
    plain = precompute(_cfg(tiny_model, data, tmp_path, **sets))
    cache = DataCache(tmp_path / "cache")
    before = {it["key"]: it for it in cache.read_json("index.json")["items"]}
    assert not any("flipped" in it for it in before.values())

    cfg = _cfg(tiny_model, data, tmp_path, **sets, **{"data.flip_aug": "true"})
    family = get_family(cfg.family)
    # training with flip_aug on this cache (--no-precompute) is refused, naming it
    assert cache_differences(cfg, family, *open_index(cfg, family), []) == [
        "data.flip_aug: set, but the cache holds no mirrored latents of its items"
    ]
    report = precompute(cfg)
    assert (plain.latents_encoded, report.latents_encoded, report.latents_reused) == (2, 2, 2)  # only the mirrored
    cache = DataCache(tmp_path / "cache")
    items = cache.read_json("index.json")["items"]
    assert cache_differences(cfg, family, *open_index(cfg, family), []) == []
    vae = family.load(cfg.model, [family.image_encoder], dtype=torch.float32, device=torch.device("cpu"))
    for it in items:
        was = before[it["key"]]
        assert (it["latent"], it["mask"]) == (was["latent"], was["mask"])  # keys without the flip unchanged
        assert it["flipped"] not in (it["latent"], None) and it["flipped_mask"] not in (it["mask"], None)
        own, mirrored = cache.get(it["latent"]), cache.get(it["flipped"])
        assert torch.equal(mirrored["crop"], own["crop"])  # SDXL's crop conditioning stays (as sd-scripts)

        def rng(path=it["image"]):  # precompute's crop: seeded by the image's content
            return random.Random(sha256_file(path)) if random_crop else None

        fitted, _ = fit_to_bucket(load_rgb(it["image"]), tuple(it["bucket"]), rng=rng())
        pixels = torch.from_numpy(np.asarray(fitted, dtype=np.uint8).copy()).permute(2, 0, 1)
        with torch.no_grad():
            want = family.encode_images(vae, to_unit_range(pixels.flip(-1)[None]))[0]
        torch.testing.assert_close(mirrored["latents"], want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(mirrored["latents"], own["latents"], atol=1e-3)
        # the mask mirrored with its image: the alpha of the mirrored crop, area-averaged to the latent
        h, w = want.shape[-2:]
        fitted_a, _ = fit_to_bucket(Image.open(it["image"]), tuple(it["bucket"]), rng=rng())
        alpha = torch.from_numpy(np.asarray(fitted_a.getchannel("A"), dtype=np.float32) / 255).flip(-1)
        mask = cache.get(it["flipped_mask"])["mask"].float()
        torch.testing.assert_close(
            mask, F.interpolate(alpha[None, None], size=(h, w), mode="area")[0], atol=1e-3, rtol=0
        )
        assert not torch.allclose(mask, cache.get(it["mask"])["mask"].float(), atol=1e-2)

    # training's batches: the mirrored latent and mask exactly when the draw says so, the item's own otherwise
    feed = Feed(cfg, family, torch.device("cpu"))
    (item,) = [it for it in feed.items if it.key == "0"]
    seen = set()
    for epoch in range(8):
        flipped = flip_drawn(item, cfg.train.seed, epoch)
        seen.add(flipped)
        batch = feed.batch([item], epoch, augment=True)
        latent, mask = (item.flipped, item.flipped_mask) if flipped else (item.latent, item.mask)
        assert latent is not None and mask is not None
        assert torch.equal(batch["latents"][0], cache.get(latent)["latents"])
        assert torch.equal(batch["loss_mask"][0], cache.get(mask)["mask"].float())
    assert seen == {True, False}
    assert torch.equal(feed.batch([item], 0)["latents"][0], cache.get(item.latent)["latents"])  # validation: own
    # a config without flip_aug on this cache: never mirrored
    off = Feed(_cfg(tiny_model, data, tmp_path, **sets), family, torch.device("cpu"))
    (item,) = [it for it in off.items if it.key == "0"]
    for epoch in range(8):
        assert torch.equal(off.batch([item], epoch, augment=True)["latents"][0], cache.get(item.latent)["latents"])


@pytest.mark.slow
def test_edit_families_refuse_flip_aug_through_the_console_script(tmp_path):
    from difftrain.families.qwenimage import QwenImageEdit
    from difftrain.flows.quickstart import make_dataset

    model = QwenImageEdit().build_tiny(tmp_path / "qie", seed=0)
    data = make_dataset(tmp_path / "images", n=2, seed=0)
    control = tmp_path / "control"
    control.mkdir()
    for f in data.glob("*.png"):
        Image.open(f).convert("RGB").save(control / f.name)
    sets = tiny_sets(model, data, tmp_path, **{"data.control_dir": control, "data.flip_aug": "true"})
    r = subprocess.run(
        [console_script(), "precompute", "--recipe", "tiny-qwen-image-edit-lora", *set_args(sets)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "data.flip_aug is not available for qwen-image-edit" in err, r.stderr[-2000:]
    assert "reference images" in err and "Traceback" not in r.stderr
    assert not (tmp_path / "cache" / "index.json").exists()


@pytest.mark.slow
def test_training_with_flip_aug_through_the_console_script(tiny_model, dataset, tmp_path):
    sets = tiny_sets(
        tiny_model, dataset, tmp_path, **{"data.flip_aug": "true", "train.max_steps": 4, "train.checkpoint_every": 1000}
    )
    r = script_train("--recipe", "tiny-sdxl-lora", *set_args(sets))
    assert r.code == 0, r.err[-3000:]
    assert "precompute: latents 16 encoded, 0 reused" in " ".join((r.out + r.err).split())  # 8 images, 8 mirrored
    items = DataCache(tmp_path / "cache").read_json("index.json")["items"]
    assert len(items) == 8 and all(it["flipped"] for it in items)
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").exists()
