"""LoRA files that load everywhere (issue 11): the kohya layout beside the diffusers one, loaded through
diffusers' own kohya conversion with the same result, metadata in both headers, every key checked against
the base model, and training continued from either file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import ConfigError
from difftrain.families.cogvideox import CogVideoX
from difftrain.families.sd3 import SD3
from difftrain.lora import kohya
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer, train


def _cfg(tiny_model, data, out, **extra):
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, data, out, **extra)).config


@pytest.fixture(scope="module")
def trained(tiny_model, _dataset_master, tmp_path_factory):
    """A tiny SDXL LoRA on the UNet (attention and conv layers) and both text encoders, alpha != rank."""
    out = tmp_path_factory.mktemp("loraformats")
    cfg = _cfg(
        tiny_model,
        _dataset_master,
        out,
        **{
            "train.max_steps": 4,
            "lora.rank": 4,
            "lora.alpha": 2,
            "train.train_text_encoders": "true",
            "train.learning_rate": 1e-2,
            "dreambooth.instance_prompt": "a photo of sks",
        },
    )
    precompute(cfg)
    r = train(cfg)
    return cfg, r.lora_path, r.lora_path.parent / "lora_kohya.safetensors"


def test_both_layouts_are_written_with_metadata(trained):
    _cfg, diffusers_file, kohya_file = trained
    assert diffusers_file.exists() and kohya_file.exists()
    sd = load_file(kohya_file)
    assert any(k.startswith("lora_unet_input_blocks_") for k in sd)  # the UNet by its original (LDM) module paths
    assert any(k.startswith("lora_te1_text_model_encoder_layers_") for k in sd)
    assert any(k.startswith("lora_te2_text_model_encoder_layers_") for k in sd)
    downs = [k for k in sd if k.endswith(".lora_down.weight")]
    assert downs and all(sd[k[: -len(".lora_down.weight")] + ".alpha"].item() == 2.0 for k in downs)
    assert len(sd) == 3 * len(downs)
    for f in (diffusers_file, kohya_file):
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata()
        assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "2"
        assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
        assert meta["modelspec.trigger_phrase"] == "a photo of sks"
        assert len(meta["difftrain.config_sha256"]) == 64
    with safe_open(str(diffusers_file), framework="pt") as h:
        assert "lora_adapter_metadata" in h.metadata()  # diffusers' own field is kept


def test_the_kohya_file_loads_through_diffusers_conversion_with_the_same_output(trained, tiny_model):
    from diffusers import StableDiffusionXLPipeline

    _, diffusers_file, kohya_file = trained
    outs = []
    for f in (diffusers_file, kohya_file):
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_model, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(str(f.parent), weight_name=f.name)
        outs.append(
            pipe(
                "a photo of sks",
                num_inference_steps=2,
                height=64,
                width=64,
                output_type="np",
                generator=torch.Generator().manual_seed(0),
            ).images[0]
        )
    plain = StableDiffusionXLPipeline.from_pretrained(tiny_model, local_files_only=True)
    plain.set_progress_bar_config(disable=True)
    base = plain(
        "a photo of sks",
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert abs(outs[0] - base).mean() > 1e-4  # the LoRA changes the output...
    assert abs(outs[0] - outs[1]).max() < 1e-4  # ...and the kohya file changes it the same way


def test_kohya_round_trip_gives_the_peft_weights_back(trained):
    from difftrain.families.sdxl import SDXL
    from difftrain.lora import files as lora_files

    cfg, diffusers_file, kohya_file = trained
    fam = SDXL()
    parts = ["unet", "text_encoder", "text_encoder_2"]
    a, alphas_a = lora_files.read_lora(kohya_file, cfg, fam, parts)
    b, _ = lora_files.read_lora(diffusers_file, cfg, fam, parts)
    assert a.keys() == b.keys() == set(parts)
    for part in parts:
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k].float(), b[part][k].float()), k
        assert set(alphas_a[part].values()) == {2.0}


@pytest.mark.parametrize("which", ["diffusers", "kohya"])
def test_training_continues_from_either_file(trained, tiny_model, _dataset_master, tmp_path, which):
    cfg0, diffusers_file, kohya_file = trained
    src = diffusers_file if which == "diffusers" else kohya_file
    cfg = _cfg(
        tiny_model,
        _dataset_master,
        tmp_path,
        **{
            "data.cache_dir": cfg0.data.cache_dir,
            "lora.rank": 4,
            "lora.alpha": 2,
            "train.train_text_encoders": "true",
            "lora.init_weights": src,
            "train.max_steps": 1,
        },
    )
    t = Trainer(cfg)
    t.setup()
    now = t.exporter.layers()
    want = {k.partition(".")[0]: {} for k in load_file(diffusers_file)}
    for k, v in load_file(diffusers_file).items():
        part, _, rest = k.partition(".")
        want[part][rest] = v
    for part in want:
        for k, v in want[part].items():
            assert torch.equal(now[part][k].to(v.dtype), v), (part, k)


def test_a_file_that_does_not_fit_is_refused_with_the_keys_named(trained, tiny_model, _dataset_master, tmp_path, cli):
    cfg0, _, kohya_file = trained
    sd = load_file(kohya_file)
    sd["lora_unet_input_blocks_99_1_proj_in.lora_down.weight"] = torch.zeros(4, 8)
    bad = tmp_path / "bad.safetensors"
    save_file(sd, bad)
    sets = tiny_sets(
        tiny_model,
        _dataset_master,
        tmp_path,
        **{
            "data.cache_dir": cfg0.data.cache_dir,
            "lora.rank": 4,
            "lora.alpha": 2,
            "train.train_text_encoders": "true",
            "lora.init_weights": bad,
            "train.max_steps": 1,
        },
    )
    r = cli("train", "--recipe", "tiny-sdxl-lora", *[a for s in sets for a in ("--set", s)])
    assert r.code != 0 and "Traceback" not in r.err
    assert "lora_unet_input_blocks_99_1_proj_in.lora_down.weight" in r.err and "does not fit this model" in r.err
    # rank differs from the file's: said so, with the fix
    sets = [s for s in sets if not s.startswith(("lora.rank", "lora.init_weights"))] + [
        "lora.rank=8",
        f"lora.init_weights={kohya_file}",
    ]
    r = cli("train", "--recipe", "tiny-sdxl-lora", *[a for s in sets for a in ("--set", s)])
    assert r.code != 0 and "Set lora.rank to the file's rank" in r.err


def test_layers_the_kohya_names_cannot_express_are_all_named():
    names = {"unet": {"down_blocks.0.attn.to_q": "input_blocks.1.1.attn.to_q"}}
    layers = {
        "unet": {
            "down_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 4),
            "down_blocks.0.attn.to_q.lora_B.weight": torch.zeros(4, 2),
            "nowhere.lora_A.weight": torch.zeros(2, 4),
            "elsewhere.lora_B.weight": torch.zeros(4, 2),
        }
    }
    with pytest.raises(kohya.UnmappedKeys) as e:
        kohya.to_kohya(layers, names, {"unet": {"down_blocks.0.attn.to_q": 2.0}})
    assert e.value.keys == ["unet.elsewhere", "unet.nowhere"]
    out = kohya.to_kohya(
        {"unet": dict(list(layers["unet"].items())[:2])}, names, {"unet": {"down_blocks.0.attn.to_q": 2.0}}
    )
    assert sorted(out) == [
        "lora_unet_input_blocks_1_1_attn_to_q.alpha",
        "lora_unet_input_blocks_1_1_attn_to_q.lora_down.weight",
        "lora_unet_input_blocks_1_1_attn_to_q.lora_up.weight",
    ]


def test_sd3_names_its_transformer_as_onetrainer_and_comfyui_do():
    names = SD3().kohya_names(ModelConfig(config="sd3-medium"), "transformer")
    assert names["transformer_blocks.0.attn.to_q"] == "transformer_blocks.0.attn.to_q"
    layers = {
        "transformer": {
            "transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 8),
            "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 2),
        }
    }
    sd = kohya.to_kohya(layers, {"transformer": names}, {"transformer": {"transformer_blocks.0.attn.to_q": 2.0}})
    assert "lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight" in sd
    back, alphas = kohya.from_kohya(sd, {"transformer": names})
    assert back.keys() == layers.keys() and back["transformer"].keys() == layers["transformer"].keys()
    assert all(torch.equal(back["transformer"][k], v) for k, v in layers["transformer"].items())
    assert alphas == {"transformer": {"transformer_blocks.0.attn.to_q": 2.0}}


def test_cogvideox_refuses_the_kohya_layout_with_the_reason(tmp_path):
    from difftrain.lora import files as lora_files

    cfg = resolve(
        recipe="tiny-cogvideox-lora", sets=[f"train.output_dir={tmp_path}", "save.lora_formats=[kohya]"]
    ).config
    with pytest.raises(ConfigError, match="no kohya layout"):
        lora_files.formats(cfg, CogVideoX())
    cfg = resolve(recipe="tiny-cogvideox-lora", sets=[f"train.output_dir={tmp_path}"]).config
    assert lora_files.formats(cfg, CogVideoX()) == ["diffusers"]
    assert json.dumps(lora_files.formats(cfg, SD3())) == '["diffusers", "kohya"]'
