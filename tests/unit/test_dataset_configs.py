"""Dataset layouts and configs users bring from sd-scripts and diffusion-pipe (issue 54): kohya's <repeats>_<name>
folders (data/subsets.py) and the dataset TOMLs (config/dataset_toml.py), read into data.subsets and checked by the
schema. The TOMLs below are the trainers' own examples (sd-scripts' docs/config_README-en.md, diffusion-pipe's
examples/dataset.toml) with the folders pointed at the test's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from difftrain.config.dataset_toml import read_dataset_toml
from difftrain.config.load import resolve
from difftrain.data.subsets import resolve_subsets
from difftrain.errors import ConfigError, DataError

# sd-scripts' docs/config_README-en.md, its first example, verbatim but for the folders (a fixture: the training test
# reads it too)
SD_EXAMPLE = (Path(__file__).parents[1] / "fixtures" / "sd_scripts_dataset_example.toml").read_text(encoding="utf-8")

# the same page's example of secondary_separator, wildcards and keep_tokens_separator
SD_SEPARATORS = r"""
[general]
flip_aug = true
color_aug = false
resolution = [1024, 1024]

[[datasets]]
batch_size = 6
enable_bucket = true
bucket_no_upscale = true
caption_extension = ".txt"
keep_tokens_separator= "|||"
shuffle_caption = true
caption_tag_dropout_rate = 0.1
secondary_separator = ";;;" # subset 側に書くこともできます / can be written in the subset side
enable_wildcard = true # 同上 / same as above

  [[datasets.subsets]]
  image_dir = "/path/to/image_dir"
  num_repeats = 1

  # ||| の前後はカンマは不要です（自動的に追加されます） / No comma is required before and after ||| (it is added automatically)
  caption_prefix = "1girl, hatsune miku, vocaloid |||"

  # ||| の後はシャッフル、drop されず残ります / After |||, it is not shuffled or dropped and remains
  # 単純に文字列として連結されるので、カンマなどは自分で入れる必要があります / It is simply concatenated as a string, so you need to put commas yourself
  caption_suffix = ", anime screencap ||| masterpiece, rating: general"
"""

# and its example of one folder in two datasets at two resolutions
SD_TWO_RESOLUTIONS = r"""
# If data sets exist separately, they are not considered duplicates and are both used for training.

[[datasets]]
resolution = 512

  [[datasets.subsets]]
  image_dir = 'C:\hoge'

[[datasets]]
resolution = 768

  [[datasets.subsets]]
  image_dir = 'C:\hoge'
"""

# diffusion-pipe's examples/dataset.toml (its comments shortened), the folder pointed at the test's
DP_EXAMPLE = r"""
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 7
frame_buckets = [1, 33]

