"""kohya folder layouts and dataset TOMLs through the real console script (issue 54): `precompute --plan-only` shows
the subsets (repeats, images, where their captions come from), and a layout that is not quite one, a TOML with an
unknown key, a malformed repeat count or a missing folder each stop with the message, a next step and nothing
written. Plans load no model: a model path that does not exist serves."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from conftest import CliResult, clean_failure, console_script


def run(*args: str) -> CliResult:
    env = {**os.environ, "COLUMNS": "200"}  # the tables unwrapped
    r = subprocess.run([console_script(), *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    return CliResult(r.returncode, r.stdout, r.stderr)


def _images(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (128, 128), (50 * i, 80, 120)).save(folder / f"{i}.png")


def _rows(err: str) -> dict[str, list[str]]:
    """The cells of each table row, by its first cell."""
    rows = [line.split("│")[1:-1] for line in err.splitlines() if line.startswith("│")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


def _plan(tmp_path: Path, *sets: str) -> CliResult:
    args = ["precompute", "--recipe", "tiny-sdxl-lora", "--plan-only", "--set", f"model.path={tmp_path / 'no-model'}"]
    return run(*args, *[a for s in sets for a in ("--set", s)])


def test_plan_only_shows_a_kohya_layout_and_its_regularisation_folder(tmp_path):
    img, reg = tmp_path / "img", tmp_path / "reg"
    _images(img / "10_sks dog", 3)
    _images(img / "1_dog", 2)
    (img / "1_dog" / "0.caption").write_text("a dog on the grass", encoding="utf-8")
    _images(reg / "1_dog", 4)
    r = _plan(tmp_path, f"data.dir={img}", f"data.reg_dir={reg}")
    assert r.code == 0, r
    text = " ".join(r.err.split())
    assert "bucket plan (9 usable, 0 dropped)" in text
    assert "subsets (kohya layout, reg_dir)" in text
    rows = _rows(r.err)
    assert rows["10_sks dog"] == ["training", "10", "3", "30", "folder name 3"]
    assert rows["1_dog"] == ["training", "1", "2", "2", "caption 1, folder name 1"]
    assert rows["reg:1_dog"] == ["regularisation", "1", "4", "beside batches", "folder name 4"]
    assert "read in kohya's layout" in text
    # data.layout: folder reads the same folder plainly: no subsets table
    plain = _plan(tmp_path, f"data.dir={img}", "data.layout=folder")
    assert plain.code == 0 and "subsets" not in plain.err and "bucket plan (5 usable" in plain.err


@pytest.mark.slow
def test_folders_that_look_like_the_layout_but_are_not(tmp_path):
    cache = tmp_path / "cache"
    for folders, needle in (
        (["10_"], "gives repeats (10) but no name after the underscore"),
        (["0_x", "2_y"], "asks for 0 repeats"),
        (["3_dog", "cats"], "its folder 'cats' is not named so"),
    ):
        img = tmp_path / "-".join(folders)
        for f in folders:
            _images(img / f, 1)
        for plan in (True, False) if folders == ["10_"] else (True,):
            args = ["--plan-only"] if plan else []
            r = run(
                "precompute",
                "--recipe",
                "tiny-sdxl-lora",
                *args,
                "--set",
                f"data.dir={img}",
                "--set",
                f"data.cache_dir={cache}",
                "--set",
                f"model.path={tmp_path / 'no-model'}",
            )
            clean_failure(r, 1, needle, "data.layout: folder")
    assert not (cache / "index.json").exists() and not list(tmp_path.rglob("*.safetensors"))


@pytest.mark.slow
def test_a_dataset_toml_with_an_unknown_key_or_bad_repeats(tmp_path):
    _images(tmp_path / "a", 1)
    toml = tmp_path / "ds.toml"
    for body, needle in (
        ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeat = 3\n", "datasets[0].subsets[0].num_repeat"),
        ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeats = 'x'\n", "it must be a whole number"),
        ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeats = -2\n", "num_repeats is -2"),
    ):
        toml.write_text(body, encoding="utf-8")
        for cmd in ("precompute", "train") if "num_repeat =" in body else ("precompute",):
            r = run(
                cmd,
                "--recipe",
                "tiny-sdxl-lora",
                "--dataset-config",
                toml,
                "--set",
                f"train.output_dir={tmp_path / 'run'}",
                "--set",
                f"data.cache_dir={tmp_path / 'cache'}",
            )
            clean_failure(r, 2, str(toml), needle)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_a_dataset_toml_subset_whose_folder_is_missing(tmp_path):
    _images(tmp_path / "a", 2)
    toml = tmp_path / "ds.toml"
    toml.write_text(
        f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = '{tmp_path / 'a'}'\nnum_repeats = 2\n"
        f"[[datasets.subsets]]\nimage_dir = '{tmp_path / 'gone'}'\n",
        encoding="utf-8",
    )
    r = run(
        "precompute",
        "--recipe",
        "tiny-sdxl-lora",
        "--dataset-config",
        toml,
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--set",
        f"model.path={tmp_path / 'no-model'}",
    )
    clean_failure(r, 1, "data.subsets[1] (gone): the folder", "does not exist")
    assert not (tmp_path / "cache" / "index.json").exists()
    # the good folder alone plans, the TOML's folder named in the table, its repeats counted
    toml.write_text(f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = '{tmp_path / 'a'}'\nnum_repeats = 2\n")
    r = run(
        "precompute",
        "--recipe",
        "tiny-sdxl-lora",
        "--plan-only",
        "--dataset-config",
        toml,
        "--set",
        f"model.path={tmp_path / 'no-model'}",
    )
    assert r.code == 0, r
    assert "subsets (data.subsets)" in r.err and _rows(r.err)["a"] == ["training", "2", "2", "4", "empty 2"]
