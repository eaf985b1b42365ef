"""Edit training's pairs (data/pairs.py): references from a control folder (same names, numbered, several folders)
and from a pairs file (DiffSynth-Studio's, ai-toolkit's and musubi-tuner's keys), what is skipped and why, what is
refused; the cache keys hold the references' content."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from difftrain.data.pairs import same_counts, scan_pairs, with_control_dirs
from difftrain.data.sources import scan_dataset
from difftrain.errors import DataError


def _img(path, colour=(10, 20, 30), size=(32, 24)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


@pytest.fixture
def targets(tmp_path):
    data = tmp_path / "data"
    for name in ("a", "b", "sub/c"):
        _img(data / f"{name}.png")
        (data / f"{name}.caption").write_text(f"edit {name}")
    return data


def test_a_control_folder_pairs_by_name_numbered_and_by_sub_folder(targets, tmp_path):
    control = tmp_path / "control"
    _img(control / "a.jpg")  # another extension: the same name
    for n in (2, 0, 1):  # numbered: in their numbers' order
        _img(control / f"b_{n}.png")
    _img(control / "sub" / "c.webp")
    records, _ = scan_dataset(targets)
    paired, left = with_control_dirs(records, targets, [control])
    refs = {r.key: [p.name for p in r.references] for r in paired}
    assert refs == {"a": ["a.jpg"], "b": ["b_0.png", "b_1.png", "b_2.png"], "sub/c": ["c.webp"]} and not left


def test_a_missing_reference_is_skipped_with_the_reason(targets, tmp_path):
    control = tmp_path / "control"
    _img(control / "a_1.png")  # a_0 missing: the numbers have a gap
    _img(control / "sub" / "c.png")
    records, _ = scan_dataset(targets)
    paired, left = with_control_dirs(records, targets, [control])
    why = {p.name: w for p, w in left}
    assert [r.key for r in paired] == ["sub/c"]
    assert "a_0.* is missing" in why["a.png"] and "no reference image" in why["b.png"]


def test_several_control_folders_give_one_reference_each_in_order(targets, tmp_path):
    first, second = tmp_path / "c1", tmp_path / "c2"
    for name in ("a", "b", "sub/c"):
        _img(first / f"{name}.png")
        _img(second / f"{name}.png")
    (second / "b.png").unlink()
    records, _ = scan_dataset(targets)
    paired, left = with_control_dirs(records, targets, [first, second])
    got = {r.key: [p.relative_to(tmp_path).as_posix() for p in r.references] for r in paired}
    assert got == {"a": ["c1/a.png", "c2/a.png"], "sub/c": ["c1/sub/c.png", "c2/sub/c.png"]}
    assert [p.name for p, _ in left] == ["b.png"]


def test_a_control_folder_that_is_not_there_is_refused(targets, tmp_path):
    records, _ = scan_dataset(targets)
    with pytest.raises(DataError, match="is not a folder"):
        with_control_dirs(records, targets, [tmp_path / "nope"])


def test_a_pairs_file_in_the_peers_keys(tmp_path):
    data = tmp_path / "data"
    for n in ("t1", "t2", "t3", "t4", "r1", "r2", "r3"):
        _img(data / f"{n}.png")
    lines = [
        {"image": "t1.png", "edit_image": ["r1.png", "r2.png"], "prompt": "make it red"},  # DiffSynth-Studio
        {"image_path": "t2.png", "control_path_1": "r2.png", "control_path_0": "r1.png", "caption": "x"},  # musubi
        {"target": "t3.png", "control": "r3.png", "instruction": "y"},  # one reference, by its own name
        {"image": "t4.png", "control_images": ["r1.png", "gone.png"], "caption": "z"},  # a missing reference
        {"image": "t9.png", "control": "r1.png"},  # a missing target
    ]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    records, left = scan_pairs(tmp_path / "pairs.jsonl", data)
    got = {r.key: ([p.name for p in r.references], r.caption) for r in records}
    assert got == {
        "t1": (["r1.png", "r2.png"], "make it red"),
        "t2": (["r1.png", "r2.png"], "x"),
        "t3": (["r3.png"], "y"),
    }
    why = {p.name: w for p, w in left}
    assert "gone.png does not exist" in why["t4.png"] and "line 4" in why["t4.png"]
    assert "target image does not exist" in why["t9.png"]
    # targets with another number of references than most are skipped, not fatal
    kept, uneven = same_counts(records)
    assert [r.key for r in kept] == ["t1", "t2"] and "1 reference image(s) where the other pairs have 2" in uneven[0][1]


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"image": "t.png", "control": "r.png"}\n{not json', "line 2 is not valid JSON"),
        ('{"control": "r.png"}', "names no target image"),
        ('{"image": "../../etc/passwd", "control": "r.png"}', "outside the data folder"),
        ('["t.png"]', "not an object"),
    ],
)
def test_a_malformed_pairs_file_is_refused_with_where(tmp_path, content, match):
    data = tmp_path / "data"
    _img(data / "t.png")
    _img(data / "r.png")
    (tmp_path / "pairs.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        scan_pairs(tmp_path / "pairs.jsonl", data)


def test_the_keys_hold_the_references_content():
    from difftrain.data.keys import CacheKeys

    keys = CacheKeys(family="f", vae="v", stages={"s": "fp"}, vae_dtype="fp32", crop="center")
    assert keys.texts("edit", ["r1"]) != keys.texts("edit") != keys.texts("edit", ["r2"])
    assert keys.texts("edit", ["r1", "r2"]) != keys.texts("edit", ["r2", "r1"])  # the order is the pictures' order
    assert keys.latent((64, 64), "img", None, ["r1"]) != keys.latent((64, 64), "img")
    assert keys.latent((64, 64), "img") == keys.latent((64, 64), "img", None, [])  # without references: as before