[[directory]]
path = '/home/anon/data/images/grayscale'
num_repeats = 1
"""


def _write(tmp_path: Path, text: str, **folders: str) -> Path:
    for old, new in folders.items():
        text = text.replace(old, new)
    path = tmp_path / "dataset.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _images(folder: Path, n: int, size=(96, 64)) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", size, (40 * i, 90, 160)).save(folder / f"{i}.png")
    return folder


def test_sd_scripts_example_maps_each_subset_with_its_inherited_keys(tmp_path):
    folders = {f"C:\\{n}": str(tmp_path / n) for n in ("piyo\\piyo_md.json", "hoge", "fuga", "reg", "piyo")}
    folders["C:\\piyo\\piyo_md.json"] = str(tmp_path / "piyo" / "piyo_md.json")
    reading = read_dataset_toml(_write(tmp_path, SD_EXAMPLE, **folders))
    assert reading.kind == "sd-scripts"
    subs = reading.config["data"]["subsets"]
    assert [Path(s["dir"]).name for s in subs] == ["hoge", "fuga", "reg", "piyo"]
    # keep_tokens: the dataset's 2, the subset's own 3 and 1, [general]'s 1 for the second dataset
    assert [s["keep_tokens"] for s in subs] == [2, 3, 1, 1]
    assert [s["resolution"] for s in subs] == [512, 512, 512, 768]
    assert [s.get("class_tokens") for s in subs] == ["hoge girl", "fuga boy", "human", None]
    assert [s.get("is_reg", False) for s in subs] == [False, False, True, False]
    assert all(s["caption_ext"] == ".txt" and s["shuffle_caption"] is True for s in subs)
    assert subs[3]["metadata"] == str(tmp_path / "piyo" / "piyo_md.json")
    # two batch sizes: the first is taken, and that is said
    assert reading.config["train"] == {"batch_size": 4}
    assert [why for key, why in reading.unmapped if "batch_size" in key] == [
        "difftrain trains one batch size: train.batch_size 4, the first dataset's"
    ]
    # the whole config validates (the recipe's largest side raised for 768), each subset named by its folder
    cfg = resolve(
        recipe="tiny-sdxl-lora", sets=[f"data.dataset_config={tmp_path / 'dataset.toml'}", "data.max_side=1024"]
    ).config
    d = cfg.data
    assert [d.subset_name(i) for i in range(4)] == ["hoge", "fuga", "reg", "piyo"]
    assert d.subset_data(1).keep_tokens == 3 and d.subset_data(3).resolution == 768 and d.resolution == 128


def test_sd_scripts_separators_example_maps_what_difftrain_has_and_lists_the_rest(tmp_path):
    reading = read_dataset_toml(_write(tmp_path, SD_SEPARATORS))
    (sub,) = reading.config["data"]["subsets"]
    assert sub["dir"] == "/path/to/image_dir" and sub["num_repeats"] == 1
    assert sub["keep_tokens_separator"] == "|||" and sub["caption_tag_dropout_rate"] == 0.1
    assert sub["no_upscale"] is True and sub["resolution"] == 1024 and sub["shuffle_caption"] is True
    assert reading.config["train"] == {"batch_size": 6}
    assert sub["caption_prefix"] == "1girl, hatsune miku, vocaloid |||"
    assert sub["caption_suffix"] == ", anime screencap ||| masterpiece, rating: general"
    listed = {key.split("=")[0] for key, _ in reading.unmapped}
    assert {"secondary_separator", "enable_wildcard"} <= listed
    assert not {"caption_prefix", "caption_suffix", "keep_tokens_separator", "flip_aug"} & listed
    assert sub["flip_aug"] is True  # [general]'s flip_aug reaches the subset
    # keys at sd-scripts' defaults change nothing, so nothing is said of them
    assert "color_aug" not in listed and "enable_bucket" not in listed


def test_one_folder_in_two_datasets_is_two_subsets(tmp_path):
    _images(tmp_path / "hoge", 1)
    path = _write(tmp_path, SD_TWO_RESOLUTIONS, **{"C:\\hoge": str(tmp_path / "hoge")})
    cfg = resolve(recipe="tiny-sdxl-lora", sets=[f"data.dataset_config={path}", "data.max_side=1024"]).config
    subs = resolve_subsets(cfg.data)
    assert [(s.name, s.data.resolution, s.key_prefix) for s in subs] == [
        ("hoge", 512, "hoge/"),
        ("hoge#1", 768, "hoge#1/"),
    ]


def test_diffusion_pipe_example_maps_buckets_and_frames(tmp_path):
    folder = str(tmp_path / "grayscale")
    reading = read_dataset_toml(_write(tmp_path, DP_EXAMPLE, **{"/home/anon/data/images/grayscale": folder}))
    assert reading.kind == "diffusion-pipe"
    assert reading.config["data"]["subsets"] == [
        {"dir": folder, "caption_ext": ".txt", "num_repeats": 1, "frames": 33, "resolution": 512}
    ]
    notes = {key.split("=")[0]: why for key, why in reading.unmapped}
    assert {"min_ar", "max_ar", "num_ar_buckets", "frame_buckets"} <= set(notes)
    assert "data.frames 33" in notes["frame_buckets"]


def test_diffusion_pipe_several_resolutions_and_shuffles(tmp_path):
    text = (
        "resolutions = [512, [640, 384]]\nframe_buckets = [1, 30]\ncache_shuffle_num = 10\n"
        "[[directory]]\npath = 'clips'\nnum_repeats = 5\n"
    )
    reading = read_dataset_toml(_write(tmp_path, text), base=tmp_path)
    subs = reading.config["data"]["subsets"]
    # [640, 384] is 495 pixels a side by area, on the 16-pixel grid: 480; 30 frames -> the 4k+1 below, 29
    assert [(s["name"], s["resolution"], s["frames"], s["num_repeats"]) for s in subs] == [
        ("clips@480", 480, 29, 5),
        ("clips@512", 512, 29, 5),
    ]
    assert all(s["dir"] == str(tmp_path / "clips") and s["shuffle_caption"] for s in subs)
    assert reading.config["data"]["caption_variants"] == 10


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("[[datasets]]\n[[datasets.subsets]]\nimage_dri = 'x'\n", "datasets[0].subsets[0].image_dri", "unknown key"),
        (
            "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\nresolution = 512\n",
            "subsets[0].resolution",
            "dataset's",
        ),
        (
            "[general]\nimage_dir = 'x'\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'y'\n",
            "[general].image_dir",
            "subsets",
        ),
        ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\nnum_repeats = '10'\n", "num_repeats", "whole number"),
        ("[[datasets]]\n[[datasets.subsets]]\nnum_repeats = 2\n", "datasets[0].subsets[0]", "no image_dir"),
        ("resolutions = [512]\nmax_frames = 3\n[[directory]]\npath = 'x'\n", "max_frames", "unknown key"),
        ("[[directory]]\nnum_repeats = 0\npath = 'x'\n", "num_repeats", "whole number"),
        ("[[directory]]\nnum_repeats = 2\n", "directory[0]", "no path"),
        ("[[somethingelse]]\nx = 1\n", "neither", "[[datasets]]"),
        ("[[datasets]\n", "not valid TOML", ""),
    ],
)
def test_bad_dataset_configs_name_where(tmp_path, text, where, what):
    with pytest.raises(ConfigError) as e:
        read_dataset_toml(_write(tmp_path, text))
    assert where in str(e.value) and what in str(e.value) and e.value.hint


def test_kohya_layout_gives_a_subset_per_folder_and_data_dir_alone_stays_as_it_was(tmp_path):
    img = tmp_path / "img"
    _images(img / "10_sks dog", 3)
    _images(img / "1_dog", 2)
    (img / ".difftrain-cache").mkdir()  # hidden: not a folder of the layout
    reg = tmp_path / "reg"
    _images(reg / "2_dog", 1)
    cfg = resolve(recipe="tiny-sdxl-lora", sets=[f"data.dir={img}", f"data.reg_dir={reg}"]).config
    subs = resolve_subsets(cfg.data)
    assert [(s.name, s.repeats, s.class_tokens, s.is_reg, s.key_prefix) for s in subs] == [
        ("10_sks dog", 10, "sks dog", False, "10_sks dog/"),
        ("1_dog", 1, "dog", False, "1_dog/"),
        ("reg:2_dog", 2, "dog", True, "reg:2_dog/"),
    ]
    # data.layout: folder reads the same folder as one, the plain way
    plain = resolve(recipe="tiny-sdxl-lora", sets=[f"data.dir={img}", "data.layout=folder"]).config
    assert [(s.name, s.repeats, s.key_prefix) for s in resolve_subsets(plain.data)] == [("", 1, "")]
    # a folder of images without sub-folders is data.dir read whole
    flat = _images(tmp_path / "flat", 2)
    assert [s.name for s in resolve_subsets(resolve(sets=[f"data.dir={flat}"]).config.data)] == [""]


@pytest.mark.parametrize(
    ("folders", "top", "message"),
    [
        (["10_"], False, "gives repeats (10) but no name"),
        (["0_x"], False, "asks for 0 repeats"),
        (["10_dog", "cats"], False, "its folder 'cats' is not named so"),
        (["10_dog"], True, "images at its top"),
    ],
)
def test_near_kohya_layouts_are_refused_with_what_to_rename(tmp_path, folders, top, message):
    img = tmp_path / "img"
    for f in folders:
        _images(img / f, 1)
    if top:
        _images(img, 1)
    cfg = resolve(sets=[f"data.dir={img}"]).config
    with pytest.raises(DataError) as e:
        resolve_subsets(cfg.data)
    assert message in str(e.value) and "data.layout: folder" in str(e.value.hint) + str(e.value)
    assert resolve_subsets(resolve(sets=[f"data.dir={img}", "data.layout=folder"]).config.data)[0].name == ""


def test_a_subset_whose_folder_is_missing_names_it(tmp_path):
    cfg = resolve(sets=[f"data.subsets=[{{dir: {tmp_path / 'nothing'}, num_repeats: 2}}]"]).config
    with pytest.raises(DataError, match=r"data.subsets\[0\] \(nothing\): the folder .*nothing does not exist"):
        resolve_subsets(cfg.data)


def test_subset_values_are_checked_with_the_data_section(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve(recipe="tiny-sdxl-lora", sets=["data.subsets=[{dir: a, resolution: 512}]"])
    assert "data.subsets[0] (a): resolution (512) must lie between" in str(e.value.problems)
    with pytest.raises(ConfigError) as e:
        resolve(sets=["data.subsets=[{dir: a/x}, {dir: b/x, name: x}]"])
    assert "another subset is named 'x'" in str(e.value.problems)


def test_a_diffusion_pipe_video_dataset_plans_each_folder_with_its_frames_and_repeats(tmp_path):
    """diffusion-pipe's users bring clips: each [[directory]] is scanned as clips of the video family, captioned by
    its .txt files, with its own longest frame bucket and its repeats on the planned items."""
    av = pytest.importorskip("av")
    import numpy as np
    import torch

    from difftrain.families.registry import get_family
    from difftrain.precompute.plan import buckets_for, place_all, scan
    from difftrain.runtime.distributed import World

    codec = next((c for c in ("libx264", "mpeg4") if c in av.codecs_available), None)
    if codec is None:
        pytest.skip("this PyAV build has neither libx264 nor mpeg4")

    def clip(path: Path, frames: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with av.open(str(path), "w") as out:
            stream = out.add_stream(codec, rate=16)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for i in range(frames):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 10 * i, np.uint8), format="rgb24")
                out.mux(stream.encode(frame))
            out.mux(stream.encode())

    clip(tmp_path / "walks" / "a.mp4", 12)
    (tmp_path / "walks" / "a.txt").write_text("a person walking", encoding="utf-8")
    clip(tmp_path / "waves" / "b.mp4", 12)
    walks, waves = tmp_path / "walks", tmp_path / "waves"
    path = _write(
        tmp_path,
        "resolutions = [64]\nframe_buckets = [1, 5]\n"
        f"[[directory]]\npath = '{walks}'\nnum_repeats = 3\nframe_buckets = [1, 9]\n"
        f"[[directory]]\npath = '{waves}'\n",
    )
    cfg = resolve(recipe="tiny-wan-lora", sets=[f"data.dataset_config={path}", "data.fps=null"]).config
    family = get_family("wan")
    records, skipped = scan(cfg, family, World(), torch.device("cpu"), plan_only=True)
    assert skipped == []
    placed, dropped = place_all(records, cfg.data, buckets_for(cfg.data, True), resolve_subsets(cfg.data))
    assert dropped == []
    got = {(p.record.key, p.record.subset, p.record.caption, p.frames, p.repeats) for p in placed}
    assert got == {("walks/a", "walks", "a person walking", 9, 3), ("waves/b", "waves", "", 5, 1)}


def test_a_subsets_own_augmentation_is_checked_against_the_cache(tmp_path):
    from difftrain.data.cache import DataCache
    from difftrain.data.index import CacheIndex, IndexItem
    from difftrain.families.sdxl import SDXL
    from difftrain.trainers.cache_check import cache_differences

    cfg = resolve(
        recipe="tiny-sdxl-lora",
        sets=["data.subsets=[{dir: a, shuffle_caption: true}, {dir: b, caption_dropout_rate: 0.1}]"],
    ).config

    def index(variants: bool, empty: bool) -> CacheIndex:
        item = IndexItem(key="a/0", latent="l", texts={"clip": "t"}, bucket=(64, 64), subset="a")
        if variants:
            item = replace(item, text_variants=({"clip": "v1"}, {"clip": "v2"}))
        other = IndexItem(key="b/0", latent="m", texts={"clip": "u"}, bucket=(64, 64), subset="b")
        captions = {"variants": 0, "dropout": False}
        return CacheIndex(
            items=[item, other], family="sdxl", captions=captions, empty_text={"clip": "e"} if empty else None
        )

    diffs = cache_differences(cfg, SDXL(), DataCache(tmp_path), index(False, False), [])
    assert any("data.subsets 'a': shuffle_caption" in d for d in diffs)
    assert any("data.subsets 'b': caption_dropout_rate" in d for d in diffs)
    assert cache_differences(cfg, SDXL(), DataCache(tmp_path), index(True, True), []) == []


def test_prefix_and_suffix_with_two_separators_keep_both_ends_in_place(tmp_path):
    """The docs' example: caption_prefix ending in |||, a caption, caption_suffix with a second |||: what precedes
    the first and follows the second stay in place, the middle is shuffled (sd-scripts' process_caption)."""
    import torch

    from difftrain.data.captions import CaptionAugment, caption_variants
    from difftrain.families.registry import get_family
    from difftrain.precompute.plan import scan
    from difftrain.runtime.distributed import World

    folder = _images(tmp_path / "miku", 1)
    (folder / "0.txt").write_text("upper body, looking at viewer, microphone, stage", encoding="utf-8")
    toml = SD_SEPARATORS.replace("/path/to/image_dir", str(folder)).replace("resolution = [1024, 1024]", "")
    cfg = resolve(recipe="tiny-sdxl-lora", sets=[f"data.dataset_config={_write(tmp_path, toml)}"]).config
    ((record, _),), _ = scan(cfg, get_family("sdxl"), World(), torch.device("cpu"), plan_only=True)
    assert record.caption == (
        "1girl, hatsune miku, vocaloid ||| upper body, looking at viewer, microphone, stage , anime screencap ||| "
        "masterpiece, rating: general"
    )
    aug = CaptionAugment.from_config(cfg.data.subset_data(0))
    variants = caption_variants(record.caption, aug)
    assert len(variants) > 1
    for v in variants:
        tags = v.split(", ")
        assert tags[:3] == ["1girl", "hatsune miku", "vocaloid"] and tags[-2:] == ["masterpiece", "rating: general"]
        middle = {"upper body", "looking at viewer", "microphone", "stage", "anime screencap"}
        assert set(tags[3:-2]) <= middle  # shuffled, some dropped (caption_tag_dropout_rate 0.1)
