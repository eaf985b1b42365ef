"""difftrain quickstart runs the whole flow with no downloads, and a rerun reuses the cache."""

from __future__ import annotations

import json

from PIL import Image


def test_quickstart_twice(cli, tmp_path):
    out = tmp_path / "qs"
    r = cli("quickstart", "--out", out, "--steps", "6")
    assert r.code == 0, r
    for name in (
        "data",
        "model/model_index.json",
        "metadata.json",
        "cache/index.json",
        "run/config.yaml",
        "run/pytorch_lora_weights.safetensors",
        "sample.png",
    ):
        assert (out / name).exists(), name
    assert len(list((out / "data").glob("*.png"))) == 12
    sizes = {Image.open(p).size for p in (out / "data").glob("*.png")}
    assert len(sizes) >= 3  # mixed aspect ratios
    meta = json.loads((out / "metadata.json").read_text())
    assert all(v["tags"] and v["caption"] for v in meta.values())
    assert "12 latents and 12 captions encoded" in r.err.replace("\n", " ")
    assert Image.open(out / "sample.png").size == (128, 128)

    again = cli("quickstart", "--out", out, "--steps", "6")
    assert again.code == 0, again
    assert "0 latents and 0 captions encoded, 24 reused" in again.err.replace("\n", " ")
