"""The precompute cache is keyed by content: a rerun encodes only what changed."""

from __future__ import annotations

import shutil

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute


def _cfg(tiny_model, data, out, **extra):
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, data, out, **extra)).config


def test_second_run_reuses_and_changes_recompute_only_what_changed(tiny_model, dataset, tmp_path):
    cfg = _cfg(tiny_model, dataset, tmp_path)
    r1 = precompute(cfg)
    assert (r1.latents_encoded, r1.texts_encoded) == (8, 8)

    r2 = precompute(cfg)
    assert (r2.latents_encoded, r2.texts_encoded) == (0, 0)
    assert (r2.latents_reused, r2.texts_reused) == (8, 8)

    cap = sorted(dataset.glob("*.caption"))[0]
    cap.write_text("a completely new caption")
    r3 = precompute(cfg)
    assert (r3.latents_encoded, r3.texts_encoded) == (0, 1)

    img = sorted(dataset.glob("*.png"))[0]
    shutil.copy(img, dataset / "zz_new.png")
    (dataset / "zz_new.caption").write_text("a new image")
    r4 = precompute(cfg)
    assert (r4.latents_encoded, r4.texts_encoded) == (0, 1)  # same pixels: the latent is shared
    assert r4.items == 9

    # a different precision is a different cache entry, never a stale one
    r5 = precompute(_cfg(tiny_model, dataset, tmp_path, **{"precompute.vae_dtype": "bf16"}))
    assert r5.latents_encoded == 8


def test_corrupt_image_is_skipped_and_reported(tiny_model, dataset, tmp_path):
    (dataset / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (dataset / "broken.caption").write_text("broken")
    r = precompute(_cfg(tiny_model, dataset, tmp_path))
    assert r.items == 8
    assert [p for p, _ in r.skipped if p.endswith("broken.png")]


def test_precompute_holds_the_trainings_gpu_cap(tiny_model, dataset, tmp_path, monkeypatch):
    """train.gpu_memory_limit_gib caps precompute's process as it caps training's, so a tier's precompute can be
    checked on a bigger GPU as its card would leave it (benchmarks/data_pipeline.py card)."""
    from difftrain.precompute import run

    caps = []
    monkeypatch.setattr(run, "cap_gpu_memory", lambda device, gib: caps.append((device.type, gib)))
    r = precompute(_cfg(tiny_model, dataset, tmp_path, **{"train.gpu_memory_limit_gib": 1.95}))
    assert caps == [("cpu", 1.95)] and r.latents_encoded == 8
