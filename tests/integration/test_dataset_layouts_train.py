"""kohya folder layouts and sd-scripts' dataset TOML train on the tiny SDXL (issue 54): each <repeats>_<name> folder's
items come <repeats> times an epoch (counted in the sampler's epochs), images without a caption file are captioned
with the folder's name part (as cached in index.json), regularisation folders ride beside the batches as DreamBooth's
class images; the example TOML of sd-scripts' docs (its folders and sizes made the test's) trains through the console
script."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import console_script, tiny_sets

pytestmark = pytest.mark.slow


def _images(folder: Path, n: int, size=(128, 128), shade: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", size, (shade + 30 * i, 100, 150)).save(folder / f"{i}.png")


def test_a_kohya_layout_trains_each_folder_its_repeats_with_its_name_as_caption(cli, tiny_model, tmp_path):
    from difftrain.config.load import resolve
    from difftrain.families.sdxl import SDXL
    from difftrain.trainers.feed import Feed

    img, reg = tmp_path / "img", tmp_path / "reg"
    _images(img / "10_sks dog", 3)
    _images(img / "1_dog", 2, shade=120)
    (img / "1_dog" / "0.caption").write_text("a dog on the grass", encoding="utf-8")
    _images(reg / "2_dog", 2, shade=200)
    sets = tiny_sets(tiny_model, img, tmp_path, **{"data.reg_dir": reg, "train.max_steps": 2})
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *[a for s in sets for a in ("--set", s)])
    assert r.code == 0, r

    index = json.loads((tmp_path / "cache" / "index.json").read_text(encoding="utf-8"))
    cached = {(it.get("subset"), it["caption"], it.get("repeats", 1), it.get("prior", False)) for it in index["items"]}
    assert cached == {
        ("10_sks dog", "sks dog", 10, False),
        ("1_dog", "a dog on the grass", 1, False),
        ("1_dog", "dog", 1, False),
        ("reg:2_dog", "dog", 2, True),
    }
    assert sorted(it["key"] for it in index["items"] if it.get("subset") == "1_dog") == ["1_dog/0", "1_dog/1"]

    cfg = resolve(recipe="tiny-sdxl-lora", sets=sets).config
    feed = Feed(cfg, SDXL(), torch.device("cpu"))
    sampler = feed.start(global_batch=2)
    for epoch in (0, 1):
        drawn = [feed.items[i] for b in sampler.epoch(epoch) for i in b]
        assert Counter(it.subset for it in drawn) == {"10_sks dog": 30, "1_dog": 2}
        assert set(Counter(it.key for it in drawn if it.subset == "10_sks dog").values()) == {10}
    # the order is a function of (seed, epoch): a second feed cuts the same epoch
    again = Feed(cfg, SDXL(), torch.device("cpu")).start(global_batch=2)
    assert again.epoch(1) == sampler.epoch(1) != sampler.epoch(0)
    assert len(feed.prior_items) == 2 and len(feed.prior_batch(2, 0, 0)) == 2

    r = cli("train", "--recipe", "tiny-sdxl-lora", *[a for s in sets for a in ("--set", s)])
    assert r.code == 0, r
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").is_file()


# sd-scripts' docs/config_README-en.md, its first example (tests/fixtures): verbatim but for the folders and the sizes
# (512 and 768 would take minutes on the tiny model's CPU; 128 and 192 keep a dataset of each size)
_EXAMPLE = (Path(__file__).parents[1] / "fixtures" / "sd_scripts_dataset_example.toml").read_text(encoding="utf-8")
SD_EXAMPLE = _EXAMPLE.replace("resolution = 512", "resolution = 128").replace("[768, 768]", "[192, 192]")
assert SD_EXAMPLE.count("128") == 1 and SD_EXAMPLE.count("[192, 192]") == 1


def test_sd_scripts_example_dataset_config_trains_through_the_console_script(tiny_model, tmp_path):
    for k, name in enumerate(("hoge", "fuga", "reg", "piyo")):
        _images(tmp_path / name, 2, size=(192, 160), shade=50 * k)
    (tmp_path / "hoge" / "0.txt").write_text("hoge girl, red hair, smile, blue sky", encoding="utf-8")
    meta = {"0": {"caption": "a piyo drawing"}, "1": {"tags": "piyo, bird, yellow"}}
    (tmp_path / "piyo" / "piyo_md.json").write_text(json.dumps(meta), encoding="utf-8")
    text = SD_EXAMPLE.replace("C:\\piyo\\piyo_md.json", str(tmp_path / "piyo" / "piyo_md.json"))
    for name in ("hoge", "fuga", "reg", "piyo"):
        text = text.replace(f"C:\\{name}", str(tmp_path / name))
    toml = tmp_path / "dataset.toml"
    toml.write_text(text, encoding="utf-8")
    sets = tiny_sets(tiny_model, tmp_path, tmp_path, **{"train.max_steps": 2, "train.batch_size": 1})
    sets.remove(f"data.dir={tmp_path}")
    args = [
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--dataset-config",
        str(toml),
        *[a for s in sets for a in ("--set", s)],
    ]
    r = subprocess.run(
        [console_script(), *args], capture_output=True, text=True, timeout=1200, env={**os.environ, "COLUMNS": "200"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "datasets[0].batch_size=4, datasets[1].batch_size=2" in r.stderr
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").is_file()
    index = json.loads((tmp_path / "cache" / "index.json").read_text(encoding="utf-8"))
    subsets = Counter((it.get("subset"), it.get("prior", False)) for it in index["items"])
    assert subsets == {("hoge", False): 2, ("fuga", False): 2, ("reg", True): 2, ("piyo", False): 2}
    # each dataset's resolution: area up to 128^2 for the DreamBooth-style one, up to 192^2 (and above 128^2) for
    # the fine-tuning one
    areas = {it["key"]: it["bucket"][0] * it["bucket"][1] for it in index["items"]}
    assert all(a <= 128**2 for k, a in areas.items() if not k.startswith("piyo/"))
    assert all(128**2 < a <= 192**2 for k, a in areas.items() if k.startswith("piyo/"))
    captions = {it["key"]: it["caption"] for it in index["items"]}
    assert captions["hoge/0"] == "hoge girl, red hair, smile, blue sky" and captions["hoge/1"] == "hoge girl"
    assert captions["fuga/0"] == "fuga boy" and captions["reg:reg/0"] == "human"
    assert captions["piyo/0"] == "a piyo drawing" and captions["piyo/1"] == "piyo, bird, yellow"
    # shuffle_caption with keep_tokens: hoge's captioned image has augmented variants cached, its first two tags kept
    hoge0 = next(it for it in index["items"] if it["key"] == "hoge/0")
    assert len(hoge0["text_variants"]) >= 2


def test_a_run_over_repeated_folders_resumes_exactly(tiny_model, tmp_path):
    """Repeats lengthen the epoch's list of items; a run stopped mid-epoch and resumed (caption shuffling on, so each
    repeat's caption draw counts too) gives the uninterrupted run's losses."""
    from difftrain.config.load import resolve
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import train

    img = tmp_path / "img"
    _images(img / "5_red cube", 2)
    _images(img / "1_blue ball", 2, shade=120)
    for i in range(2):
        (img / "1_blue ball" / f"{i}.caption").write_text(f"blue ball, shiny, floor, light {i}", encoding="utf-8")
    more = {"data.shuffle_caption": True, "train.max_steps": 6, "train.log_every": 1, "train.checkpoint_every": 3}

    def config(out: Path):
        sets = tiny_sets(tiny_model, img, out, **{**more, "data.cache_dir": tmp_path / "cache"})
        return resolve(recipe="tiny-sdxl-lora", sets=sets).config

    whole = config(tmp_path / "whole")
    precompute(whole)
    full = train(whole)
    parted = config(tmp_path / "parted")
    a = train(parted, stop_at=3)
    b = train(parted, resume="latest")
    assert len(full.losses) == 6 and a.losses + b.losses == full.losses
