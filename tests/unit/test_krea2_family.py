"""Krea 2 on tiny seeded models of the real layout: the bundled real architecture's sizes, the text taps and the
transformer's inputs exactly as Krea2Pipeline builds them (the padding rows dropped from the cache give the same
prediction), Krea's original file layout both ways (against diffusers' own converter), loading a transformer file,
and a Turbo checkpoint warned about."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import ModelLoadError
from difftrain.families.krea2 import Krea2
from difftrain.families.krea2 import single_file as sf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Krea2().build_tiny(tmp_path_factory.mktemp("krea2") / "m", seed=0)


def test_the_bundled_architecture_has_the_released_models_sizes():
    """Krea 2's 12.82B transformer (the class's defaults: 28 blocks of 6 144), Qwen3-VL-4B-Instruct (4.44B, its
    vision tower included) and the Qwen-Image VAE, built on the meta device from the bundled configs."""
    fam = Krea2()
    mcfg = ModelConfig(config="krea2")
    with torch.device("meta"):
        counts = {
            p: sum(x.numel() for x in fam.empty_part(mcfg, p).parameters())
            for p in ("transformer", "text_encoder", "vae")
        }
    assert counts == {"transformer": 12_820_073_036, "text_encoder": 4_437_815_808, "vae": 126_892_531}
    assert fam.select_layers(mcfg) == (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


def test_captions_are_the_pipelines_text_states_without_the_padding(tiny):
    from diffusers import Krea2Pipeline

    fam = Krea2()
    comps = fam.load(ModelConfig(path=tiny), ["text_encoder"])
    assert comps["text_encoder"].difftrain_text_layers == (1, 2, 3, 4)  # the tiny model's pipeline config
    opts = resolve(recipe="tiny-krea2-lora", sets=[f"model.path={tiny}", "data.dir=."]).config.text_encoders
    captions = ["a fox in the snow", "a much longer caption: a cat on a red sofa, evening light"]
    got = fam.encode_prompts(comps, captions, "qwen3vl", opts)["prompt_embeds"]
    pipe = Krea2Pipeline.from_pretrained(tiny)
    states, mask = pipe.get_text_hidden_states(captions, device=torch.device("cpu"))
    assert states.shape[2] == 4  # the tapped layers (512 caption rows plus the suffix beyond the real one's 5 tokens)
    for i, g in enumerate(got):
        torch.testing.assert_close(g, states[i][mask[i]].float())
    assert got[0].shape[0] < got[1].shape[0]


def test_the_transformer_gets_the_pipelines_inputs_and_dropped_padding_changes_nothing(tiny):
    """A batch of two captions of different lengths (padded by collate_text, the padding masked) gives each sample
    what the pipeline's call gives it with its full 512-row text and mask."""
    from diffusers import Krea2Pipeline

    fam = Krea2()
    comps = fam.load(ModelConfig(path=tiny), ["transformer", "text_encoder"])
    pipe = Krea2Pipeline.from_pretrained(tiny)
    captions = ["a fox", "a cat on a red sofa in the evening light"]
    states, mask = pipe.get_text_hidden_states(captions, device=torch.device("cpu"))
    opts = resolve(recipe="tiny-krea2-lora", sets=[f"model.path={tiny}", "data.dir=."]).config.text_encoders
    cached = fam.encode_prompts(comps, captions, "qwen3vl", opts)["prompt_embeds"]
    batch = fam.collate_text("qwen3vl", [{"prompt_embeds": t} for t in cached])
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 16, 8, 12, generator=g)
    t = torch.tensor([250.0, 900.0])
    tr = comps["transformer"]
    with torch.no_grad():
        got = fam.denoise(tr, noisy, t, batch)
        for i in range(2):
            want = tr(
                hidden_states=pipe._pack_latents(noisy[i : i + 1], 1, 16, 8, 12),
                encoder_hidden_states=states[i : i + 1],
                timestep=t[i : i + 1] / 1000,
                position_ids=pipe.prepare_position_ids(states.shape[1], 4, 6, torch.device("cpu")),
                encoder_attention_mask=mask[i : i + 1],
                return_dict=False,
            )[0]
            want = pipe._unpack_latents(want, 64, 96).squeeze(2)  # the pipeline's unpacking, pixels 64x96
            torch.testing.assert_close(got[i : i + 1], want, rtol=1e-4, atol=1e-5)


