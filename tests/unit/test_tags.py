"""merge_tags: sd-scripts' finetune metadata layout, in_json round trip, missing files, BOM, keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from difftrain.data.paths import IMAGE_EXTS, list_images, normalize_ext, read_text_file
from difftrain.data.tags import (
    MergeReport,
    TagRules,
    apply_rules,
    image_key,
    merge_tags,
    normalize_tags,
    parse_tag_file,
    read_drop_list,
)
from difftrain.errors import DataError


def _img(path: Path, size: tuple[int, int] = (8, 8)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".bmp": "BMP"}.get(path.suffix.lower(), "PNG")
    Image.new("RGB", size, (10, 20, 30)).save(path, format=fmt)
    return path


def _write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding=encoding)
    return path


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


# ----------------------------------------------------------------- helpers
def test_image_exts_constant():
    assert IMAGE_EXTS == (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def test_list_images_sorted_case_insensitive_and_recursive(tmp_path):
    _img(tmp_path / "b.jpg")
    _img(tmp_path / "A.PNG")
    _img(tmp_path / "c.WebP")
    _write(tmp_path / "c.txt", "not an image")
    _img(tmp_path / "sub" / "d.bmp")
    (tmp_path / "folder.png").mkdir()  # a folder with an image-like name is not an image
    (tmp_path / "._A.PNG").write_bytes(b"\x00\x05\x16\x07")  # macOS resource fork
    _img(tmp_path / ".difftrain-cache" / "x.png")  # hidden folders are not searched

    flat = list_images(tmp_path)
    assert [p.name for p in flat] == ["A.PNG", "b.jpg", "c.WebP"]
    deep = list_images(tmp_path, recursive=True)
    assert [p.relative_to(tmp_path).as_posix() for p in deep] == ["A.PNG", "b.jpg", "c.WebP", "sub/d.bmp"]


def test_list_images_missing_dir_is_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list_images(tmp_path / "nope")


def test_image_key_stem_or_path_as_given(tmp_path):
    p = tmp_path / "sub" / "cat.01.png"
    assert image_key(p, full_path=False) == "cat.01"
    # sd-scripts writes str(image_path) for --full_path: the path as found, not resolved
    assert image_key(p, full_path=True) == str(p)
    assert image_key(Path("rel/dir/x.png"), full_path=True) == str(Path("rel/dir/x.png"))


def test_read_text_file_strips_bom_and_whitespace(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("\ufeff  1girl, solo \n\n".encode("utf-8"))
    assert read_text_file(f) == "1girl, solo"
    assert read_text_file(tmp_path / "missing.txt") is None


def test_read_text_file_rejects_non_utf8(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="UTF-8"):
        read_text_file(f)


def test_normalize_tags_and_ext():
    assert normalize_tags(" a,b ,  c,, long   hair\n") == "a, b, c, long hair"
    assert normalize_tags("a\nb\r\nc") == "a, b, c"
    assert normalize_tags("") == ""
    assert (
        normalize_tags("1girl:0.98, smile:0.5")
        == normalize_tags("tag,confidence\n1girl,0.98\nsmile,0.5")
        == "1girl, smile"
    )
    assert normalize_ext("txt") == ".txt" == normalize_ext(".txt")
    with pytest.raises(DataError, match="empty"):
        normalize_ext(".")


# ----------------------------------------------------------------- merge_tags
def test_merge_writes_sd_scripts_layout(tmp_path):
    data = tmp_path / "data"
    _img(data / "one.png")
    _img(data / "two.jpg")
    _write(data / "one.txt", "1girl,solo ,  smile")
    _write(data / "one.caption", "a girl smiling\n")
    _write(data / "two.txt", "cat, outdoors")
    out = tmp_path / "meta.json"

    report = merge_tags(data, out)

    assert isinstance(report, MergeReport)
    assert _read_json(out) == {
        "one": {"caption": "a girl smiling", "tags": "1girl, solo, smile"},
        "two": {"tags": "cat, outdoors"},
    }
    assert (report.images, report.with_tags, report.with_caption) == (2, 2, 1)
    assert report.missing_captions == ["two"] and report.missing_tags == []
    assert report.out_path == out and report.read_from is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "meta.json"]  # no temp file left


def test_missing_tag_file_is_counted_not_a_crash(tmp_path):
    _img(tmp_path / "a.png")
    _img(tmp_path / "b.png")
    _img(tmp_path / "c.png")
    _write(tmp_path / "a.txt", "x")
    _write(tmp_path / "c.txt", "   \n")  # empty after stripping counts as missing
    out = tmp_path / "out" / "meta.json"  # parent folder is created

    report = merge_tags(tmp_path, out)

    assert report.with_tags == 1
    assert report.missing_tags == ["b", "c"]
    assert report.missing_captions == ["a", "b", "c"]
    assert _read_json(out) == {"a": {"tags": "x"}, "b": {}, "c": {}}


def test_bom_is_stripped_from_tags_and_captions(tmp_path):
    _img(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("\ufeffred, blue".encode("utf-8"))
    (tmp_path / "a.caption").write_bytes("\ufeffA caption".encode("utf-8"))
    out = tmp_path / "meta.json"
    merge_tags(tmp_path, out)
    assert _read_json(out) == {"a": {"caption": "A caption", "tags": "red, blue"}}


def test_in_json_round_trip_keeps_other_fields_and_keys(tmp_path):
    data = tmp_path / "data"
    _img(data / "img1.png")
    _img(data / "img2.png")
    _write(data / "img1.txt", "new, tags")
    _write(data / "img2.caption", "fresh caption")
    meta = tmp_path / "meta.json"
    meta.write_text(
        json.dumps(
            {
                "img1": {"caption": "old caption", "tags": "old", "train_resolution": [1024, 1024]},
                "img2": {"tags": "keep me"},
                "gone": {"caption": "image no longer on disk"},
            }
        ),
        encoding="utf-8",
    )

    report = merge_tags(data, meta, in_json=meta)  # in_json may equal out_json

    assert report.read_from == meta
    assert _read_json(meta) == {
        "img1": {"caption": "old caption", "tags": "new, tags", "train_resolution": [1024, 1024]},
        "img2": {"tags": "keep me", "caption": "fresh caption"},
        "gone": {"caption": "image no longer on disk"},
    }


def test_existing_out_json_is_read_when_in_json_is_not_given(tmp_path):
    # sd-scripts: "if omitted and out_json exists, existing out_json is read"
    _img(tmp_path / "a.png")
    _write(tmp_path / "a.txt", "t")
    out = tmp_path / "meta.json"
    out.write_text(json.dumps({"a": {"caption": "c"}, "z": {"tags": "q"}}), encoding="utf-8")
    report = merge_tags(tmp_path, out)
    assert report.read_from == out
    assert _read_json(out) == {"a": {"caption": "c", "tags": "t"}, "z": {"tags": "q"}}


def test_separate_in_json_is_not_modified(tmp_path):
    _img(tmp_path / "a.png")
    _write(tmp_path / "a.txt", "t")
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"a": {"caption": "c"}}), encoding="utf-8")
    out = tmp_path / "out.json"
    merge_tags(tmp_path, out, in_json=src)
    assert _read_json(src) == {"a": {"caption": "c"}}
    assert _read_json(out) == {"a": {"caption": "c", "tags": "t"}}


def test_full_path_keys_and_recursive(tmp_path):
    data = tmp_path / "data"
    a = _img(data / "x" / "same.png")
    b = _img(data / "y" / "same.png")
    _write(data / "x" / "same.txt", "from x")
    _write(data / "y" / "same.txt", "from y")
    out = tmp_path / "meta.json"

    merge_tags(data, out, full_path=True, recursive=True)

    assert _read_json(out) == {str(a): {"tags": "from x"}, str(b): {"tags": "from y"}}


def test_shared_stem_without_full_path_is_an_error(tmp_path):
    _img(tmp_path / "x" / "same.png")
    _img(tmp_path / "y" / "same.png")
    with pytest.raises(DataError, match="share the metadata key") as err:
        merge_tags(tmp_path, tmp_path / "m.json", recursive=True)
    assert "full-path" in (err.value.hint or "")
    assert not (tmp_path / "m.json").exists()


def test_extensions_with_or_without_dot(tmp_path):
    _img(tmp_path / "a.png")
    _write(tmp_path / "a.tags", "t1, t2")
    _write(tmp_path / "a.cap", "c")
    out = tmp_path / "m.json"
    merge_tags(tmp_path, out, tag_ext="tags", caption_ext=".cap")
    assert _read_json(out) == {"a": {"caption": "c", "tags": "t1, t2"}}


def test_unicode_is_written_readably(tmp_path):
    _img(tmp_path / "a.png")
    _write(tmp_path / "a.caption", "猫の写真")
    out = tmp_path / "m.json"
    merge_tags(tmp_path, out)
    assert "猫の写真" in out.read_text(encoding="utf-8")


# ----------------------------------------------------------------- errors
def test_missing_data_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        merge_tags(tmp_path / "missing", tmp_path / "m.json")


def test_data_dir_without_images(tmp_path):
    _write(tmp_path / "a.txt", "tags without an image")
    with pytest.raises(DataError, match="no images"):
        merge_tags(tmp_path, tmp_path / "m.json")


@pytest.mark.parametrize(
    ("content", "match"),
    [("{not json", "not valid JSON"), ("[1, 2]", "JSON list, not an object"), ('"s"', "JSON str")],
)
def test_bad_in_json(tmp_path, content, match):
    _img(tmp_path / "a.png")
    bad = tmp_path / "in.json"
    bad.write_text(content, encoding="utf-8")
    out = tmp_path / "out.json"
    with pytest.raises(DataError, match=match):
        merge_tags(tmp_path, out, in_json=bad)
    assert not out.exists()


def test_missing_in_json(tmp_path):
    _img(tmp_path / "a.png")
    with pytest.raises(DataError, match="does not exist"):
        merge_tags(tmp_path, tmp_path / "out.json", in_json=tmp_path / "nope.json")


def test_in_json_entry_that_is_not_an_object(tmp_path):
    _img(tmp_path / "a.png")
    bad = tmp_path / "in.json"
    bad.write_text(json.dumps({"a": "just a string"}), encoding="utf-8")
    with pytest.raises(DataError, match="'a' is a str"):
        merge_tags(tmp_path, tmp_path / "out.json", in_json=bad)


# ---------------------------------------------------------------- tag rules (merge-tags options)


def test_scores_are_read_from_inline_and_wd14_csv_layouts():
    assert parse_tag_file("1girl:0.99, long_hair:0.4, :d, re:zero, smile") == [
        ("1girl", 0.99),
        ("long_hair", 0.4),
        (":d", None),
        ("re:zero", None),
        ("smile", None),
    ]
    csv = "tag,confidence\n1girl,0.98\nlong_hair,0.35\nblue_eyes,0.71\n"
    assert parse_tag_file(csv) == [("1girl", 0.98), ("long_hair", 0.35), ("blue_eyes", 0.71)]
    assert parse_tag_file("1girl,0.98\nsolo,0.9") == [("1girl", 0.98), ("solo", 0.9)]  # no header, still CSV
    assert parse_tag_file("a, b\nc") == [("a", None), ("b", None), ("c", None)]  # a plain list over lines
    assert parse_tag_file("") == []


def test_rules_threshold_drop_dedupe_underscores_ratings_keep_order():
    pairs = parse_tag_file(
        "general, 1girl:0.99, long_hair:0.4, Long Hair, ^_^, blue_eyes:0.8, rating:explicit, watermark"
    )
    assert apply_rules(pairs, TagRules()) == [
        "general",
        "1girl",
        "long_hair",
        "^_^",
        "blue_eyes",
        "rating:explicit",
        "watermark",
    ]
    rules = TagRules(threshold=0.5, drop=frozenset({"Watermark"}), underscores=True, ratings="drop")
    assert apply_rules(pairs, rules) == ["1girl", "Long Hair", "^_^", "blue eyes"]
    assert apply_rules(pairs, TagRules(dedupe=False))[2:4] == ["long_hair", "Long Hair"]


def test_drop_list_from_text_and_files(tmp_path):
    f = tmp_path / "drop.txt"
    f.write_text("\ufeffwatermark\nsignature, text\n", encoding="utf-8")
    assert read_drop_list(["simple background, white_background", str(f), f"@{f}"]) == frozenset(
        {"simple background", "white_background", "watermark", "signature", "text"}
    )
    with pytest.raises(DataError, match="does not exist"):
        read_drop_list([f"@{tmp_path / 'nope.txt'}"])


def test_merge_tags_with_rules_caption_from_and_dry_run(tmp_path):
    from PIL import Image

    for name, tags, caption in (
        ("a", "1girl:0.9, solo:0.2, solo, rating:safe, 猫", "a cat"),
        ("b", "", None),
        ("c", "x_x, smile", ""),
    ):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text("\ufeff" + tags, encoding="utf-8")
        if caption is not None:
            (tmp_path / f"{name}.caption").write_text(caption, encoding="utf-8")
    out = tmp_path / "meta.json"
    rules = TagRules(threshold=0.5, ratings="drop", underscores=True, caption_from="both", separator=" | ")
    dry = merge_tags(tmp_path, out, rules=rules, dry_run=True)
    assert not out.exists() and not dry.written and [k for k, _, _ in dry.changes] == ["a", "c"]
    r = merge_tags(tmp_path, out, rules=rules)
    meta = json.loads(out.read_text(encoding="utf-8"))
    assert meta["a"] == {
        "caption": "a cat | 1girl, solo, 猫",
        "tags": "1girl, solo, 猫",
    }  # solo:0.2 below, the bare solo kept
    assert meta["c"] == {
        "caption": "x_x, smile",
        "tags": "x_x, smile",
    }  # empty caption file: the tags alone; kaomoji kept
    assert "b" not in meta or meta["b"] == {}
    assert r.tags_removed == 2 and r.missing_tags == ["b"] and r.missing_captions == ["b", "c"]


def test_merge_tags_cli_dry_run_prints_changes(cli, tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("long_hair, long_hair, watermark", encoding="utf-8")
    r = cli(
        "merge-tags", tmp_path, tmp_path / "m.json", "--drop-tags", "watermark", "--underscores-to-spaces", "--dry-run"
    )
    assert r.code == 0 and "would change" in r.err and "long hair" in r.err and not (tmp_path / "m.json").exists()
    r = cli("merge-tags", tmp_path, tmp_path / "m.json", "--ratings", "maybe")
    assert r.code != 0 and "ratings must be keep or drop" in r.err
