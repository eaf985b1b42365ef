"""FLUX.2 through the generic trainer on CPU: precompute (the 32-channel normalised latents, the 512 text rows the
transformer sees), training, resume, and the two LoRA files it writes (diffusers' layout, and the kohya names in
BFL's layout that ComfyUI loads, q/k/v as the fused qkv) loading into Flux2KleinPipeline with the same effect as the
trained model; merge and resize; a full fine-tune's transformer file in BFL's names."""

from __future__ import annotations

import pytest
import torch

from conftest import set_args, tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train


@pytest.fixture(scope="module")
def tiny_flux2(tmp_path_factory):
    from difftrain.families.flux2 import Flux2

    return Flux2().build_tiny(tmp_path_factory.mktemp("flux2") / "tiny-flux2", seed=0)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 9, 96, generator=g)


def _transformer_out(transformer) -> torch.Tensor:
    """The transformer's prediction through the family's denoise (the pipeline's inputs: tested in the unit tests)."""
    from difftrain.families.flux2 import Flux2

    x, text = _inputs()
    with torch.no_grad():
        return Flux2().denoise(transformer, x, torch.tensor([400.0]), {"prompt_embeds": text})


def test_both_lora_files_load_into_the_klein_pipeline_as_trained(tiny_flux2, dataset, tmp_path):
    from diffusers import Flux2KleinPipeline
    from safetensors.torch import load_file

    from difftrain.config.schema import ModelConfig
    from difftrain.data.cache import DataCache
    from difftrain.families.flux2 import Flux2

    cfg = resolve(
        recipe="tiny-flux2-lora", sets=tiny_sets(tiny_flux2, dataset, tmp_path, **{"train.max_steps": 4})
    ).config
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    items = cache.read_json("index.json")["items"]
    entry = cache.get(items[0]["texts"]["llm"])["prompt_embeds"]
    assert entry.shape == (512, 96)
    assert cache.get(items[0]["latent"])["latents"].shape[0] == 4
    r = train(cfg)
    assert len(r.losses) == 4 and all(torch.isfinite(torch.tensor(r.losses)))
    peft_file, kohya_file = r.lora_path, r.lora_path.parent / "lora_kohya.safetensors"
    kohya = load_file(kohya_file)
    # lora_unet_ + BFL's module path with alphas: ComfyUI's FLUX.2 names (a double block's q/k/v as its qkv)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in kohya
    assert "lora_unet_double_blocks_1_txt_mlp_2.alpha" in kohya
    assert "lora_unet_single_blocks_0_linear1.lora_up.weight" in kohya
    assert not [k for k in kohya if "to_q" in k or "add_k_proj" in k]
    fam = Flux2()
    base = _transformer_out(Flux2KleinPipeline.from_pretrained(tiny_flux2).transformer)
    outs = []
    for f in (peft_file, kohya_file):
        pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2)
        pipe.load_lora_weights(str(f))
        outs.append(_transformer_out(pipe.transformer))
    assert not torch.allclose(outs[0], base, atol=1e-4)  # the LoRA changes the output
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    # lora merge: either file merged into the base gives the same transformer file (BFL's names), loadable
    from difftrain.lora.tools import merge

    for i, f in enumerate((peft_file, kohya_file)):
        merge(tiny_flux2, f, tmp_path / f"m{i}.safetensors")
    m0, m1 = load_file(tmp_path / "m0.safetensors"), load_file(tmp_path / "m1.safetensors")
    assert "double_blocks.0.img_attn.qkv.weight" in m0
    assert set(m0) == set(m1) and all(torch.allclose(m0[k], m1[k], atol=1e-6) for k in m0)
    # the merged weights (our merge of our file, read back through the BFL layout) predict what the pipeline with
    # the LoRA loaded does
    merged = fam.load(ModelConfig(path=tmp_path / "m0.safetensors", config="flux2-tiny"), ["transformer"])
    torch.testing.assert_close(_transformer_out(merged["transformer"]), outs[0], rtol=1e-4, atol=1e-5)
    # lora resize keeps each file's layout (the fused qkv cut as one layer, as sd-scripts cuts it): both still load
    # and change the output; the unfused layers are cut alike in both
    from difftrain.lora.tools import resize

    for i, f in enumerate((peft_file, kohya_file)):
        resize(f, tmp_path / f"r{i}.safetensors", rank=2)
        pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2)
        pipe.load_lora_weights(str(tmp_path / f"r{i}.safetensors"))
        assert not torch.allclose(_transformer_out(pipe.transformer), base, atol=1e-4)
    r0, r1 = load_file(tmp_path / "r0.safetensors"), load_file(tmp_path / "r1.safetensors")
    assert r1["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 2
    a = "transformer.single_transformer_blocks.1.attn.to_out"
    b = "lora_unet_single_blocks_1_linear2"
    delta0 = r0[f"{a}.lora_B.weight"] @ r0[f"{a}.lora_A.weight"]
    delta1 = (r1[f"{b}.alpha"] / 2) * r1[f"{b}.lora_up.weight"] @ r1[f"{b}.lora_down.weight"]
    torch.testing.assert_close(delta1, delta0, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_resumed_flux2_run_matches_an_uninterrupted_one(tiny_flux2, dataset, tmp_path):
    sets = {"train.max_steps": 4, "train.checkpoint_every": 2}
    whole = resolve(recipe="tiny-flux2-lora", sets=tiny_sets(tiny_flux2, dataset, tmp_path / "a", **sets)).config
    precompute(whole)
    full = train(whole)
    first = resolve(
        recipe="tiny-flux2-lora",
        sets=tiny_sets(tiny_flux2, dataset, tmp_path / "b", **{**sets, "train.max_steps": 2}),
    ).config
    precompute(first)
    train(first)
    resumed = resolve(recipe="tiny-flux2-lora", sets=tiny_sets(tiny_flux2, dataset, tmp_path / "b", **sets)).config
    r = train(resumed, resume="latest")
    assert r.losses == pytest.approx(full.losses[2:], rel=1e-5)


@pytest.mark.slow
def test_a_full_fine_tune_saves_bfl_s_transformer_file(tiny_flux2, dataset, tmp_path):
    from safetensors.torch import load_file

    from difftrain.config.schema import ModelConfig
    from difftrain.families.flux2 import Flux2

    sets = tiny_sets(tiny_flux2, dataset, tmp_path, **{"train.max_steps": 1, "train.checkpoint_every": 100,
                     "report.to": "[]", "train.method": "full", "save.formats": "[single_file]",
                     "train.learning_rate": "1e-3", "save.precision": "fp32"})  # fmt: skip
    cfg = resolve(recipe="tiny-flux2-lora", sets=sets).config
    precompute(cfg)
    train(cfg)
    out = cfg.train.output_dir / "model.safetensors"
    assert "double_blocks.0.img_attn.qkv.weight" in set(load_file(out))
    fam = Flux2()
    tuned = fam.load(ModelConfig(path=out, config="flux2-tiny"), ["transformer"], tokenizers=False)["transformer"]
    base = fam.load(ModelConfig(path=tiny_flux2), ["transformer"], tokenizers=False)["transformer"]
    name = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(tuned.state_dict()[name], base.state_dict()[name])


@pytest.mark.slow
def test_dev_trains_with_its_guidance_and_its_loras_load_into_flux2pipeline(dataset, tmp_path):
    """[dev]'s layout (Mistral 3, the guidance embedding): precompute through Flux2Pipeline's text encoding, training
    with flow.guidance_scale, and both LoRA files loading into Flux2Pipeline alike."""
    from diffusers import Flux2Pipeline

    from difftrain.families.flux2 import Flux2

    model = Flux2().build_tiny(tmp_path / "tiny-dev", seed=1, config="flux2-tiny-dev")
    sets = tiny_sets(model, dataset, tmp_path, **{"train.max_steps": 2, "model.config": "flux2-tiny-dev",
                     "flow.guidance_scale": 3.5})  # fmt: skip
    cfg = resolve(recipe="tiny-flux2-lora", sets=sets).config
    precompute(cfg)
    r = train(cfg)
    assert len(r.losses) == 2 and all(torch.isfinite(torch.tensor(r.losses)))
    outs = []
    for f in (r.lora_path, r.lora_path.parent / "lora_kohya.safetensors"):
        pipe = Flux2Pipeline.from_pretrained(model)
        assert pipe.transformer.config.guidance_embeds
        pipe.load_lora_weights(str(f))
        outs.append(_transformer_out(pipe.transformer))
    base = _transformer_out(Flux2Pipeline.from_pretrained(model).transformer)
    assert not torch.allclose(outs[0], base, atol=1e-4)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_edit_training_caches_the_references_and_trains(tiny_flux2, dataset, tmp_path):
    """flux2-edit through precompute and the trainer: two references per target (a control folder beside the data,
    musubi-tuner's numbering), their latents cached beside the target's, a LoRA that loads into the klein pipeline."""
    from diffusers import Flux2KleinPipeline

    from difftrain.data.cache import DataCache
    from difftrain.flows.quickstart import make_controls

    controls = make_controls(dataset, tmp_path / "control")
    sets = tiny_sets(tiny_flux2, dataset, tmp_path, **{"train.max_steps": 2, "data.control_dir": controls})
    cfg = resolve(recipe="tiny-flux2-edit-lora", sets=sets).config
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    item = cache.read_json("index.json")["items"][0]
    entry = cache.get(item["latent"])
    assert entry["reference_latents"].shape == (2, *entry["latents"].shape)
    r = train(cfg)
    assert len(r.losses) == 2 and all(torch.isfinite(torch.tensor(r.losses)))
    pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2)
    pipe.load_lora_weights(str(r.lora_path))
    assert not torch.allclose(_transformer_out(pipe.transformer), _transformer_out(
        Flux2KleinPipeline.from_pretrained(tiny_flux2).transformer), atol=1e-4)  # fmt: skip


@pytest.mark.slow
def test_a_sweep_over_one_cache_trains_each_trial(tiny_flux2, dataset, tmp_path, cli):
    """`difftrain sweep` on FLUX.2 [klein] (issue 53's sweeps), through the CLI's entry point: two ranks over one
    cache, each trial trained to a finite loss, the ranks giving different runs."""
    import json

    sets = tiny_sets(tiny_flux2, dataset, tmp_path, **{"train.max_steps": 2, "report.to": "[]"})
    r = cli("sweep", "--recipe", "tiny-flux2-lora", *set_args(sets), "--grid", "lora.rank=2,4", "-o", tmp_path / "sw")
    assert r.code == 0, r
    rows = json.loads((tmp_path / "sw" / "results.json").read_text())
    assert sorted(row["lora.rank"] for row in rows) == [2, 4]
    assert all(row["status"] == "ok" and row["steps"] == 2 for row in rows)
    assert all(torch.isfinite(torch.tensor(row["final_loss"])) for row in rows)
    assert rows[0]["final_loss"] != rows[1]["final_loss"]