def test_the_original_layout_is_diffusers_converters_both_ways(tiny):
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    from difftrain.families.common import LazyTensors

    tr = Krea2().load(ModelConfig(path=tiny), ["transformer"])["transformer"]
    sd = tr.state_dict()
    original = dict(LazyTensors(sf.to_single_file(sd)).items())
    assert "blocks.0.attn.wq.weight" in original and "txtfusion.projector.weight" in original
    assert original["blocks.1.mod.lin"].ndim == 1  # the block's six modulation vectors, flat
    back = convert_krea2_transformer_checkpoint_to_diffusers({f"{sf.PREFIX}{k}": v for k, v in original.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    ours = dict(sf.transformer_tensors(list(original), original.__getitem__))
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)
    assert sf.module_to_original("transformer_blocks.0.attn.to_out.0") == "blocks.0.attn.wo"
    assert sf.module_to_original("text_fusion.refiner_blocks.0.ff.down") == "txtfusion.refiner_blocks.0.mlp.down"


def test_comfyui_files_load_the_transformer_vae_and_qwen3vl(tiny, tmp_path):
    from safetensors.torch import save_file

    from difftrain.families.common import LazyTensors

    fam = Krea2()
    ref = fam.load(ModelConfig(path=tiny), ["transformer", "vae", "text_encoder"], tokenizers=False)
    original = dict(LazyTensors(sf.to_single_file(ref["transformer"].state_dict())).items())
    save_file({f"{sf.PREFIX}{k}": v.contiguous() for k, v in original.items()}, tmp_path / "krea2.safetensors")
    save_file({k: v.contiguous() for k, v in ref["vae"].state_dict().items()}, tmp_path / "vae.safetensors")
    from test_wan_family import _wan_vae_name  # Wan 2.1's own VAE names (checked there against diffusers' converter)

    wan_named = {_wan_vae_name(k): v.contiguous() for k, v in ref["vae"].state_dict().items()}
    save_file(wan_named, tmp_path / "qwen_image_vae.safetensors")
    save_file(
        {k: v.contiguous() for k, v in ref["text_encoder"].state_dict().items()}, tmp_path / "qwen3vl.safetensors"
    )
    mcfg = ModelConfig(path=tmp_path / "krea2.safetensors", config="krea2-tiny", ae=tmp_path / "vae.safetensors",
                       text_encoder=tmp_path / "qwen3vl.safetensors", tokenizer_path=tiny / "tokenizer")  # fmt: skip
    got = fam.load(mcfg, ["transformer", "vae", "text_encoder"])
    for part in ("transformer", "vae", "text_encoder"):
        want, have = ref[part].state_dict(), got[part].state_dict()
        assert set(have) == set(want) and all(torch.equal(have[k], want[k]) for k in want), part
    comfy_vae = fam.load(ModelConfig(path=tiny, ae=tmp_path / "qwen_image_vae.safetensors"), ["vae"])[
        "vae"
    ].state_dict()
    assert all(torch.equal(comfy_vae[k], v) for k, v in ref["vae"].state_dict().items())
    with pytest.raises(ModelLoadError, match="does not look like a Krea 2 transformer"):
        fam.load(ModelConfig(path=tmp_path / "vae.safetensors", config="krea2-tiny"), ["transformer"])


def test_a_distilled_checkpoint_is_warned_about_naming_raw(tiny, tmp_path, capsys):
    from difftrain.families import llm_image

    turbo = tmp_path / "distilled"
    shutil.copytree(tiny, turbo)
    index = json.loads((turbo / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    llm_image._WARNED.clear()
    Krea2().load(ModelConfig(path=turbo), ["transformer"])
    err = " ".join(capsys.readouterr().err.split())
    assert "distilled checkpoint" in err and "train on Krea-2-Raw" in err
    llm_image._WARNED.clear()
    Krea2().load(ModelConfig(path=tiny), ["transformer"])
    assert "distilled" not in capsys.readouterr().err
