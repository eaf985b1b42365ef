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
    from difftrain.bench import bench_memory

    cfg = resolve(recipe="tiny-cogvideox-lora", sets=["train.device=cpu", "memory.activations.kind=checkpoint",
                                                     "memory.offload={kind: block_swap, blocks_to_swap: 2}"]).config
    r = bench_memory(cfg, tmp_path, steps=3, size=(32, 48))
    from difftrain.data.cache import DataCache

    assert DataCache(tmp_path / "cache-32x48-9").get("lat0")["latents"].shape == (16, 3, 4, 6)  # 9 frames -> 3
    assert r.s_per_step > 0
