"""kill -9 in the middle of a precompute: the cache stays valid, a rerun finishes it without encoding anything
twice, and the result equals a clean run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import tiny_sets
from difftrain.data.cache import DataCache, cache_info, prune_cache, verify_cache

# The child runs the real CLI; its shard writer is wrapped so that it SIGKILLs itself on the N-th shard, after
# the shard's temporary file is written and before the rename and the manifest update: the worst moment.
CHILD = textwrap.dedent("""
    import os, signal, sys
    from difftrain.data import cache
    from difftrain.cli.app import main

    count, kill_at, save = [0], int(os.environ["KILL_AT_SHARD"]), cache.save_file
    def dying_save(tensors, path):
        save(tensors, path)
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    cache.save_file = dying_save
    main(sys.argv[1:])
""")


def _args(tiny_model, data, out):
    sets = tiny_sets(tiny_model, data, out, **{"precompute.shard_max_mb": 0.0005, "precompute.num_workers": 0})
    return ["precompute", "--recipe", "tiny-sdxl-lora", *[a for s in sets for a in ("--set", s)]]


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [3, 11], ids=["during-latents", "during-captions"])
def test_killed_precompute_resumes_to_the_clean_result(tiny_model, dataset, tmp_path, cli, kill_at):
    env = {**os.environ, "KILL_AT_SHARD": str(kill_at), "DIFFTRAIN_PROGRESS": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *_args(tiny_model, dataset, tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    cache_root = tmp_path / "cache"
    assert not (cache_root / "index.json").exists()
    assert verify_cache(cache_root) == []  # what the killed run recorded is sound
    done_before = cache_info(cache_root)["entries"]
    assert done_before == kill_at - 1
    assert len(cache_info(cache_root)["stray_files"]) == 1  # the shard it was writing, never renamed

    from difftrain.config.load import resolve
    from difftrain.precompute.run import precompute

    cfg = resolve(
        recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, dataset, tmp_path, **{"precompute.shard_max_mb": 0.0005})
    ).config
    r = precompute(cfg)
    assert r.latents_encoded + r.texts_encoded + done_before == 16  # 8 latents + 8 captions, none twice
    assert verify_cache(cache_root) == []
    assert prune_cache(cache_root)["stray_deleted"] == 1

    clean = tmp_path / "clean"
    r_clean = precompute(resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, dataset, clean)).config)
    assert r_clean.latents_encoded == 8
    index, index_clean = (json.loads((p / "index.json").read_text()) for p in (cache_root, clean / "cache"))
    assert index["items"] == index_clean["items"]
    a, b = DataCache(cache_root), DataCache(clean / "cache")
    for it in index["items"]:
        for key in (it["latent"], *it["texts"].values()):
            ea, eb = a.get(key), b.get(key)
            assert ea.keys() == eb.keys()
            for name in ea:
                torch.testing.assert_close(ea[name], eb[name], rtol=1e-5, atol=1e-5)
