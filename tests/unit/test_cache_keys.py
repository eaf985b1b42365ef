"""The cache's addresses (difftrain.data.keys) are pinned: the fixture cache in tests/fixtures/cache-v1 (written by
tests/fixtures/make_cache_v1.py before the keys had a module of their own) records the fingerprints and every key
its config produced, and the formulas must give them again. No model is built: the tiny SDXL's weight files are
stood in for by empty files whose recorded hashes are put in the fingerprint memo, as precompute finds them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.data.captions import CaptionAugment, caption_variants
from difftrain.data.keys import CacheKeys, cache_fingerprints, clip_tag, crop_mode, latent_key, text_key
from difftrain.utils import sha256_file

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "cache-v1"


@pytest.fixture(scope="module")
def fixture_index() -> dict:
    return json.loads((FIXTURE / "index.json").read_text(encoding="utf-8"))


@pytest.fixture
def setup(tmp_path):
    """The fixture's config, over a stand-in model folder (empty weight files, their recorded hashes memoised)."""
    from difftrain.families.sdxl import SDXL

    model = tmp_path / "model"
    memo: dict[str, str] = {}
    for rel, digest in json.loads((FIXTURE / "weight_hashes.json").read_text(encoding="utf-8")).items():
        f = model / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
        st = f.stat()
        memo[f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|"] = digest
    sets = json.loads((FIXTURE / "sets.json").read_text(encoding="utf-8"))
    cfg = resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(model, FIXTURE / "data", tmp_path, **sets)).config
    return SDXL(), cfg, memo


def _image(item: dict) -> Path:
    return FIXTURE / "data" / Path(item["image"].replace("@DATA@/", ""))


def test_the_fingerprints_are_the_ones_the_fixture_recorded(setup, fixture_index):
    family, cfg, memo = setup
    n_memo = len(memo)
    vae, stages = cache_fingerprints(family, cfg, memo)
    assert vae == fixture_index["vae"]
    assert stages == fixture_index["text_stages"]
    assert list(stages) == family.enabled_stages(cfg.text_encoders)
    assert len(memo) == n_memo  # every weight hash came from the memo: nothing was read again


def test_the_formulas_give_every_key_of_the_fixture(setup, fixture_index):
    family, vae, dtype = fixture_index["family"], fixture_index["vae"], fixture_index["vae_dtype"]
    stages = fixture_index["text_stages"]
    aug = CaptionAugment.from_config(setup[1].data)  # the fixture's sets.json: shuffled, 2 variants, dropout
    assert aug.record() == fixture_index["captions"]
    for it in fixture_index["items"]:
        assert sha256_file(_image(it)) == it["image_sha256"]
        bucket = (it["bucket"][0], it["bucket"][1])
        assert latent_key(family, vae, dtype, bucket, crop_mode(False), it["image_sha256"]) == it["latent"]
        assert it["texts"] == {s: text_key(family, s, fp, it["caption"]) for s, fp in stages.items()}
        variants = [
            {s: text_key(family, s, fp, v) for s, fp in stages.items()} for v in caption_variants(it["caption"], aug)
        ]
        assert variants == it["text_variants"]
    assert fixture_index["empty_text"] == {s: text_key(family, s, fp, "") for s, fp in stages.items()}


def test_cache_keys_for_the_fixture_config_match_it(setup, fixture_index):
    family, cfg, memo = setup
    keys = CacheKeys.for_config(family, cfg, memo, video=False)
    assert (keys.family, keys.vae, keys.stages, keys.vae_dtype) == (
        fixture_index["family"],
        fixture_index["vae"],
        fixture_index["text_stages"],
        fixture_index["vae_dtype"],
    )
    for it in fixture_index["items"]:
        assert keys.latent((it["bucket"][0], it["bucket"][1]), it["image_sha256"]) == it["latent"]
        assert keys.texts(it["caption"]) == it["texts"]
    assert keys.texts("") == fixture_index["empty_text"]


def test_a_different_input_is_a_different_key(fixture_index):
    it = fixture_index["items"][0]
    args = ("sdxl", fixture_index["vae"], "fp32", (128, 128), "center", it["image_sha256"])
    base = latent_key(*args)
    assert base == it["latent"]
    changed = [
        latent_key("sd3", *args[1:]),
        latent_key(args[0], "0" * 64, *args[2:]),
        latent_key(*args[:2], "bf16", *args[3:]),
        latent_key(*args[:3], (128, 96), *args[4:]),
        latent_key(*args[:4], crop_mode(True), args[5]),
        latent_key(*args[:5], "0" * 64),
        latent_key(*args, clip_tag(9, "uniform")),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def _nul_joined(*parts: str) -> str:
    """The layout of every key, written out independently of difftrain.utils.sha256_text."""
    return hashlib.sha256(b"".join(p.encode("utf-8") + b"\x00" for p in parts)).hexdigest()


def test_a_video_latent_key_hashes_the_frames_taken():
    """No fixture holds a video cache: the byte layout of a clip's key is spelled out instead."""
    keys = CacheKeys(
        family="cogvideox",
        vae="v" * 64,
        stages={"t5": "t" * 64},
        vae_dtype="bf16",
        crop="center",
        frame_sampling="uniform",
    )
    expected = _nul_joined("latent", "cogvideox", "v" * 64, "bf16", "96x64", "center", "a" * 64, "9:uniform")
    assert keys.latent((96, 64), "a" * 64, frames=9) == expected
    assert keys.latent((96, 64), "a" * 64, frames=17) != expected
    assert keys.texts("a cat") == {"t5": _nul_joined("text", "cogvideox", "t5", "t" * 64, "a cat")}
    image_keys = CacheKeys(family="sdxl", vae="v" * 64, stages={}, vae_dtype="fp32", crop="random")
    assert image_keys.latent((64, 64), "a" * 64) == _nul_joined(
        "latent", "sdxl", "v" * 64, "fp32", "64x64", "random", "a" * 64, ""
    )


def test_data_fps_is_in_a_clips_key_and_leaves_keys_without_it_unchanged(tmp_path, monkeypatch):
    """data.fps takes other frames of a clip (resampled): its rate replaces frame_sampling in the clip tag."""
    from types import SimpleNamespace

    import difftrain.data.keys as k
    from difftrain.config.schema import DataConfig

    monkeypatch.setattr(k, "cache_fingerprints", lambda *a: ("v" * 64, {}))

    def keys(**data) -> CacheKeys:
        cfg = SimpleNamespace(data=DataConfig(dir=tmp_path, **data), precompute=SimpleNamespace(vae_dtype="bf16"))
        return CacheKeys.for_config(SimpleNamespace(name="wan"), cfg, {}, video=True)

    assert keys().frame_sampling == "uniform" and keys(frame_sampling="first").frame_sampling == "first"
    assert keys(fps=16).frame_sampling == "16fps"
    assert len({keys(fps=f).latent((96, 64), "a" * 64, 9) for f in (None, 16, 24)}) == 3
