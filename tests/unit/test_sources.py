"""scan_dataset / caption resolution / load_rgb: captions, metadata keys, bad files, pixel modes."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image

from difftrain.data.sources import (
    ImageRecord,
    MetadataIndex,
    caption_for,
    load_rgb,
    read_image_size,
    scan_dataset,
    sidecar_texts,
    to_rgb,
)
from difftrain.data.tags import merge_tags
from difftrain.errors import DataError


def _img(path: Path, size: tuple[int, int] = (16, 12), mode: str = "RGB", color=(10, 20, 30), **save) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".bmp": "BMP"}.get(path.suffix.lower(), "PNG")
    Image.new(mode, size, color).save(path, format=fmt, **save)
    return path


def _noise_png(path: Path, size: tuple[int, int] = (96, 96)) -> Path:
    rnd = random.Random(0)
    img = Image.frombytes("RGB", size, bytes(rnd.randrange(256) for _ in range(size[0] * size[1] * 3)))
    img.save(path, format="PNG")
    return path


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------- caption_for
@pytest.mark.parametrize(
    ("caption", "tags", "source", "expected"),
    [
        ("a cat", "cat, animal", "caption_then_tags", "a cat"),
        (None, "cat, animal", "caption_then_tags", "cat, animal"),
        ("", "cat", "caption_then_tags", "cat"),
        ("a cat", "cat, animal", "caption_and_tags", "a cat, cat, animal"),
        ("a cat", None, "caption_and_tags", "a cat"),
        (None, "cat", "caption_and_tags", "cat"),
        ("a cat", "cat, animal", "tags", "cat, animal"),
        ("a cat", None, "tags", ""),
        (None, None, "caption_then_tags", ""),
    ],
)
def test_caption_for(caption, tags, source, expected):
    assert caption_for(caption, tags, source) == expected


def test_caption_for_unknown_source():
    with pytest.raises(ValueError, match="caption_source must be one of"):
        caption_for("a", "b", "captions")


def test_sidecar_texts_normalise_tags_and_strip_bom(tmp_path):
    img = _img(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("\ufeffx ,y,,z\n".encode("utf-8"))
    (tmp_path / "a.caption").write_bytes("\ufeff A caption \n".encode("utf-8"))
    assert sidecar_texts(img) == ("A caption", "x, y, z")
    assert sidecar_texts(img, caption_ext="nope", tag_ext="nada") == (None, None)


# ----------------------------------------------------------------- scan_dataset
def test_scan_keys_sizes_and_sidecar_captions(tmp_path):
    _img(tmp_path / "b.png", (40, 30))
    _write(tmp_path / "b.caption", "bee")
    _write(tmp_path / "b.txt", "insect, yellow")
    _img(tmp_path / "sub" / "deep" / "a.jpg", (20, 50))
    _write(tmp_path / "sub" / "deep" / "a.txt", "tag only")
    _img(tmp_path / "sub" / "c.d.webp", (8, 8))

    records, skipped = scan_dataset(tmp_path)

    assert skipped == []
    assert [r.key for r in records] == ["b", "sub/c.d", "sub/deep/a"]
    by_key = {r.key: r for r in records}
    assert by_key["b"] == ImageRecord("b", tmp_path / "b.png", "bee", 40, 30)
    assert (by_key["sub/deep/a"].width, by_key["sub/deep/a"].height) == (20, 50)
    assert by_key["sub/deep/a"].caption == "tag only"  # caption_then_tags falls back to tags
    assert by_key["sub/c.d"].caption == ""  # nothing -> empty string

    both, _ = scan_dataset(tmp_path, caption_source="caption_and_tags")
    assert {r.key: r.caption for r in both}["b"] == "bee, insect, yellow"
    tags, _ = scan_dataset(tmp_path, caption_source="tags")
    assert {r.key: r.caption for r in tags}["b"] == "insect, yellow"

    flat, _ = scan_dataset(tmp_path, recursive=False)
    assert [r.key for r in flat] == ["b"]


def test_scan_custom_extensions_without_dot(tmp_path):
    _img(tmp_path / "a.png")
    _write(tmp_path / "a.desc", "described")
    records, _ = scan_dataset(tmp_path, caption_ext="desc")
    assert records[0].caption == "described"


def test_scan_records_are_frozen(tmp_path):
    _img(tmp_path / "a.png")
    record = scan_dataset(tmp_path)[0][0]
    with pytest.raises(AttributeError):
        record.caption = "x"  # type: ignore[misc]


def test_scan_with_metadata_stem_keys(tmp_path):
    data = tmp_path / "data"
    _img(data / "a.png")
    _img(data / "b.png")
    _img(data / "c.png")
    _write(data / "c.caption", "from the sidecar")
    meta = tmp_path / "meta.json"
    meta.write_text(
        json.dumps({"a": {"caption": "cap a", "tags": "t1, t2"}, "b": {"tags": "only tags"}}), encoding="utf-8"
    )

    def captions(source: str) -> dict[str, str]:
        records, _ = scan_dataset(data, metadata=meta, caption_source=source)
        return {r.key: r.caption for r in records}

    # c has no entry in the metadata: its sidecar files are used
    assert captions("caption_then_tags") == {"a": "cap a", "b": "only tags", "c": "from the sidecar"}
    assert captions("caption_and_tags") == {"a": "cap a, t1, t2", "b": "only tags", "c": "from the sidecar"}
    assert captions("tags") == {"a": "t1, t2", "b": "only tags", "c": ""}


def test_scan_with_merge_tags_full_path_metadata(tmp_path):
    data = tmp_path / "data"
    _img(data / "x" / "same.png")
    _img(data / "y" / "same.png")
    _write(data / "x" / "same.txt", "from x")
    _write(data / "y" / "same.txt", "from y")
    meta = tmp_path / "meta.json"
    merge_tags(data, meta, full_path=True, recursive=True)
    for f in (data / "x" / "same.txt", data / "y" / "same.txt"):
        f.unlink()  # prove the captions come from the metadata

    records, _ = scan_dataset(data, metadata=meta, caption_source="tags")
    assert {r.key: r.caption for r in records} == {"x/same": "from x", "y/same": "from y"}


def test_metadata_relative_full_path_key_matches_absolute_image(tmp_path, monkeypatch):
    # sd-scripts --full_path with a relative folder writes keys relative to the working directory
    monkeypatch.chdir(tmp_path)
    img = _img(tmp_path / "imgs" / "a.png")
    index = MetadataIndex({str(Path("imgs") / "a.png"): {"caption": "rel"}})
    assert index.texts(img) == ("rel", None)
    assert index.texts(tmp_path / "imgs" / "other.png") is None


def test_metadata_bad_entries_are_data_errors(tmp_path):
    _img(tmp_path / "a.png")
    meta = tmp_path / "m.json"
    meta.write_text(json.dumps({"a": {"caption": 5}}), encoding="utf-8")
    with pytest.raises(DataError, match="not a string"):
        scan_dataset(tmp_path, metadata=meta)
    meta.write_text("[]", encoding="utf-8")
    with pytest.raises(DataError, match="not an object"):
        scan_dataset(tmp_path, metadata=meta)


def test_corrupt_zero_byte_and_non_images_are_skipped_with_reason(tmp_path):
    _img(tmp_path / "good.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("this is not a jpeg", encoding="utf-8")
    good_bytes = (tmp_path / "good.png").read_bytes()
    (tmp_path / "garbled.webp").write_bytes(b"RIFF\x00\x00\x00\x00WEBPVP8 " + b"\x00" * 5)
    (tmp_path / "headless.png").write_bytes(good_bytes[20:])

    records, skipped = scan_dataset(tmp_path)

    assert [r.key for r in records] == ["good"]
    reasons = {p.name: reason for p, reason in skipped}
    assert set(reasons) == {"empty.png", "text.jpg", "garbled.webp", "headless.png"}
    assert reasons["empty.png"] == "empty file (0 bytes)"
    assert reasons["text.jpg"].startswith("not a readable image")
    assert all(reasons.values())


def test_truncated_image_passes_scan_but_load_rgb_names_it(tmp_path):
    path = _noise_png(tmp_path / "trunc.png")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])

    records, skipped = scan_dataset(tmp_path)
    assert skipped == [] and records[0].width == 96  # header is intact
    with pytest.raises(DataError, match=r"trunc\.png") as err:
        load_rgb(path)
    assert err.value.hint


def test_truncated_jpeg_load_rgb_raises(tmp_path):
    path = tmp_path / "t.jpg"
    buf = io.BytesIO()
    _noise_png(tmp_path / "src.png")
    Image.open(tmp_path / "src.png").save(buf, format="JPEG", quality=95)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 3])
    with pytest.raises(DataError, match=r"t\.jpg"):
        load_rgb(path)


def test_duplicate_keys_skip_the_second_image(tmp_path):
    _img(tmp_path / "a.jpg")
    _img(tmp_path / "a.png")
    records, skipped = scan_dataset(tmp_path)
    assert [r.path.name for r in records] == ["a.jpg"]
    assert [(p.name, "a.jpg" in reason) for p, reason in skipped] == [("a.png", True)]


def test_duplicate_of_a_corrupt_image_is_kept(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"")
    _img(tmp_path / "a.png")
    records, skipped = scan_dataset(tmp_path)
    assert [r.path.name for r in records] == ["a.png"]
    assert [p.name for p, _ in skipped] == ["a.jpg"]


def test_scan_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        scan_dataset(tmp_path / "missing")
    with pytest.raises(DataError, match="no images"):
        scan_dataset(tmp_path)
    _img(tmp_path / "a.png")
    with pytest.raises(ValueError, match="caption_source"):
        scan_dataset(tmp_path, caption_source="everything")
    with pytest.raises(DataError, match="does not exist"):
        scan_dataset(tmp_path, metadata=tmp_path / "nope.json")


# ----------------------------------------------------------------- EXIF orientation
def test_exif_rotation_is_applied_consistently(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = _img(tmp_path / "phone.jpg", (40, 20), exif=exif.tobytes())
    assert read_image_size(path) == (20, 40)
    record = scan_dataset(tmp_path)[0][0]
    assert (record.width, record.height) == (20, 40)
    assert load_rgb(path).size == (20, 40)


# ----------------------------------------------------------------- load_rgb / to_rgb
def _near(pixel, expected, tol=3) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel, expected))


def test_rgba_alpha_is_composited_on_white(tmp_path):
    img = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    img.putpixel((1, 1), (255, 0, 0, 255))
    img.putpixel((2, 2), (0, 0, 0, 128))
    img.save(tmp_path / "a.png")
    out = load_rgb(tmp_path / "a.png")
    assert out.mode == "RGB" and out.size == (4, 4)
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 1)) == (255, 0, 0)
    assert _near(out.getpixel((2, 2)), (127, 127, 127))


def test_palette_with_transparency(tmp_path):
    img = Image.new("P", (4, 4), 0)
    img.putpalette([0, 255, 0, 255, 0, 0] + [0] * (256 * 3 - 6))
    img.putpixel((3, 3), 1)
    img.save(tmp_path / "p.png", transparency=0)
    out = load_rgb(tmp_path / "p.png")
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255)  # transparent green -> white
    assert out.getpixel((3, 3)) == (255, 0, 0)
    # a palette image without transparency keeps its colours
    img.save(tmp_path / "q.png")
    assert load_rgb(tmp_path / "q.png").getpixel((0, 0)) == (0, 255, 0)
    # GIF too (not a scanned extension, but load_rgb reads any Pillow format)
    img.save(tmp_path / "g.gif", transparency=0)
    assert load_rgb(tmp_path / "g.gif").getpixel((0, 0)) == (255, 255, 255)


def test_la_and_l_and_1bit(tmp_path):
    Image.new("LA", (3, 3), (0, 0)).save(tmp_path / "la.png")
    assert load_rgb(tmp_path / "la.png").getpixel((0, 0)) == (255, 255, 255)
    Image.new("L", (3, 3), 77).save(tmp_path / "l.png")
    assert load_rgb(tmp_path / "l.png").getpixel((0, 0)) == (77, 77, 77)
    Image.new("1", (3, 3), 1).save(tmp_path / "b.bmp")
    assert load_rgb(tmp_path / "b.bmp").getpixel((0, 0)) == (255, 255, 255)


def test_cmyk_jpeg(tmp_path):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=100)
    out = load_rgb(tmp_path / "c.jpg")
    assert out.mode == "RGB" and _near(out.getpixel((4, 4)), (255, 0, 0), tol=8)


def test_16bit_greyscale_is_scaled_not_clipped(tmp_path):
    img = Image.new("I;16", (4, 1), 0)
    for x, v in enumerate((0, 257 * 64, 32896, 65535)):
        img.putpixel((x, 0), v)
    img.save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    out = load_rgb(tmp_path / "g16.png")
    assert out.mode == "RGB"
    assert [out.getpixel((x, 0))[0] for x in range(4)] == [0, 64, 128, 255]
    # the same for a 32-bit "I" image holding 16-bit data
    i32 = Image.new("I", (2, 1), 0)
    i32.putpixel((1, 0), 65535)
    assert to_rgb(i32).getpixel((1, 0)) == (255, 255, 255)


def test_float_greyscale():
    f = Image.new("F", (2, 1), 0.0)
    f.putpixel((1, 0), 1.0)
    out = to_rgb(f)
    assert out.getpixel((0, 0)) == (0, 0, 0) and out.getpixel((1, 0)) == (255, 255, 255)


def test_load_rgb_returns_an_independent_rgb_copy(tmp_path):
    path = _img(tmp_path / "rgb.png", (5, 6), color=(1, 2, 3))
    out = load_rgb(path)
    assert out.mode == "RGB" and out.size == (5, 6) and out.getpixel((0, 0)) == (1, 2, 3)
    out.putpixel((0, 0), (9, 9, 9))  # usable after the file was closed


def test_load_rgb_missing_or_not_an_image(tmp_path):
    with pytest.raises(DataError, match=r"missing\.png"):
        load_rgb(tmp_path / "missing.png")
    (tmp_path / "x.png").write_text("nope", encoding="utf-8")
    with pytest.raises(DataError, match=r"x\.png"):
        load_rgb(tmp_path / "x.png")
