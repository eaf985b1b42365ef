"""The cache's on-disk format is stable: a cache written by an earlier difftrain (tests/fixtures/cache-v1, made at
b09aa2c by tests/fixtures/make_cache_v1.py) is read by training as it is, and precompute over the same data finds
every entry under the same keys and writes the same index, byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "cache-v1"


@pytest.fixture(scope="module")
def old_cache(tmp_path_factory):
    """The fixture cache materialised: its data, a tiny SDXL built again, the cache with this machine's paths,
    and the recorded weight hashes in the cache's fingerprint memo (path|size|mtime| -> sha256)."""
    from difftrain.families.sdxl import SDXL

    root = tmp_path_factory.mktemp("cache-v1")
    data = Path(shutil.copytree(FIXTURE / "data", root / "data"))
    model = SDXL().build_tiny(root / "model", seed=0)
    cache = root / "cache"
    shutil.copytree(FIXTURE / "shards", cache / "shards")
    shutil.copy(FIXTURE / "manifest.json", cache / "manifest.json")
    index = (
        (FIXTURE / "index.json").read_text(encoding="utf-8").replace("@MODEL@", str(model)).replace("@DATA@", str(data))
    )
    (cache / "index.json").write_text(index, encoding="utf-8")
    memo = {}
    for rel, digest in json.loads((FIXTURE / "weight_hashes.json").read_text(encoding="utf-8")).items():
        f = model / rel
        st = f.stat()
        memo[f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|"] = digest
    (cache / "fingerprints.json").write_text(json.dumps(memo), encoding="utf-8")
    sets = json.loads((FIXTURE / "sets.json").read_text(encoding="utf-8"))
    return {"root": root, "data": data, "model": model, "cache": cache, "index": index, "sets": sets}


def _cfg(c, out: Path, **extra):
    sets = {**c["sets"], "data.cache_dir": c["cache"], **extra}
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(c["model"], c["data"], out, **sets)).config


def test_training_reads_a_cache_written_before(old_cache, tmp_path):
    from difftrain.trainers.loop import train

    r = train(_cfg(old_cache, tmp_path, **{"train.max_steps": 2, "train.batch_size": 1}))
    assert len(r.losses) == 2 and all(torch.isfinite(torch.tensor(r.losses)))


def test_precompute_finds_every_entry_under_the_same_keys(old_cache):
    from difftrain.precompute.run import precompute

    manifest = (old_cache["cache"] / "manifest.json").read_bytes()
    r = precompute(_cfg(old_cache, old_cache["root"]))
    assert (r.items, r.latents_encoded, r.texts_encoded) == (4, 0, 0)
    assert r.latents_reused == 4 and r.texts_reused > 4  # captions, their shuffled variants and the empty caption
    assert (old_cache["cache"] / "index.json").read_text(encoding="utf-8") == old_cache["index"]
    assert (old_cache["cache"] / "manifest.json").read_bytes() == manifest


def test_the_typed_index_round_trips_the_fixture_exactly():
    from difftrain.data.index import CacheIndex

    raw = json.loads((FIXTURE / "index.json").read_text(encoding="utf-8"))
    index = CacheIndex.from_json(raw, FIXTURE / "index.json")
    assert index.to_json() == raw
    assert [it.bucket_key for it in index.items] == [(*it["bucket"], 1) for it in raw["items"]]
    assert all(len(it.text_variants) == 2 for it in index.items) and index.empty_text
    # every entry the index names is in the fixture's manifest, and nothing else of it is used
    manifest = json.loads((FIXTURE / "manifest.json").read_text(encoding="utf-8"))
    assert index.entry_keys() == set(manifest["entries"])
