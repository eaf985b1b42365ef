"""Every kind of bad image is converted or skipped with its reason in precompute-report.json; the run ends with
a summary and exits 0 unless nothing is usable or --strict is set; missing captions use the fallback and are
counted."""

from __future__ import annotations

import io
import json
import random

import pytest
from PIL import Image

from conftest import tiny_sets


def _noise(w, h, mode="RGB"):
    rng = random.Random(0)
    img = Image.new("RGB", (w, h))
    img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(w * h)])
    return img.convert(mode) if mode != "RGB" else img


def add_bad_images(folder):
    """Writes one of each kind; returns {name: expected outcome}."""
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 20)
    (folder / "zero.png").write_bytes(b"")
    buf = io.BytesIO()
    _noise(160, 160).save(buf, "JPEG", quality=95)
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    _noise(160, 128, "CMYK").save(folder / "cmyk.jpg")
    g16 = Image.new("I;16", (128, 160))
    g16.putdata([(x * 400) % 65536 for x in range(128 * 160)])
    g16.save(folder / "gray16.png")
    pal = _noise(128, 128).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.save(folder / "palette.png", transparency=0)
    _noise(128, 128, "RGBA").save(folder / "alpha.png")
    _noise(16, 16).save(folder / "tiny.png")
    _noise(128, 128).save(folder / "no_caption_here.png")
    for stem in ("corrupt", "zero", "truncated", "cmyk", "gray16", "palette", "alpha", "tiny"):
        (folder / f"{stem}.caption").write_text(f"a {stem} image", encoding="utf-8")


def _args(tiny_model, data, out, *extra):
    sets = tiny_sets(tiny_model, data, out, **{"data.caption_fallback": "filename", "precompute.num_workers": 2})
    return ["precompute", "--recipe", "tiny-sdxl-lora", *[a for s in sets for a in ("--set", s)], *extra]


def test_bad_images_are_converted_or_skipped_and_reported(tiny_model, dataset, tmp_path, cli):
    add_bad_images(dataset)
    r = cli(*_args(tiny_model, dataset, tmp_path))
    assert r.code == 0, r
    report = json.loads((tmp_path / "cache" / "precompute-report.json").read_text())
    why = {item["path"].rsplit("/", 1)[-1]: item["reason"] for item in report["skipped"]}
    assert set(why) == {"corrupt.png", "zero.png", "truncated.jpg", "tiny.png"}
    assert "0 bytes" in why["zero.png"] and "not a readable image" in why["corrupt.png"]
    assert "cannot decode" in why["truncated.jpg"] and "truncated" in why["truncated.jpg"]
    assert "too small" in why["tiny.png"] and "data.max_upscale" in why["tiny.png"]
    assert report["converted"] == {"CMYK": 1, "I;16": 1, "P": 1, "RGBA": 1}
    assert report["captions"] == {"caption": 12, "filename": 1} and report["usable"] == 13
    index = json.loads((tmp_path / "cache" / "index.json").read_text())
    assert {it["key"]: it["caption"] for it in index["items"]}["no_caption_here"] == "no caption here"
    for needle in (
        "4 skipped",
        "converted to RGB: 1 CMYK, 1 I;16, 1 P, 1 RGBA",
        "filename 1",
        "precompute-report.json",
    ):
        assert needle in r.err.replace("\n", " "), needle
    assert "Traceback" not in r.err

    # --strict fails, and leaves the last good index as it was
    before = (tmp_path / "cache" / "index.json").read_bytes()
    (dataset / "zz_more.png").write_bytes(b"")
    r = cli(*_args(tiny_model, dataset, tmp_path, "--strict"))
    assert r.code != 0 and "--strict" in r.err and "Traceback" not in r.err
    assert (tmp_path / "cache" / "index.json").read_bytes() == before


def test_nothing_usable_fails_with_the_report_written(tiny_model, tmp_path, cli):
    data = tmp_path / "bad"
    data.mkdir()
    (data / "zero.png").write_bytes(b"")
    _noise(8, 8).save(data / "tiny.png")
    r = cli(*_args(tiny_model, data, tmp_path))
    assert r.code != 0 and "No usable images" in r.err and "Traceback" not in r.err
    report = json.loads((tmp_path / "cache" / "precompute-report.json").read_text())
    assert report["usable"] == 0 and len(report["skipped"]) == 2


def test_caption_fallback_empty_is_counted(tiny_model, dataset, tmp_path):
    from difftrain.config.load import resolve
    from difftrain.precompute.run import precompute

    for p in list(dataset.glob("00_*.caption")) + list(dataset.glob("00_*.txt")):
        p.unlink()
    (dataset / "01_green_square.caption").unlink()  # tags remain: caption_then_tags uses them
    cfg = resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, dataset, tmp_path)).config
    r = precompute(cfg)
    assert r.captions == {"caption": 6, "tags": 1, "empty": 1}


@pytest.mark.slow
def test_files_difftrain_does_not_read_are_counted_and_listed(tiny_model, dataset, tmp_path):
    """A .gif, a multi-page .tif, a video and an animated WebP beside the images: merge-tags' and precompute's
    summaries count them (through the console script) and precompute-report.json lists each with its reason."""
    import subprocess
    import sys
    from pathlib import Path

    frames = [_noise(128, 128), _noise(128, 128).rotate(90)]
    frames[0].save(dataset / "anim.gif", save_all=True, append_images=frames[1:])
    frames[0].save(dataset / "pages.tif", save_all=True, append_images=frames[1:])
    frames[0].save(dataset / "anim.webp", save_all=True, append_images=frames[1:])
    (dataset / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    script = str(Path(sys.executable).parent / "difftrain")
    merged = subprocess.run(
        [script, "merge-tags", str(dataset), str(tmp_path / "meta.json")], capture_output=True, text=True
    )
    assert merged.returncode == 0, merged.stderr
    text = " ".join(merged.stderr.split())
    assert "3 files not used (1 .gif, 1 .mp4, 1 .tif)" in text, text
    r = subprocess.run([script, *_args(tiny_model, dataset, tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 skipped" in " ".join(r.stderr.split()), r.stderr[-3000:]
    report = json.loads((tmp_path / "cache" / "precompute-report.json").read_text())
    why = {item["path"].rsplit("/", 1)[-1]: item["reason"] for item in report["skipped"]}
    assert set(why) == {"anim.gif", "pages.tif", "clip.mp4", "anim.webp"}
    assert ".gif is not a format difftrain reads" in why["anim.gif"] and "convert it to PNG" in why["pages.tif"]
    assert "a video" in why["clip.mp4"] and "2 frames" in why["anim.webp"]
