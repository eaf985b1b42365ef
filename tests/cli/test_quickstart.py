"""difftrain quickstart runs the whole flow with no downloads, and a rerun reuses the cache."""

from __future__ import annotations

import json

import pytest
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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "sample"),
    [
        ("sd3", "sample.png"),
        ("flux", "sample.png"),
        ("flux2", "sample.png"),
        ("flux2-edit", "sample.png"),
        ("cogvideox", "run/samples/final/00.mp4"),
        ("cogvideox-i2v", "run/samples/final/00.mp4"),
        ("wan", "run/samples/final/00.mp4"),
        ("wan-i2v", "run/samples/final/00.mp4"),
        ("qwen-image-edit", "sample.png"),  # two references per target in control/, the sample from two of them
    ],
)
def test_quickstart_of_every_family(cli, tmp_path, family, sample):
    """quickstart --family: the family's tiny model, synthetic images (clips for video), precompute, train, the
    exported LoRA and a sample (an image family's from its stock pipeline with the LoRA loaded, a video family's
    the trainer's validation mp4), through the console script."""
    from safetensors import safe_open

    out = tmp_path / "qs"
    r = cli("quickstart", "--family", family, "--out", out, "--steps", "4")
    assert r.code == 0, r
    assert (out / "model" / "model_index.json").exists() and (out / "run" / "config.yaml").exists()
    video = family.startswith(("cogvideox", "wan"))
    media = sorted((out / "data").glob("*.mp4" if video else "*.png"))
    assert len(media) == (3 if video else 12)
    with safe_open(str(out / "run" / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert any(k.startswith("transformer.") for k in f.keys())  # noqa: SIM118  # safe_open has no __iter__
    got = out / sample
    assert got.exists()
    if video:
        import av

        with av.open(str(got)) as c:
            assert len(list(c.decode(video=0))) == 9  # the recipe's 9 frames
        assert f"{len(media)} clips" in r.err and "captions encoded" in r.err
    else:
        assert Image.open(got).size == (128, 128)
        assert json.loads((out / "metadata.json").read_text())  # merge-tags ran
    import yaml

    cfg = yaml.safe_load((out / "run" / "config.yaml").read_text())
    assert cfg["family"] == family


def test_quickstart_refuses_an_unknown_family(cli, tmp_path):
    r = cli("quickstart", "--family", "pixart", "--out", tmp_path / "qs")
    assert r.code == 2 and "--family" in r.err and "flux" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "qs").exists()
