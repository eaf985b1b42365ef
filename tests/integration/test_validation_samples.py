"""Validation samples while training: fixed prompts and seed, PNG for images, mp4 for video."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer


@pytest.mark.slow
def test_sdxl_samples_every_n_steps_and_at_the_end(tiny_model, dataset, tmp_path):
    sets = tiny_sets(
        tiny_model,
        dataset,
        tmp_path,
        **{
            "train.max_steps": 4,
            "train.checkpoint_every": 1000,
            "validation.every_n_steps": 2,
            "validation.prompts": "[a red circle, a blue square]",
            "validation.num_inference_steps": 2,
            "validation.resolution": 64,
        },
    )
    cfg = resolve(recipe="tiny-sdxl-lora", sets=sets).config
    precompute(cfg)
    t = Trainer(cfg)
    t.run()
    step2 = sorted((tmp_path / "run" / "samples" / "step-00000002").glob("*.png"))
    final = sorted((tmp_path / "run" / "samples" / "final").glob("*.png"))
    assert [p.name for p in step2] == ["00.png", "01.png"] and [p.name for p in final] == ["00.png", "01.png"]
    assert Image.open(final[0]).size == (64, 64)
    # the text encoders and VAE were freed again: training holds the UNet only
    assert set(t.parts.comps) == {"unet"}
    # same weights, same prompt, same seed: the same sample
    from difftrain.trainers.validation import validate

    again = validate(t.validation_inputs(), "again")
    assert np.array_equal(np.asarray(Image.open(again[0])), np.asarray(Image.open(final[0])))
    # and training changed what the model draws between step 2 and the end
    assert not np.array_equal(np.asarray(Image.open(step2[0])), np.asarray(Image.open(final[0])))
    # CPU offload of the VAE and text encoders draws the same sample and leaves no hook on the UNet
    unet = t.parts.comps["unet"]
    hooks = len(unet._forward_pre_hooks)
    t.cfg.validation.cpu_offload = True
    offloaded = validate(t.validation_inputs(), "offloaded")
    assert np.array_equal(np.asarray(Image.open(offloaded[0])), np.asarray(Image.open(final[0])))
    assert len(unet._forward_pre_hooks) == hooks and not hasattr(unet, "_hf_hook") and set(t.parts.comps) == {"unet"}


def test_cogvideox_validation_writes_an_mp4(tmp_path, dataset):
    av = pytest.importorskip("av")
    from difftrain.families.cogvideox import CogVideoX

    model = CogVideoX().build_tiny(tmp_path / "tiny-cog")
    sets = tiny_sets(
        model,
        dataset,
        tmp_path,
        **{
            "train.max_steps": 1,
            "validation.prompts": "[a square]",
            "validation.num_inference_steps": 2,
            "validation.resolution": 64,
            "data.frames": 9,
            "validation.fps": 8,
        },
    )
    cfg = resolve(recipe="tiny-cogvideox-lora", sets=sets).config
    precompute(cfg)
    Trainer(cfg).run()
    mp4 = tmp_path / "run" / "samples" / "final" / "00.mp4"
    with av.open(str(mp4)) as c:
        frames = list(c.decode(video=0))
        assert len(frames) == 9 and frames[0].width == 64
        assert float(c.streams.video[0].average_rate) == 8
