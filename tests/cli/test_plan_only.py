"""difftrain precompute --plan-only: buckets and drops from image headers, nothing encoded or written."""

from __future__ import annotations

from PIL import Image

from conftest import tiny_sets


def test_plan_only_prints_buckets_and_drops_without_loading_an_encoder(cli, tiny_model, dataset, tmp_path, monkeypatch):
    from difftrain.families.sdxl import SDXL

    (dataset / "broken.png").write_bytes(b"\x89PNG not really")
    Image.new("RGB", (40, 24)).save(dataset / "tiny.png")  # smaller than a bucket step: dropped with no_upscale
    Image.new("RGB", (256, 128)).save(dataset / "wide.png")

    def no_load(*a, **k):
        raise AssertionError("a plan loads no encoder")

    monkeypatch.setattr(SDXL, "load", no_load)
    monkeypatch.setattr(SDXL, "fingerprint", no_load)
    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"data.no_upscale": "true"})
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", "--plan-only", *[a for s in sets for a in ("--set", s)])
    assert r.code == 0, r
    assert "bucket plan (9 usable, 2 dropped)" in r.err
    assert "dropped" in r.err and "broken.png" in r.err and "tiny.png" in r.err
    assert "%" in r.err and not (tmp_path / "cache" / "index.json").exists()
