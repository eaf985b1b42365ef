"""SD3 end to end on the tiny seeded model: per-encoder text stages, flow-matching LoRA, exact resume, pipeline load."""

from __future__ import annotations

import math

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

    common = {
        "train.batch_size": 4,
        "train.learning_rate": 3e-3,
        "flow.loss_weighting": "cosmap",
        "data.cache_dir": tmp_path / "cache",
    }
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
    kwargs = {
        "prompt": "a red circle",
        "num_inference_steps": 2,
        "height": 64,
        "width": 64,
        "output_type": "pt",
        "max_sequence_length": 77,
    }
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
    from difftrain.trainers.objectives import flow_loss_weight, sample_sigmas

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


@pytest.mark.slow
def test_dreambooth_prior_preservation_generates_caches_and_adds_the_class_loss(tiny_sd3, dataset, tmp_path):
    import json

    from difftrain.data.cache import DataCache

    cls = tmp_path / "class"
    db = {
        "dreambooth.instance_prompt": "a photo of sks shape",
        "dreambooth.with_prior_preservation": "true",
        "dreambooth.class_prompt": "a photo of a shape",
        "dreambooth.class_data_dir": cls,
        "dreambooth.num_class_images": 3,
        "dreambooth.class_sample_steps": 2,
        "dreambooth.prior_loss_weight": 0.5,
    }
    cfg = _cfg(tiny_sd3, dataset, tmp_path, **db, **{"train.max_steps": 4, "train.checkpoint_every": 1000})
    r = precompute(cfg)
    assert len(list(cls.glob("class-*.png"))) == 3 and r.items == 8 + 3
    items = DataCache(tmp_path / "cache").read_json("index.json")["items"]
    assert {it["caption"] for it in items if not it.get("prior")} == {"a photo of sks shape"}
    assert {it["caption"] for it in items if it.get("prior")} == {"a photo of a shape"}
    # a second precompute finds the class images there: none generated, nothing encoded
    assert precompute(cfg).latents_encoded == 0 and len(list(cls.glob("*.png"))) == 3

    from difftrain.trainers.loop import Trainer

    t = Trainer(cfg)
    res = t.run()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(t.feed.items) == 8 and len(t.feed.prior_items) == 3
    assert all(rec["prior_loss"] > 0 for rec in recs)
    # the logged loss is the instance loss plus the weighted class loss: with weight 0.5 it differs from
    # a run with weight 0 (same draws) by exactly half the class loss
    cfg0 = _cfg(
        tiny_sd3,
        dataset,
        tmp_path / "w0",
        **{**db, "dreambooth.prior_loss_weight": 0.0},
        **{"train.max_steps": 1, "train.checkpoint_every": 1000, "data.cache_dir": tmp_path / "cache"},
    )
    t0 = Trainer(cfg0)
    r0 = t0.run()
    rec0 = json.loads((tmp_path / "w0" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert res.losses[0] == pytest.approx(r0.losses[0] + 0.5 * rec0["prior_loss"], rel=1e-5)


def test_long_captions_are_cut_to_the_t5_length_with_a_warning(tiny_sd3, capsys):
    from difftrain.config.schema import TextEncodersConfig
    from difftrain.families.sd3 import SD3

    fam = SD3()
    comps = fam.load(
        __import__("difftrain.config.schema", fromlist=["ModelConfig"]).ModelConfig(path=tiny_sd3), ["text_encoder_3"]
    )
    out = fam.encode_prompts(comps, ["a " * 200], "t5", TextEncodersConfig(t5={"precision": "fp32", "max_length": 77}))
    assert out["t5_embeds"].shape[1] == 77
    assert "longer than text_encoders.t5.max_length (77 tokens)" in capsys.readouterr().err


def test_the_whole_sd3_flow_through_the_cli(cli, tiny_sd3, dataset, tmp_path):
    sets = tiny_sets(tiny_sd3, dataset, tmp_path, **{"train.max_steps": 3})
    args = [a for s in sets for a in ("--set", s)]
    assert cli("merge-tags", dataset, tmp_path / "meta.json").code == 0
    r = cli("precompute", "--recipe", "tiny-sd3-lora", *args, "--set", f"data.metadata={tmp_path / 'meta.json'}")
    assert r.code == 0, r
    r = cli("train", "--recipe", "tiny-sd3-lora", *args, "--set", f"data.metadata={tmp_path / 'meta.json'}")
    assert r.code == 0, r
    assert (tmp_path / "run" / "pytorch_lora_weights.safetensors").exists()
    r = cli("plan", "--recipe", "sd3-lora-8gb")
    assert r.code == 0 and "sd3" in r.err


@pytest.mark.slow
def test_sd3_full_finetune_exports_a_single_file_and_a_diffusers_folder(tiny_sd3, dataset, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from difftrain.config.schema import ModelConfig
    from difftrain.families.sd3 import SD3
    from difftrain.trainers.loop import Trainer

    cfg = _cfg(
        tiny_sd3,
        dataset,
        tmp_path,
        **{
            "train.method": "full",
            "train.max_steps": 2,
            "train.learning_rate": 1e-3,
            "save.formats": "[single_file, diffusers]",
            "save.precision": "fp32",
            "train.checkpoint_every": 1000,
        },
    )
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    trained = {k: v.detach().clone() for k, v in t.parts.comps["transformer"].state_dict().items()}
    single = next(p for p in r.saved if p.suffix == ".safetensors")
    back = SD3().load(ModelConfig(path=single, config="sd3-tiny", tokenizer_path=tiny_sd3), ["transformer"])[
        "transformer"
    ]
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, trained[k], rtol=0, atol=0)
    base = SD3().load(ModelConfig(path=tiny_sd3), ["transformer"])["transformer"].state_dict()
    assert any(not torch.equal(base[k], trained[k]) for k in base)  # training changed the weights
    folder = next(p for p in r.saved if p.is_dir())
    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    torch.testing.assert_close(
        pipe.transformer.state_dict()["proj_out.weight"], trained["proj_out.weight"], rtol=0, atol=0
    )


def test_flow_matching_inputs_follow_the_formulas():
    from types import SimpleNamespace

    from difftrain.config.schema import FlowConfig
    from difftrain.trainers.objectives import Draws, Objective

    for sampling in ("logit_normal", "mode", "uniform"):
        flow = FlowConfig(
            timestep_sampling=sampling, logit_mean=0.3, logit_std=0.7, mode_scale=1.29, loss_weighting="cosmap"
        )
        draws = Draws(torch.Generator().manual_seed(1), torch.device("cpu"))
        fake = SimpleNamespace(
            cfg=SimpleNamespace(flow=flow),
            flow_shift=3.0,
            dynamic=False,
            draws=draws,
            device=draws.device,
            band=(0.0, 1.0),
        )
        x0, noise = torch.randn(64, 4, 2, 2), torch.randn(64, 4, 2, 2)
        noisy, t, target, w = Objective.flow_inputs(fake, x0, noise)
        s = t / 1000
        # the draw, by hand with the same generator
        g = torch.Generator().manual_seed(1)
        if sampling == "logit_normal":
            u = torch.sigmoid(0.3 + 0.7 * torch.randn(64, generator=g))
        else:
            u = torch.rand(64, generator=g)
            if sampling == "mode":
                u = 1 - u - 1.29 * (torch.cos(torch.pi * u / 2) ** 2 - 1 + u)
        u = u.clamp(1e-5, 1 - 1e-5)
        torch.testing.assert_close(s, 3.0 * u / (1 + 2.0 * u))
        sb = s.reshape(-1, 1, 1, 1)
        torch.testing.assert_close(noisy, (1 - sb) * x0 + sb * noise)
        torch.testing.assert_close(target, noise - x0)
        torch.testing.assert_close(w, 2 / (torch.pi * (1 - 2 * s + 2 * s**2)))
    # a scheduler that shifts by image size (Flux.1 [dev]): the shift of a 2x2-patch count of h * w / 4
    sched = SimpleNamespace(
        config={"base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
    )
    draws = Draws(torch.Generator().manual_seed(1), torch.device("cpu"))
    flow = FlowConfig(timestep_sampling="uniform")
    fake = SimpleNamespace(
        cfg=SimpleNamespace(flow=flow),
        flow_shift=3.0,
        dynamic=True,
        scheduler=sched,
        family=SimpleNamespace(latent_patch=2),  # Flux's 2x2 patches: one token per 2x2 latent pixels
        draws=draws,
        device=draws.device,
        band=(0.0, 1.0),
    )
    x0 = torch.randn(8, 16, 64, 64)  # 1024 patches
    _, t, _, _ = Objective.flow_inputs(fake, x0, torch.randn_like(x0))
    u = torch.rand(8, generator=torch.Generator().manual_seed(1)).clamp(1e-5, 1 - 1e-5)
    shift = math.exp(0.5 + 0.65 * (1024 - 256) / (4096 - 256))
    torch.testing.assert_close(t / 1000, shift * u / (1 + (shift - 1) * u))
