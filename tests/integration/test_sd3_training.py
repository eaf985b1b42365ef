"""SD3 end to end on the tiny seeded model: per-encoder text stages, flow-matching LoRA, exact resume, pipeline load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    from difftrain.families.sd3 import SD3

    return SD3().build_tiny(tmp_path_factory.mktemp("sd3") / "tiny-sd3", seed=0)


def _cfg(model, data, out, **extra):
    return resolve(recipe="tiny-sd3-lora", sets=tiny_sets(model, data, out, **extra)).config


def test_precompute_caches_each_text_encoder_on_its_own(tiny_sd3, dataset, tmp_path):
    cfg = _cfg(tiny_sd3, dataset, tmp_path)
    r = precompute(cfg)
    assert (r.items, r.latents_encoded, r.texts_encoded) == (8, 8, 24)  # 8 captions x (CLIP-L, CLIP-G, T5)
    # a longer T5 sequence: only the T5 stage is encoded again
    r2 = precompute(_cfg(tiny_sd3, dataset, tmp_path, **{"text_encoders.t5.max_length": 96}))
    assert (r2.latents_encoded, r2.texts_encoded, r2.texts_reused) == (0, 8, 16)
    # without T5 nothing new is encoded and items have no T5 entry
    from difftrain.data.cache import DataCache

    r3 = precompute(_cfg(tiny_sd3, dataset, tmp_path, **{"text_encoders.t5.enabled": "false"}))
    assert r3.texts_encoded == 0
    items = DataCache(tmp_path / "cache").read_json("index.json")["items"]
    assert set(items[0]["texts"]) == {"clip_l", "clip_g"}


def test_sd3_lora_learns_resumes_exactly_and_loads_into_the_pipeline(tiny_sd3, dataset, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    common = {"train.batch_size": 4, "train.learning_rate": 3e-3, "flow.loss_weighting": "cosmap",
              "data.cache_dir": tmp_path / "cache"}
    cfg = _cfg(tiny_sd3, dataset, tmp_path / "a", **common, **{"train.max_steps": 30, "train.checkpoint_every": 1000})
    precompute(cfg)
    ref = train(cfg)
    first, last = sum(ref.losses[:6]) / 6, sum(ref.losses[-6:]) / 6
    assert last < 0.8 * first, (first, last)

    split = _cfg(tiny_sd3, dataset, tmp_path / "b", **common, **{"train.max_steps": 30, "train.checkpoint_every": 10})
    a = train(split, stop_at=10)
    b = train(split, resume="latest")
    assert a.losses + b.losses == pytest.approx(ref.losses, rel=1e-6, abs=1e-7)

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    kwargs = dict(prompt="a red circle", num_inference_steps=2, height=64, width=64, output_type="pt", max_sequence_length=77)
    before = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(str(ref.lora_path))
    after = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert (after - before).abs().max() > 1e-3


def test_clip_lora_trains_on_the_fly_over_cached_t5(tiny_sd3, dataset, tmp_path):
    cfg = _cfg(tiny_sd3, dataset, tmp_path, **{"train.max_steps": 3, "train.train_text_encoders": "true"})
    precompute(cfg)
    r = train(cfg)
    keys = load_file(r.lora_path).keys()
    assert any(k.startswith("text_encoder.") for k in keys) and any(k.startswith("text_encoder_2.") for k in keys)
    assert any(k.startswith("transformer.") for k in keys)


@pytest.mark.parametrize("sampling", ["logit_normal", "mode", "uniform"])
def test_flow_timestep_sampling_draws_in_the_unit_interval(sampling):
    from difftrain.config.schema import FlowConfig
    from difftrain.trainers.loop import flow_loss_weight, sample_sigmas

    flow = FlowConfig(timestep_sampling=sampling)
    s = sample_sigmas(flow, 4096, 3.0, torch.Generator().manual_seed(0), "cpu")
    assert s.min() > 0 and s.max() < 1
    u = sample_sigmas(flow, 4096, 1.0, torch.Generator().manual_seed(0), "cpu")
    assert (s >= u - 1e-6).all()  # a shift above 1 moves every draw toward noise
    if sampling == "logit_normal":
        assert abs(u.median().item() - 0.5) < 0.03
    w = flow_loss_weight("sigma_sqrt", u)
    assert torch.allclose(w, u**-2)
    assert flow_loss_weight("none", u) is None


def test_int8_t5_on_cpu_is_refused_with_the_way_out(cli, tiny_sd3, dataset, tmp_path):
    sets = tiny_sets(tiny_sd3, dataset, tmp_path, **{"text_encoders.t5.precision": "int8", "precompute.device": "cpu"})
    r = cli("precompute", "--recipe", "tiny-sd3-lora", *[a for s in sets for a in ("--set", s)])
    assert r.code != 0
    assert "text_encoders.t5.precision: bf16" in r.err and "Traceback" not in r.err
