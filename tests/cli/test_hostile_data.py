"""Untrusted dataset files through the CLI: metadata JSON of the wrong shape, too deep, or naming other folders;
caption files that are not UTF-8, empty or blank; file names holding Rich markup. Each is a DataError naming the
file and entry (exit code 1, no traceback) or a documented fallback."""

from __future__ import annotations

import json

import pytest

from conftest import clean_failure as _clean_failure
from conftest import set_args as _sets
from conftest import tiny_sets


# ----------------------------------------------------------------- metadata and caption files
@pytest.mark.parametrize(
    "content, needle",
    [
        ("[1, 2]", "holds a JSON list, not an object of image keys"),
        ('{"00_red_circle": ["caption"]}', "the value of '00_red_circle' is a list, not an object"),
        ('{"00_red_circle": {"caption": 5}}', "'00_red_circle'.caption is a int, not a string"),
        ("[" * 100_000 + "]" * 100_000, "nests too deeply to read"),
        ('{"a": 1', "is not valid JSON"),
        ('{"../../home/x.png": {"caption": "x"}}', "the entry '../../home/x.png' names a path outside the data folder"),
        ('{"/etc/passwd": {"caption": "x"}}', "the entry '/etc/passwd' names a path outside the data folder"),
    ],
)
def test_a_bad_metadata_file(cli, tiny_model, dataset, tmp_path, content, needle):
    meta = tmp_path / "meta.json"
    meta.write_text(content)
    r = cli(
        "precompute",
        "--recipe",
        "tiny-sdxl-lora",
        *_sets(tiny_sets(tiny_model, dataset, tmp_path, **{"data.metadata": meta})),
    )
    _clean_failure(r, 1, f"metadata file {meta}", needle)


def test_metadata_keys_outside_the_folder_are_allowed_when_asked(cli, tiny_model, dataset, tmp_path):
    meta = tmp_path / "meta.json"
    meta.write_text('{"/elsewhere/a.png": {"caption": "x"}}')
    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"data.metadata": meta, "data.allow_outside_paths": "true"})
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", "--plan-only", *_sets(sets))
    assert r.code == 0, r


@pytest.mark.parametrize("command", ["merge-tags", "precompute"])
def test_a_caption_file_that_is_not_utf8(cli, tiny_model, dataset, tmp_path, command):
    bad = next(dataset.glob("*.caption"))
    bad.write_bytes(b"a caf\xe9 in latin-1 \xff\xfe")
    if command == "merge-tags":
        r = cli("merge-tags", dataset, tmp_path / "meta.json")
    else:
        r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_sets(tiny_sets(tiny_model, dataset, tmp_path)))
    _clean_failure(r, 1, f"{bad} is not valid UTF-8 text", "re-save the file as UTF-8")


def test_empty_and_whitespace_caption_files_fall_back_to_the_tags(cli, tiny_model, dataset, tmp_path):
    captions = sorted(dataset.glob("*.caption"))
    captions[0].write_bytes(b"")
    captions[1].write_bytes(b"\xef\xbb\xbf \n\t ")  # a BOM and blanks
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", "--plan-only", *_sets(tiny_sets(tiny_model, dataset, tmp_path)))
    assert r.code == 0, r
    r = cli("merge-tags", dataset, tmp_path / "meta.json")
    assert r.code == 0 and "2 without a caption file" in r.err, r
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert "caption" not in meta[captions[0].stem] and meta[captions[0].stem]["tags"]


def test_file_names_with_rich_markup_are_printed_as_they_are(cli, tiny_model, dataset, tmp_path):
    (dataset / "[bold]x :fire:.png").write_bytes(b"not an image")
    (dataset / "sub[").mkdir()
    (dataset / "sub[" / "y] z.png").write_bytes(b"")  # the path holds "[/y]": a closing tag to Rich
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", "--plan-only", *_sets(tiny_sets(tiny_model, dataset, tmp_path)))
    assert r.code == 0, r
    assert "[bold]x :fire:.png" in r.err and "sub[/y] z.png" in r.err  # neither a MarkupError nor swallowed text
    (dataset / "sub[" / "y] z.caption").write_bytes(b"\xff")
    _clean_failure(
        cli("merge-tags", dataset, tmp_path / "m.json", "--recursive"), 1, "sub[/y] z.caption is not valid UTF-8"
    )
