"""The precompute plan (difftrain.precompute.plan), made without an encoder: over the fixture cache's data and
config it names every entry as the fixture's index.json does, and writes that index byte for byte; and the
bucketing of single records (fits, too small, too short a clip) gives a placement or the reason it fits none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.data.cache import DataCache
from difftrain.data.captions import CaptionAugment
from difftrain.data.index import IndexItem
from difftrain.data.sources import ImageRecord
from difftrain.precompute.plan import Buckets, Placement, PlanItem, make_plan, place, scan
from difftrain.runtime.distributed import World
from difftrain.utils import atomic_write_json

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "cache-v1"


@pytest.fixture
def fixture_setup(tmp_path):
    """The fixture's data and config over a stand-in model (empty weight files, their recorded hashes memoised
    in the cache's fingerprints.json), and the fixture's index.json with this machine's paths."""
    from difftrain.families.sdxl import SDXL

    data = Path(shutil.copytree(FIXTURE / "data", tmp_path / "data"))
    model, cache = tmp_path / "model", tmp_path / "cache"
    cache.mkdir()
    memo = {}
    for rel, digest in json.loads((FIXTURE / "weight_hashes.json").read_text(encoding="utf-8")).items():
        f = model / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
        st = f.stat()
        memo[f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|"] = digest
    (cache / "fingerprints.json").write_text(json.dumps(memo), encoding="utf-8")
    sets = json.loads((FIXTURE / "sets.json").read_text(encoding="utf-8"))
    cfg = resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(model, data, tmp_path, **sets)).config
    index = (FIXTURE / "index.json").read_text(encoding="utf-8").replace("@MODEL@", str(model))
    return SDXL(), cfg, DataCache(cache), index.replace("@DATA@", str(data))


def test_the_plan_names_every_entry_as_the_fixture_and_writes_its_index(fixture_setup, tmp_path):
    family, cfg, cache, index_text = fixture_setup
    world = World()
    records, skipped = scan(cfg, family, world, torch.device("cpu"))
    assert skipped == [] and [prior for _, prior in records] == [False] * 4
    plan = make_plan(records, cfg, family, cache, world)
    expected = json.loads(index_text)
    assert plan.skipped == [] and len(plan.items) == len(expected["items"])
    for p, it in zip(plan.items, expected["items"]):
        assert isinstance(p, PlanItem) and not p.prior and p.frames is None and p.indices is None
        assert (p.latent, p.image_sha256, p.texts) == (it["latent"], it["image_sha256"], it["texts"])
        assert [dict(v) for v in p.variants] == it["text_variants"]
        assert p.index_item() == IndexItem.from_json(it)
        assert plan.captions[p.texts["clip"]] == p.record.caption
    assert plan.empty_text == expected["empty_text"] and plan.captions[plan.empty_text["clip"]] == ""
    # every text entry of the plan: captions, 2 variants each, the empty caption; each named once
    assert len(plan.text_sets()) == 4 * 3 + 1
    assert set(plan.captions) == {k for t in plan.text_sets() for k in t.values()}
    atomic_write_json(tmp_path / "index.json", plan.index(cfg, CaptionAugment.from_config(cfg.data)).to_json())
    assert (tmp_path / "index.json").read_text(encoding="utf-8") == index_text


def _image(tmp_path: Path, w: int, h: int) -> ImageRecord:
    return ImageRecord(key="a", path=tmp_path / "a.png", caption="a cat", width=w, height=h)


def test_an_image_is_placed_in_its_bucket_or_dropped_with_the_reason(tmp_path):
    from difftrain.data.buckets import make_buckets

    cfg = resolve(recipe="tiny-sdxl-lora", sets=[f"data.dir={tmp_path}", "data.max_upscale=2"]).config
    buckets = Buckets(make_buckets(128, 32, 64, 256))
    p = place(_image(tmp_path, 320, 192), True, cfg.data, buckets)
    assert p == Placement(_image(tmp_path, 320, 192), (160, 96), prior=True)
    assert (p.size_name, p.shape_name) == ("160x96", "160x96")
    why = place(_image(tmp_path, 40, 40), False, cfg.data, buckets)
    assert why == "too small: 40x40 would be enlarged 3.2x to fill its bucket 128x128 (data.max_upscale is 2)"


def test_a_clip_gets_a_frame_bucket_and_its_frames_or_the_reason(tmp_path):
    from difftrain.data.video import VideoRecord, frame_buckets, video_size_buckets

    cfg = resolve(recipe="tiny-sdxl-lora", sets=[f"data.dir={tmp_path}", "data.frames=9"]).config
    buckets = Buckets(video_size_buckets(128, 16, 64, 256), frame_buckets(9))

    def clip(frames: int) -> VideoRecord:
        return VideoRecord("c", tmp_path / "c.mp4", "a cat", 96, 64, frames=frames, fps=8.0, is_image=False)

    p = place(clip(12), False, cfg.data, buckets)
    assert isinstance(p, Placement) and p.frames == 9 and p.indices == [0, 1, 3, 4, 6, 7, 8, 10, 11]
    assert p.shape_name == f"{p.size_name}x9f"
    assert place(clip(3), False, cfg.data, buckets) == "3 frames: shorter than the smallest frame bucket (5)"


def test_flip_aug_adds_a_mirrored_entry_and_keeps_every_other_key(fixture_setup):
    family, cfg, cache, index_text = fixture_setup
    world = World()
    flip = cfg.model_copy(update={"data": cfg.data.model_copy(update={"flip_aug": True})})
    records, _ = scan(flip, family, world, torch.device("cpu"))
    plan = make_plan(records, flip, family, cache, world)
    expected = json.loads(index_text)["items"]
    for p, it in zip(plan.items, expected, strict=True):
        assert (p.latent, p.texts) == (it["latent"], it["texts"])  # keys without the flip: the fixture's
        assert p.flipped == plan.keys.latent(p.bucket, p.image_sha256, flip=True) and p.flipped != p.latent
        assert p.latent_jobs() == [(p.latent, False), (p.flipped, True)]
        assert IndexItem.from_json(p.index_item().to_json()).flipped == p.flipped
    assert len({p.flipped for p in plan.items}) == len(plan.items)


def test_a_subsets_flip_aug_is_its_own(tmp_path):
    from difftrain.data.buckets import make_buckets
    from difftrain.data.subsets import resolve_subsets
    from difftrain.precompute.plan import place_all

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    cfg = resolve(
        recipe="tiny-sdxl-lora",
        extra={"data": {"dir": str(tmp_path), "subsets": [{"dir": "a", "flip_aug": True}, {"dir": "b"}]}},
    ).config
    records = [(ImageRecord(key=n, path=tmp_path / n / "x.png", caption="", width=128, height=128, subset=n), False)
               for n in ("a", "b")]  # fmt: skip
    placed, _ = place_all(records, cfg.data, Buckets(make_buckets(128, 32, 64, 256)), resolve_subsets(cfg.data))
    assert [p.flip for p in placed] == [True, False]
