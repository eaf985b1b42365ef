"""Flux.1 (issue 27, first slice): the tiny seeded Flux of the real layout, through the family protocol: packing and
position ids as the pipeline makes them, the size-dependent shift against diffusers' formula, the bundled
architectures' parameter counts on the meta device, and a LoRA that trains, resumes exactly and loads into
FluxPipeline."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.families.flux import family as flux
from difftrain.families.registry import get_family
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train
from difftrain.trainers.objectives import dynamic_shift


def test_packing_and_position_ids_are_the_pipelines():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 6, 10)
    packed = flux.pack(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 16, 6, 10))
    assert torch.equal(flux.unpack(packed, 6, 10), x)
    assert torch.equal(
        flux.image_ids(6, 10, "cpu", torch.float32),
        FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32),
    )


def test_the_shift_follows_the_image_size_as_the_dev_pipeline_computes_it():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = flux.Flux().scheduler_config(resolve(recipe="tiny-flux-lora", sets=["model.config=flux-dev"]).config.model)
    assert cfg["use_dynamic_shifting"] is True
    for tokens in (256, 1024, 4096, 6000):  # 512, 1024, 2048 px and beyond the range
        mu = calculate_shift(
            tokens, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"]
        )
        assert dynamic_shift(cfg, tokens) == pytest.approx(math.exp(mu))
    assert dynamic_shift(cfg, 4096) == pytest.approx(math.exp(1.15))


def test_the_bundled_flux_architectures_have_the_real_parameter_counts():
    counts = {}
    for name in ("flux-dev", "flux-schnell"):
        cfgdir = flux.bundled_config_dir(name)
        with torch.device("meta"):
            for part in flux.PARTS:
                m = flux._new_module(part, flux._read_json(cfgdir / part / "config.json"))
                counts[name, part] = sum(p.numel() for p in m.parameters())
    assert counts["flux-dev", "transformer"] == 11_901_408_320
    assert counts["flux-dev", "vae"] == 83_819_683
    assert counts["flux-dev", "text_encoder"] == 123_060_480
    assert counts["flux-dev", "text_encoder_2"] == 4_762_310_656
    assert counts["flux-schnell", "transformer"] < counts["flux-dev", "transformer"]  # no guidance embedder


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    return get_family("flux").build_tiny(tmp_path_factory.mktemp("flux") / "tiny-flux", seed=0)


def _cfg(model, data, out, **extra):
    sets = tiny_sets(
        model, data, out, **{"train.max_steps": 4, "train.checkpoint_every": 2, "report.to": "[]", **extra}
    )
    return resolve(recipe="tiny-flux-lora", sets=sets)


def test_a_tiny_flux_lora_trains_resumes_exactly_and_loads_into_the_pipeline(tiny_flux, _dataset_master, tmp_path):
    from diffusers import FluxPipeline

    res = _cfg(tiny_flux, _dataset_master, tmp_path / "a")
    precompute(res.config)
    whole = train(res.config, config_yaml=res.to_yaml())
    assert len(whole.losses) == 4 and all(math.isfinite(x) for x in whole.losses)
    # 2 steps, then resumed for 2 more: the same losses and LoRA as 4 in one go
    b = _cfg(tiny_flux, _dataset_master, tmp_path / "b", **{"data.cache_dir": tmp_path / "a" / "cache"}).config
    train(b, stop_at=2)
    resumed = train(b, resume="latest")
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-6)
    from safetensors.torch import load_file

    la, lb = load_file(whole.lora_path), load_file(resumed.lora_path)
    assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)
    # the single blocks' output projections are trained, the transformer's final projection is not
    assert any("single_transformer_blocks.0.proj_out.lora_A" in k for k in la)
    assert not any(k.startswith("transformer.proj_out.") for k in la)

    fam = get_family("flux")
    comps = fam.load(res.config.model, list(fam.parts), dtype=torch.float32, device="cpu")
    pipe = fam.pipeline(comps, res.config.model)
    pipe.set_progress_bar_config(disable=True)

    def image():
        out = pipe("a red square", num_inference_steps=2, height=64, width=64, output_type="pt",
                   generator=torch.Generator().manual_seed(0))  # fmt: skip
        return out.images

    before = image()
    pipe.load_lora_weights(str(whole.lora_path.parent), weight_name=whole.lora_path.name)
    assert isinstance(pipe, FluxPipeline) and not torch.allclose(image(), before)  # the LoRA acts


@pytest.mark.slow
def test_two_processes_train_the_tiny_flux_as_one_with_the_same_global_batch(tiny_flux, _dataset_master, tmp_path):
    """Flux through `difftrain train --gpus 2` (DDP on gloo, torchrun's agent): 2 processes x batch 2 train the same
    LoRA as 1 process x batch 4 (the multi-GPU path a family gets from the trainer, checked for Flux on the CPU)."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    res = _cfg(tiny_flux, _dataset_master, tmp_path / "p")
    precompute(res.config)
    cache = tmp_path / "p" / "cache"

    def run(out: str, batch: int, *extra: str) -> subprocess.CompletedProcess:
        sets = tiny_sets(tiny_flux, _dataset_master, tmp_path / out, **{"train.max_steps": 3, "train.device": "cpu",
                         "train.batch_size": batch, "data.cache_dir": cache, "report.to": "[]",
                         "report.html": "false", "train.checkpoint_every": "null"})  # fmt: skip
        cmd = [sys.executable, "-m", "difftrain", "train", "--recipe", "tiny-flux-lora", *extra]
        cmd += [a for s in sets for a in ("--set", s)]
        env = {**os.environ, "DIFFTRAIN_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        return r

    two = run("two", 2, "--gpus", "2")
    run("one", 4)
    assert "the 2 processes' trained weights agree" in two.stderr
    name = "pytorch_lora_weights.safetensors"
    a, b = load_file(tmp_path / "two" / "run" / name), load_file(tmp_path / "one" / "run" / name)
    assert a.keys() == b.keys()
    for k in a:  # equal but for summation-order noise, which AdamW magnifies (test_distributed._same_training)
        close = torch.isclose(a[k], b[k], rtol=1e-3, atol=1e-4)
        assert close.float().mean().item() > 0.999, k
        torch.testing.assert_close(a[k], b[k], rtol=1e-2, atol=5e-4)

    def losses(out: str) -> list[float]:
        rows = (tmp_path / out / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in rows if "loss" in json.loads(x)]

    assert losses("two") == pytest.approx(losses("one"), rel=1e-4) and len(losses("one")) == 3


@pytest.mark.slow
def test_flux_dreambooth_with_prior_preservation_and_validation_samples(tiny_flux, dataset, tmp_path):
    """DreamBooth on Flux: the class images are drawn by FluxPipeline and cached beside the instance images, the
    class loss is added each step; validation samples are drawn at step 2 and at the end (issue 27, item 3)."""
    import json

    from PIL import Image

    from difftrain.data.cache import DataCache
    from difftrain.trainers.loop import Trainer

    cls = tmp_path / "class"
    res = _cfg(tiny_flux, dataset, tmp_path, **{
        "dreambooth.instance_prompt": "a photo of sks shape", "dreambooth.with_prior_preservation": "true",
        "dreambooth.class_prompt": "a photo of a shape", "dreambooth.class_data_dir": cls,
        "dreambooth.num_class_images": 3, "dreambooth.class_sample_steps": 2, "dreambooth.prior_loss_weight": 0.5,
        "train.checkpoint_every": 1000, "validation.every_n_steps": 2, "validation.prompts": "[a red circle]",
        "validation.num_inference_steps": 2, "validation.resolution": 64})  # fmt: skip
    cfg = res.config
    r = precompute(cfg)
    assert len(list(cls.glob("class-*.png"))) == 3 and r.items == 8 + 3
    items = DataCache(tmp_path / "cache").read_json("index.json")["items"]
    assert {it["caption"] for it in items if it.get("prior")} == {"a photo of a shape"}
    t = Trainer(cfg)
    t.run()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(t.feed.prior_items) == 3 and all(rec["prior_loss"] > 0 for rec in recs if "loss" in rec)
    step2 = tmp_path / "run" / "samples" / "step-00000002" / "00.png"
    final = tmp_path / "run" / "samples" / "final" / "00.png"
    assert Image.open(final).size == (64, 64)
    assert Image.open(step2).tobytes() != Image.open(final).tobytes()  # training changed what it draws


@pytest.mark.slow
def test_flux_caption_augmentation_and_a_sweep_over_one_cache(tiny_flux, _dataset_master, tmp_path, cli):
    """Shuffled tag captions (variants cached through both Flux text stages) and `difftrain sweep` with two
    trials over one cache, through the CLI's entry point."""
    import json

    from difftrain.data.cache import DataCache

    aug = {"data.caption_source": "tags", "data.shuffle_caption": "true", "data.keep_tokens": 1,
           "data.caption_variants": 2, "data.caption_dropout_rate": 0.2}  # fmt: skip
    sets = tiny_sets(
        tiny_flux,
        _dataset_master,
        tmp_path,
        **aug,
        **{"train.max_steps": 2, "report.to": "[]"},
    )
    r = cli("sweep", "--recipe", "tiny-flux-lora", *[a for s in sets for a in ("--set", s)],
            "--grid", "optimizer.lr=1e-3,1e-2", "-o", tmp_path / "sw")  # fmt: skip
    assert r.code == 0, r
    index = DataCache(tmp_path / "cache").read_json("index.json")
    assert index["captions"]["variants"] == 2
    assert all(
        len(it["text_variants"]) == 2 and set(it["text_variants"][0]) == {"clip_l", "t5"} for it in index["items"]
    )
    rows = json.loads((tmp_path / "sw" / "results.json").read_text())
    assert sorted(row["train.learning_rate"] for row in rows) == [1e-3, 1e-2]
    assert all(row["status"] == "ok" and row["steps"] == 2 for row in rows)
