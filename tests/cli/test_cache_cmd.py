"""difftrain cache info | verify | prune on a tiny SDXL cache."""

from __future__ import annotations

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.data.cache import DataCache, cache_info, verify_cache
from difftrain.precompute.run import precompute


def _cache(tiny_model, dataset, tmp_path, shard_mb=None):
    extra = {"precompute.shard_max_mb": shard_mb} if shard_mb else {}
    cfg = resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, dataset, tmp_path, **extra)).config
    precompute(cfg)
    return cfg, tmp_path / "cache"


def test_info_verify_and_prune_after_a_caption_changed(cli, tiny_model, dataset, tmp_path):
    cfg, root = _cache(tiny_model, dataset, tmp_path)
    assert verify_cache(root) == []
    first = cache_info(root)
    assert first["items"] == 8 and first["unused_entries"] == 0 and first["stray_files"] == []
    caption = next(dataset.glob("*.caption"))
    caption.write_text("a brand new caption", encoding="utf-8")
    stages = len(DataCache(root).read_json("index.json")["items"][0]["texts"])
    precompute(cfg)  # one caption re-encoded: its old embeddings (one entry per text stage) are no longer used
    assert cache_info(root)["unused_entries"] == stages
    stray = root / "shards" / "zz" / "killed.safetensors.tmp"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"half a shard")
    r = cli("cache", "prune", root, "--dry-run")
    assert r.code == 0 and f"would drop {stages} entries" in r.err and stray.exists()
    r = cli("cache", "prune", root)
    assert r.code == 0 and f"dropped {stages} entries" in r.err and "1 stray files" in r.err and not stray.exists()
    after = cache_info(root)
    assert after["unused_entries"] == 0 and after["entries"] == first["entries"] and verify_cache(root) == []
    r = cli("cache", "info", root)
    assert r.code == 0 and "8 items" in r.err
    # the training cache still serves every item
    cache = DataCache(root)
    for it in cache.read_json("index.json")["items"]:
        cache.get(it["latent"])


def test_verify_names_a_damaged_or_missing_shard(cli, tiny_model, dataset, tmp_path):
    _, root = _cache(tiny_model, dataset, tmp_path, shard_mb=1)
    shards = sorted(DataCache(root).manifest["shards"])
    assert len(shards) >= 2
    (root / shards[0]).write_bytes((root / shards[0]).read_bytes()[:100])  # truncated
    (root / shards[1]).unlink()
    problems = verify_cache(root)
    assert any("bytes, the manifest recorded" in p for p in problems) and any("is missing" in p for p in problems)
    r = cli("cache", "verify", root)
    assert r.code == 1 and "problem(s)" in r.err and "difftrain precompute" in r.err
    assert cli("cache", "verify", tmp_path / "nowhere").code == 2
