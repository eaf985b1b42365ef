"""Training behaviour on the tiny SDXL: the loss falls, resume is exact, the LoRA loads into diffusers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train


def _cfg(tiny_model, data, out, **extra):
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, data, out, **extra)).config


@pytest.fixture
def four_images(dataset):
    for p in sorted(dataset.glob("*.png"))[4:]:
        p.unlink()
    return dataset


def test_loss_falls_when_overfitting_four_images(tiny_model, four_images, tmp_path):
    cfg = _cfg(
        tiny_model,
        four_images,
        tmp_path,
        **{
            "train.max_steps": 40,
            "train.batch_size": 4,
            "train.learning_rate": 3e-3,
            "lora.rank": 8,
            "train.checkpoint_every": 1000,
        },
    )
    precompute(cfg)
    losses = train(cfg).losses
    assert len(losses) == 40
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.6 * first, (first, last)


def test_resume_gives_the_same_weights_and_losses(tiny_model, dataset, tmp_path):
    common = {
        "train.batch_size": 2,
        "train.grad_accum": 2,
        "train.lr_scheduler": "cosine",
        "train.warmup_steps": 2,
        "train.noise_offset": 0.05,
        "train.min_snr_gamma": 5.0,
        "lora.dropout": 0.1,
    }
    straight = _cfg(
        tiny_model, dataset, tmp_path / "a", **common, **{"train.max_steps": 6, "train.checkpoint_every": 100}
    )
    precompute(straight)
    ref = train(straight)

    split = _cfg(
        tiny_model,
        dataset,
        tmp_path / "b",
        **common,
        **{"train.max_steps": 6, "train.checkpoint_every": 3, "data.cache_dir": tmp_path / "a" / "cache"},
    )
    first = train(split, stop_at=3)  # as if interrupted after step 3
    assert first.checkpoints[-1].name == "step-00000003"
    second = train(split, resume="latest")

    assert len(first.losses) == 3 and len(second.losses) == 3
    assert first.losses + second.losses == pytest.approx(ref.losses, rel=1e-6, abs=1e-7)
    a, b = load_file(ref.lora_path), load_file(second.lora_path)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_exported_lora_changes_the_diffusers_pipeline_output(tiny_model, dataset, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    cfg = _cfg(tiny_model, dataset, tmp_path, **{"train.max_steps": 10, "lora.rank": 8, "lora.alpha": 4})
    precompute(cfg)
    lora = train(cfg).lora_path

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)

    def render():
        return pipe(
            "a red circle",
            num_inference_steps=3,
            height=64,
            width=64,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images[0]

    before = render()
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    after = render()
    assert len(pipe.get_active_adapters()) == 1
    # every trained layer (attention and conv) arrived, with the trained alpha, not alpha = rank
    from peft.utils import get_peft_model_state_dict

    saved = {k.removeprefix("unet."): v for k, v in load_file(lora).items()}
    loaded = get_peft_model_state_dict(pipe.unet, adapter_name=pipe.get_active_adapters()[0])
    assert saved.keys() == loaded.keys() and any(".conv1." in k for k in saved)
    for k in saved:
        torch.testing.assert_close(loaded[k], saved[k])
    peft_cfg = pipe.unet.peft_config[pipe.get_active_adapters()[0]]
    assert (peft_cfg.r, peft_cfg.lora_alpha) == (8, 4)
    assert abs(after - before).mean() > 1e-4
    pipe.unload_lora_weights()
    assert abs(render() - before).max() < 1e-5


def test_text_encoder_lora_trains_and_loads(tiny_model, dataset, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    cfg = _cfg(tiny_model, dataset, tmp_path, **{"train.max_steps": 3, "train.train_text_encoders": "true"})
    precompute(cfg)
    lora = train(cfg).lora_path
    sd = load_file(lora)
    for part in ("unet", "text_encoder", "text_encoder_2"):
        ups = [v for k, v in sd.items() if k.startswith(part + ".") and "lora_B" in k]
        assert ups and any(v.abs().sum() > 0 for v in ups), part  # B starts at zero: trained
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_model, local_files_only=True)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    from peft.tuners.lora import LoraLayer

    assert any(isinstance(m, LoraLayer) for m in pipe.text_encoder.modules())
    assert any(isinstance(m, LoraLayer) for m in pipe.text_encoder_2.modules())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp16", "checkpoint"])
def test_precision_and_checkpointing_track_the_plain_run(tiny_model, dataset, tmp_path, mode):
    """fp16 autocast with the grad scaler, and gradient checkpointing, follow the fp32 eager losses."""
    base = {"train.max_steps": 4, "train.checkpoint_every": 100}
    plain = _cfg(tiny_model, dataset, tmp_path / "plain", **base)
    precompute(plain)
    ref = train(plain).losses
    extra = {"train.mixed_precision": "fp16"} if mode == "fp16" else {"memory.activations.kind": "checkpoint"}
    other = _cfg(
        tiny_model, dataset, tmp_path / mode, **base, **extra, **{"data.cache_dir": tmp_path / "plain" / "cache"}
    )
    t = train(other)
    tol = 1e-2 if mode == "fp16" else 1e-5
    assert t.losses == pytest.approx(ref, rel=tol)
    if mode == "fp16":
        from difftrain.trainers.state import load_tree

        assert (
            load_tree(t.checkpoints[-1], "schedule")["scaler"]["scale"] > 1
        )  # the scaler was live, and is checkpointed
