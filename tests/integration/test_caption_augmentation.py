"""Caption shuffling and dropout with cached text embeddings, and training's refusal of a cache that does not
match its config (each difference named)."""

from __future__ import annotations

import pytest

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.data.cache import DataCache
from difftrain.errors import CacheMismatch
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train

AUG = {
    "data.caption_source": "tags",
    "data.shuffle_caption": True,
    "data.keep_tokens": 1,
    "data.caption_variants": 3,
    "data.caption_dropout_rate": 0.3,
}


def _cfg(tiny_model, data, out, **extra):
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, data, out, **extra)).config


def test_shuffled_variants_are_cached_and_training_draws_them(tiny_model, dataset, tmp_path, monkeypatch):
    cfg = _cfg(tiny_model, dataset, tmp_path, **AUG)
    r = precompute(cfg)
    index = DataCache(tmp_path / "cache").read_json("index.json")
    assert index["captions"]["variants"] == 3 and index["captions"]["keep_tokens"] == 1 and index["empty_text"]
    variant_keys = set()
    for it in index["items"]:
        vs = it["text_variants"]
        assert len(vs) == 3 and len({v["clip"] for v in vs}) == 3
        variant_keys |= {k for v in vs for k in v.values()}
    expected = (
        variant_keys | {k for it in index["items"] for k in it["texts"].values()} | set(index["empty_text"].values())
    )
    assert r.texts_encoded == len(expected)  # every variant and the empty caption, each once
    cache = DataCache(tmp_path / "cache")
    assert not cache.missing(expected)
    assert (precompute(cfg).texts_encoded) == 0  # seeded by the caption: a rerun finds them all
    from difftrain.data.cache import prune_cache, verify_cache

    assert prune_cache(tmp_path / "cache")["entries_dropped"] == 0  # variants and the empty caption are in use
    assert verify_cache(tmp_path / "cache") == []

    read = []
    orig_get = DataCache.get
    monkeypatch.setattr(DataCache, "get", lambda self, key: (read.append(key), orig_get(self, key))[1])
    res = train(_cfg(tiny_model, dataset, tmp_path, **AUG, **{"train.max_steps": 16, "train.checkpoint_every": 1000}))
    assert len(res.losses) == 16
    read = set(read)
    assert len(read & variant_keys) >= 4  # several shuffled versions were trained on
    assert read & set(index["empty_text"].values())  # and the dropped caption


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"data.shuffle_caption": True, "data.caption_source": "tags"}, "shuffle_caption"),
        ({"data.caption_dropout_rate": 0.1}, "empty caption"),
        ({"precompute.vae_dtype": "bf16"}, "precompute.vae_dtype: the cache was made with fp32, this config has bf16"),
        ({"precompute.text_encoder_dtype": "bf16"}, "precompute.text_encoder_dtype"),
    ],
)
def test_training_refuses_a_cache_that_does_not_match(tiny_model, dataset, tmp_path, change, needle, cli):
    precompute(_cfg(tiny_model, dataset, tmp_path))
    with pytest.raises(CacheMismatch) as e:
        train(_cfg(tiny_model, dataset, tmp_path, **change))
    assert needle in e.value.message
    r = cli(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--no-precompute",  # without it, train encodes what this config lacks first (tests/cli/test_usage_errors.py)
        *[a for s in tiny_sets(tiny_model, dataset, tmp_path, **change) for a in ("--set", s)],
    )
    assert r.code != 0 and needle in r.err and "Traceback" not in r.err


def test_augmentation_settings_changed_since_precompute(tiny_model, dataset, tmp_path):
    precompute(_cfg(tiny_model, dataset, tmp_path, **AUG))
    with pytest.raises(CacheMismatch, match=r"keep_tokens 1 -> 2"):
        train(_cfg(tiny_model, dataset, tmp_path, **{**AUG, "data.keep_tokens": 2}))
    # less augmentation than cached is fine: the plain captions are in the cache too
    res = train(_cfg(tiny_model, dataset, tmp_path, **{"data.caption_source": "tags", "train.max_steps": 2}))
    assert len(res.losses) == 2


def test_a_cache_of_other_weights_is_refused(tiny_model, dataset, tmp_path):
    from difftrain.families.sdxl import SDXL

    precompute(_cfg(tiny_model, dataset, tmp_path))
    other = SDXL().build_tiny(tmp_path / "other-sdxl", seed=1)
    with pytest.raises(CacheMismatch) as e:
        train(_cfg(other, dataset, tmp_path))
    assert "the vae weights" in e.value.message and "text stage" in e.value.message
