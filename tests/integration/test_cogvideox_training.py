"""CogVideoX through the generic trainer on CPU (images as one-frame clips; synthetic video-shaped caches)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train


@pytest.fixture(scope="module")
def tiny_cog(tmp_path_factory):
    from difftrain.families.cogvideox import CogVideoX

    return CogVideoX().build_tiny(tmp_path_factory.mktemp("cog") / "tiny-cog", seed=0)


def test_images_train_as_one_frame_clips_and_the_lora_loads(tiny_cog, dataset, tmp_path):
    from diffusers import CogVideoXPipeline
    from safetensors.torch import load_file

    from difftrain.data.cache import DataCache

    cfg = resolve(recipe="tiny-cogvideox-lora", sets=tiny_sets(tiny_cog, dataset, tmp_path, **{"train.max_steps": 4}))
    cfg = cfg.config
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    item = cache.read_json("index.json")["items"][0]
    assert cache.get(item["latent"])["latents"].ndim == 4  # [C, F=1, h, w]
    r = train(cfg)
    assert len(r.losses) == 4 and all(torch.isfinite(torch.tensor(r.losses)))
    assert any(k.startswith("transformer.") for k in load_file(r.lora_path))
    pipe = CogVideoXPipeline.from_pretrained(tiny_cog)
    pipe.load_lora_weights(str(r.lora_path))


def test_bench_on_video_shaped_latents_with_block_swap(tiny_cog, tmp_path):
    from difftrain.flows.bench import bench_memory

    cfg = resolve(
        recipe="tiny-cogvideox-lora",
        sets=[
            "train.device=cpu",
            "memory.activations.kind=checkpoint",
            "memory.offload={kind: block_swap, blocks_to_swap: 2}",
        ],
    ).config
    r = bench_memory(cfg, tmp_path, steps=3, size=(32, 48))
    from difftrain.data.cache import DataCache

    assert DataCache(tmp_path / "cache-32x48-9").get("lat0")["latents"].shape == (16, 3, 4, 6)  # 9 frames -> 3
    assert r.s_per_step > 0


def _clip(path, n_frames, size=(64, 48), seed=0):
    """A small test clip whose frames change (a moving bright square on a coloured background)."""
    import av
    import numpy as np

    codec = next((c for c in ("libx264", "mpeg4") if c in av.codecs_available), None)
    if codec is None:
        pytest.skip("this PyAV build has neither libx264 nor mpeg4")
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=8)
        s.width, s.height = size
        s.pix_fmt = "yuv420p"
        for i in range(n_frames):
            px = np.tile(base.astype(np.uint8), (size[1], size[0], 1))
            px[8:24, 4 * i % size[0] : 4 * i % size[0] + 16] = 255
            for pkt in s.encode(av.VideoFrame.from_ndarray(px, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path


@pytest.fixture
def clips(tmp_path):
    pytest.importorskip("av")
    d = tmp_path / "clips"
    for i in range(3):
        _clip(d / f"clip{i}.mp4", 12, seed=i)
        (d / f"clip{i}.txt").write_text(f"a square moving over colour {i}")
    _clip(d / "short.mp4", 3)
    (d / "short.txt").write_text("too short")
    (d / "broken.mp4").write_bytes(b"\x00\x01 not a video" * 40)
    return d


def test_video_clips_precompute_and_train_through_the_cli(cli, tiny_cog, clips, tmp_path):
    from difftrain.data.cache import DataCache

    sets = tiny_sets(
        tiny_cog,
        clips,
        tmp_path,
        **{"train.max_steps": 30, "train.learning_rate": 3e-3, "train.batch_size": 3, "data.caption_ext": ".txt"},
    )
    args = [a for s in sets for a in ("--set", s)]
    r = cli("precompute", "--recipe", "tiny-cogvideox-lora", *args)
    assert r.code == 0, r
    assert "short.mp4" in r.err and "broken.mp4" in r.err  # skipped and reported
    cache = DataCache(tmp_path / "cache")
    items = cache.read_json("index.json")["items"]
    assert len(items) == 3 and {it["frames"] for it in items} == {9}  # 12 frames -> the 9-frame bucket
    assert cache.get(items[0]["latent"])["latents"].shape[1] == 3  # 9 frames -> 3 latent frames
    r = cli("train", "--recipe", "tiny-cogvideox-lora", *args)
    assert r.code == 0, r
    import json

    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6  # overfitting three clips


def test_changing_the_frame_sampling_re_encodes_only_the_latents(tiny_cog, clips, tmp_path):
    base = tiny_sets(tiny_cog, clips, tmp_path, **{"data.caption_ext": ".txt"})
    r1 = precompute(resolve(recipe="tiny-cogvideox-lora", sets=base).config)
    r2 = precompute(resolve(recipe="tiny-cogvideox-lora", sets=base + ["data.frame_sampling=first"]).config)
    assert (r1.latents_encoded, r2.latents_encoded, r2.texts_encoded) == (3, 3, 0)


def test_image_to_video_trains_on_several_sizes_and_the_lora_needs_no_edit_at_inference(tmp_path):
    """Multi-resolution I2V: buckets off the learned positional table's size train (the table is resampled, not
    dropped), and the exported LoRA runs in the stock pipeline at the native size and changes its output."""
    pytest.importorskip("av")
    from diffusers import CogVideoXImageToVideoPipeline
    from PIL import Image

    from difftrain.data.cache import DataCache
    from difftrain.families.cogvideox import CogVideoXI2V

    model = CogVideoXI2V().build_tiny(tmp_path / "tiny-i2v", seed=0)
    d = tmp_path / "clips"
    # the tiny I2V's table: 9 frames of 64x64; the others: 5 frames of 64x64, 9 frames of 96x48 (bucket 80x48)
    for i, (n, size) in enumerate([(9, (64, 64)), (6, (64, 64)), (9, (96, 48))]):
        _clip(d / f"c{i}.mp4", n, size=size, seed=i)
        (d / f"c{i}.txt").write_text(f"clip {i}")
    sets = tiny_sets(
        model,
        d,
        tmp_path,
        **{
            "family": "cogvideox-i2v",
            "model.config": "cogvideox-tiny-i2v",
            "data.caption_ext": ".txt",
            "train.max_steps": 6,
            "train.batch_size": 1,
            "train.learning_rate": 1e-2,
        },
    )
    cfg = resolve(recipe="tiny-cogvideox-lora", sets=sets).config
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    shapes = {}
    for it in cache.read_json("index.json")["items"]:
        entry = cache.get(it["latent"])
        shapes[tuple(entry["latents"].shape)] = tuple(entry["image_latents"].shape)
    assert shapes == {(16, 3, 8, 8): (16, 1, 8, 8), (16, 2, 8, 8): (16, 1, 8, 8), (16, 3, 6, 10): (16, 1, 6, 10)}
    r = train(cfg)
    assert len(r.losses) == 6 and all(torch.isfinite(torch.tensor(r.losses)))

    pipe = CogVideoXImageToVideoPipeline.from_pretrained(model)  # stock: no difftrain hook, table as shipped
    assert not hasattr(pipe.transformer.patch_embed, "_difftrain_native")
    kw = {
        "image": Image.new("RGB", (64, 64), (200, 40, 40)),
        "prompt": "clip 0",
        "num_frames": 9,
        "height": 64,
        "width": 64,
        "num_inference_steps": 2,
        "output_type": "pt",
    }
    before = pipe(generator=torch.Generator().manual_seed(0), **kw).frames
    pipe.load_lora_weights(str(r.lora_path))
    after = pipe(generator=torch.Generator().manual_seed(0), **kw).frames
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-4


def test_full_finetune_saves_a_diffusers_folder_and_the_lora_changes_the_pipeline(tiny_cog, dataset, tmp_path):
    from diffusers import CogVideoXPipeline

    from difftrain.trainers.loop import Trainer

    cfg = resolve(
        recipe="tiny-cogvideox-lora",
        sets=tiny_sets(
            tiny_cog,
            dataset,
            tmp_path / "full",
            **{
                "train.method": "full",
                "train.max_steps": 2,
                "train.learning_rate": 1e-3,
                "save.formats": "[diffusers]",
                "save.precision": "fp32",
            },
        ),
    ).config
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    folder = next(p for p in r.saved if p.is_dir())
    pipe = CogVideoXPipeline.from_pretrained(folder)
    trained = t.parts.comps["transformer"].state_dict()
    for k, v in pipe.transformer.state_dict().items():
        torch.testing.assert_close(v, trained[k], rtol=0, atol=0)

    lora_cfg = resolve(
        recipe="tiny-cogvideox-lora",
        sets=tiny_sets(
            tiny_cog,
            dataset,
            tmp_path / "lora",
            **{"train.max_steps": 3, "train.learning_rate": 1e-2, "data.cache_dir": tmp_path / "full" / "cache"},
        ),
    ).config
    lora = train(lora_cfg).lora_path
    base = CogVideoXPipeline.from_pretrained(tiny_cog)
    kw = {
        "prompt": "a square",
        "num_frames": 9,
        "height": 32,
        "width": 32,
        "num_inference_steps": 2,
        "output_type": "pt",
    }
    before = base(generator=torch.Generator().manual_seed(0), **kw).frames
    base.load_lora_weights(str(lora))
    after = base(generator=torch.Generator().manual_seed(0), **kw).frames
    assert (after - before).abs().max() > 1e-4


def test_image_to_video_flow_through_the_cli_with_validation_samples(cli, tmp_path):
    av = pytest.importorskip("av")
    from PIL import Image

    from difftrain.families.cogvideox import CogVideoXI2V

    model = CogVideoXI2V().build_tiny(tmp_path / "tiny-i2v", seed=0)
    d = tmp_path / "clips"
    for i in range(2):
        _clip(d / f"c{i}.mp4", 10, size=(64, 64), seed=i)
        (d / f"c{i}.txt").write_text(f"clip {i}")
    start = tmp_path / "start.png"
    Image.new("RGB", (80, 80), (200, 40, 40)).save(start)
    sets = tiny_sets(
        model,
        d,
        tmp_path,
        **{
            "family": "cogvideox-i2v",
            "model.config": "cogvideox-tiny-i2v",
            "data.caption_ext": ".txt",
            "train.max_steps": 2,
            "validation.prompts": "[a red start]",
            "validation.images": f"[{start}]",
            "validation.num_inference_steps": 2,
            "validation.resolution": 96,
        },
    )  # off the table: resampled
    args = [a for s in sets for a in ("--set", s)]
    r = cli("precompute", "--recipe", "tiny-cogvideox-lora", *args)
    assert r.code == 0, r
    r = cli("train", "--recipe", "tiny-cogvideox-lora", *args)
    assert r.code == 0, r
    with av.open(str(tmp_path / "run" / "samples" / "final" / "00.mp4")) as c:
        assert len(list(c.decode(video=0))) == 9
    # one start image per prompt, or none
    r = cli("train", "--recipe", "tiny-cogvideox-lora", *args, "--set", "validation.prompts=[a, b]")
    assert r.code == 2 and "one start image per prompt" in r.err
