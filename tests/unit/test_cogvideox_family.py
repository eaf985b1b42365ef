"""The CogVideoX families (difftrain.families.cogvideox): bundled configs, loading, encoding, denoising, saving.

Tiny seeded models (configs/cogvideox-tiny: 2-layer transformer with 3D sincos
positions; configs/cogvideox-tiny-i2v: 32 input channels, RoPE and a learned
positional table; both with a tiny 3D VAE and T5) are built once per module.
Behaviour is checked against diffusers' own CogVideoX pipelines (prompt
encoding, RoPE, LoRA loading), real architectures by parameter counts on the
meta device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from difftrain.config.schema import ModelConfig, T5Options, TextEncodersConfig
from difftrain.errors import (
    BackendUnavailable,
    CacheMismatch,
    CheckpointError,
    ConfigError,
    DataError,
    ModelLoadError,
    UnsafeCheckpoint,
)
from difftrain.families.cogvideox import CogVideoXI2V
from difftrain.families.cogvideox.family import (
    PARTS,
    T5_TOKENS,
    CogVideoX,
    _new_module,
    _read_json,
    bundled_config_dir,
    config_name_of,
    known_configs,
)
from difftrain.families.cogvideox.positions import resample_positional_table

CAPTIONS = ["a red cat on a mat", "two dogs, " + "running far away " * 30]
REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "configs" / "cogvideox_2b_transformer.json"


@pytest.fixture(scope="module")
def fam() -> CogVideoX:
    return CogVideoX()


@pytest.fixture(scope="module")
def i2v() -> CogVideoXI2V:
    return CogVideoXI2V()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, fam) -> Path:
    return fam.build_tiny(tmp_path_factory.mktemp("cogvideox") / "tiny-cogvideox", seed=0)


@pytest.fixture(scope="module")
def tiny_i2v(tmp_path_factory, i2v) -> Path:
    return i2v.build_tiny(tmp_path_factory.mktemp("cogvideox-i2v") / "tiny-cogvideox-i2v", seed=0)


@pytest.fixture(scope="module")
def comps(fam, tiny) -> dict:
    return fam.load(ModelConfig(path=tiny), PARTS, torch.float32, "cpu")


@pytest.fixture(scope="module")
def comps_i2v(i2v, tiny_i2v) -> dict:
    return i2v.load(ModelConfig(path=tiny_i2v), PARTS, torch.float32, "cpu")


def options(**t5) -> TextEncodersConfig:
    return TextEncodersConfig(t5=T5Options(**t5))


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def config(name: str, part: str) -> dict:
    return _read_json(bundled_config_dir(name) / part / "config.json")


def meta_count(name: str, part: str) -> int:
    with torch.device("meta"):
        return count(_new_module(part, config(name, part)))


def video(b: int = 2, frames: int = 9, side: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, 3, frames, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def prompt_embeds(fam, comps) -> torch.Tensor:
    with torch.no_grad():
        return fam.encode_prompts(comps, CAPTIONS, "t5", options())["prompt_embeds"]


def _pipe(comps, cls_name: str = "CogVideoXPipeline", transformer=None):
    import diffusers

    return getattr(diffusers, cls_name)(
        tokenizer=comps["tokenizer"],
        text_encoder=comps["text_encoder"],
        vae=comps["vae"],
        transformer=transformer or comps["transformer"],
        scheduler=diffusers.CogVideoXDPMScheduler(),
    )


# ------------------------------------------------------------------ bundled configs
def test_cogvideox_2b_transformer_has_the_published_parameter_count():
    assert meta_count("cogvideox-2b", "transformer") == 1_693_783_872
    if REFERENCE.exists():  # the bundled config is the published one (shared/reference, beside the repo)
        ref = json.loads(REFERENCE.read_text())
        assert {k: v for k, v in ref.items() if not k.startswith("_")}.items() <= config(
            "cogvideox-2b", "transformer"
        ).items()


@pytest.mark.parametrize(
    "name, part, low, high",
    [
        ("cogvideox-5b", "transformer", 5_570_283_072, 5_570_283_072),  # 42 blocks of width 3072
        ("cogvideox-5b-i2v", "transformer", 5_570_479_680, 5_570_479_680),  # 32 input channels (the table is a buffer)
        ("cogvideox1.5-5b", "transformer", 5_570_676_352, 5_570_676_352),  # a Linear 2x2x2 patch, no patch bias
        ("cogvideox1.5-5b-i2v", "transformer", 5_571_594_880, 5_571_594_880),  # + 32 channels and the ofs embedding
        ("cogvideox-2b", "vae", 215e6, 216e6),  # the 3D VAE
        ("cogvideox-5b", "text_encoder", 4.7e9, 4.8e9),  # T5-XXL v1.1 encoder
    ],
)
def test_bundled_architectures_have_their_real_sizes(name, part, low, high):
    assert low <= meta_count(name, part) <= high


def test_bundled_configs_agree_on_the_cogvideox_facts():
    from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler

    for name in ("cogvideox-2b", "cogvideox-5b", "cogvideox-5b-i2v", "cogvideox1.5-5b", "cogvideox1.5-5b-i2v"):
        tr, vae, t5 = config(name, "transformer"), config(name, "vae"), config(name, "text_encoder")
        sched = _read_json(bundled_config_dir(name) / "scheduler" / "scheduler_config.json")
        assert (vae["latent_channels"], vae["temporal_compression_ratio"], len(vae["block_out_channels"])) == (16, 4, 4)
        assert vae["scaling_factor"] == (1.15258426 if name == "cogvideox-2b" else 0.7)
        assert vae["invert_scale_latents"] == name.startswith("cogvideox1.5")
        assert tr["text_embed_dim"] == t5["d_model"] == 4096 and tr["max_text_seq_length"] == T5_TOKENS
        assert (tr["num_layers"], tr["num_attention_heads"], tr["attention_head_dim"]) == (
            (30, 30, 64) if name == "cogvideox-2b" else (42, 48, 64)
        )
        assert tr["use_rotary_positional_embeddings"] == (name != "cogvideox-2b")
        assert tr["use_learned_positional_embeddings"] == (name == "cogvideox-5b-i2v")
        assert tr["in_channels"] == (32 if name.endswith("i2v") else 16)
        assert (tr["patch_size_t"], tr["ofs_embed_dim"]) == (
            (2, 512 if name.endswith("i2v") else None) if name.startswith("cogvideox1.5") else (None, None)
        )
        assert sched["prediction_type"] == "v_prediction" and sched["rescale_betas_zero_snr"] is True
        assert (sched["beta_schedule"], sched["beta_start"], sched["beta_end"], sched["timestep_spacing"]) == (
            "scaled_linear",
            0.00085,
            0.012,
            "trailing",
        )
        assert sched["snr_shift_scale"] == (3.0 if name == "cogvideox-2b" else 1.0)
        index = _read_json(bundled_config_dir(name) / "model_index.json")
        assert index["_class_name"] == (
            "CogVideoXImageToVideoPipeline" if name.endswith("i2v") else "CogVideoXPipeline"
        )
        assert index["scheduler"][1] == sched["_class_name"]
    # CogVideoX-2b ships a DDIM scheduler config; training draws from the DPM class: the same noise schedule
    cfg = _read_json(bundled_config_dir("cogvideox-2b") / "scheduler" / "scheduler_config.json")
    assert torch.equal(
        CogVideoXDDIMScheduler.from_config(cfg).alphas_cumprod, CogVideoXDPMScheduler.from_config(cfg).alphas_cumprod
    )
    assert config_name_of(config("cogvideox-5b", "transformer")) == "cogvideox-5b"


def test_unknown_or_wrong_kind_configs_name_the_known_ones(fam, i2v):
    with pytest.raises(ModelLoadError) as e:
        bundled_config_dir("cogvideox-99b")
    assert "cogvideox-5b" in e.value.hint and "cogvideox1.5-5b" in e.value.hint
    with pytest.raises(ModelLoadError):
        bundled_config_dir("sd3-medium")  # another family's config is not a CogVideoX architecture
    with pytest.raises(ModelLoadError) as e:
        fam.config_dir("cogvideox-5b-i2v")
    assert "family: cogvideox-i2v" in e.value.hint
    with pytest.raises(ModelLoadError) as e:
        i2v.config_dir("cogvideox-5b")
    assert "family: cogvideox" in e.value.hint and "cogvideox-5b-i2v" in e.value.hint
    assert {"cogvideox-2b", "cogvideox-5b", "cogvideox1.5-5b", "cogvideox-tiny"} == set(known_configs(i2v=False))
    assert {"cogvideox-5b-i2v", "cogvideox1.5-5b-i2v", "cogvideox-tiny-i2v"} == set(known_configs(i2v=True))


# ------------------------------------------------------------------ loading
def test_tiny_loads_from_a_diffusers_folder_with_a_bounded_vae(comps, fam, tiny):
    from diffusers import AutoencoderKLCogVideoX, CogVideoXTransformer3DModel
    from transformers import T5EncoderModel

    assert isinstance(comps["transformer"], CogVideoXTransformer3DModel)
    assert isinstance(comps["vae"], AutoencoderKLCogVideoX) and comps["vae"].config.latent_channels == 16
    assert isinstance(comps["text_encoder"], T5EncoderModel) and "tokenizer" in comps
    assert comps["vae"].use_slicing and comps["vae"].use_tiling
    for part in PARTS:
        assert not comps[part].training
        assert not any(p.requires_grad for p in comps[part].parameters())
    only = fam.load(ModelConfig(path=tiny), ["text_encoder"], torch.float32, "cpu", precision={"text_encoder": "bf16"})
    assert (
        set(only) == {"text_encoder", "tokenizer"} and next(only["text_encoder"].parameters()).dtype == torch.bfloat16
    )


def test_each_family_refuses_the_other_kind(fam, i2v, tiny, tiny_i2v):
    with pytest.raises(ModelLoadError) as e:
        fam.load(ModelConfig(path=tiny_i2v), ["vae"], torch.float32, "cpu")
    assert "image-to-video" in e.value.message and "family: cogvideox-i2v" in e.value.hint
    with pytest.raises(ModelLoadError) as e:
        i2v.load(ModelConfig(path=tiny), ["vae"], torch.float32, "cpu")
    assert "family: cogvideox." in e.value.hint


@pytest.mark.parametrize("prec", ["int8", "nf4"])
def test_quantized_t5_is_refused_on_cpu_with_the_bf16_hint(fam, tiny, prec):
    with pytest.raises(BackendUnavailable) as e:
        fam.load(ModelConfig(path=tiny), ["text_encoder"], torch.float32, "cpu", precision={"text_encoder": prec})
    assert prec in e.value.message and "CUDA" in e.value.message
    assert "set text_encoders.t5.precision: bf16" in e.value.hint
    with pytest.raises(ConfigError):
        fam.load(ModelConfig(path=tiny), ["transformer"], torch.float32, "cpu", precision={"transformer": "int8"})


def test_quantized_t5_without_bitsandbytes_names_the_install(fam, tiny, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(BackendUnavailable) as e:  # a CUDA device is named; the check comes before any CUDA call
        fam.load(ModelConfig(path=tiny), ["text_encoder"], torch.float32, "cuda", precision={"text_encoder": "nf4"})
    assert "not installed" in e.value.message and "set text_encoders.t5.precision: bf16" in e.value.hint


def test_bad_sources_are_named(fam, tmp_path):
    with pytest.raises(ModelLoadError) as e:
        fam.load(ModelConfig(), ["vae"], torch.float32, "cpu")
    assert "model.path" in e.value.hint
    sd3 = tmp_path / "sd3"
    (sd3 / "transformer").mkdir(parents=True)
    (sd3 / "text_encoder_3").mkdir()
    with pytest.raises(ModelLoadError) as e:
        fam.load(ModelConfig(path=sd3), ["vae"], torch.float32, "cpu")
    assert "family: sd3" in e.value.hint
    ckpt = tmp_path / "x.pt"
    torch.save({"a": torch.zeros(1)}, ckpt)
    with pytest.raises(UnsafeCheckpoint):
        fam.load(ModelConfig(path=ckpt), ["transformer"], torch.float32, "cpu")


# ------------------------------------------------------------------ single file (transformer only)
@pytest.fixture(scope="module")
def single(fam, comps, tmp_path_factory) -> Path:
    return fam.save_single_file(
        {"transformer": comps["transformer"].state_dict()},
        fam.module_configs(comps),
        tmp_path_factory.mktemp("cogvideox-file") / "transformer.safetensors",
    )


def test_transformer_single_file_round_trip_is_bit_exact(fam, comps, single):
    with safe_open(str(single), "pt") as h:
        meta = h.metadata()
        assert "transformer_blocks.0.attn1.to_q.weight" in set(h.keys())
    assert meta["difftrain.config"] == "cogvideox-tiny" and meta["difftrain.family"] == "cogvideox"
    assert json.loads(meta["difftrain.transformer_config"])["num_layers"] == 2
    back = fam.load(ModelConfig(path=single, config="cogvideox-tiny"), ["transformer"], torch.float32, "cpu")[
        "transformer"
    ]
    a = {**dict(comps["transformer"].named_parameters()), **dict(comps["transformer"].named_buffers())}
    b = {**dict(back.named_parameters()), **dict(back.named_buffers())}
    assert set(a) == set(b)  # the 2b-style sincos table (a non-persistent buffer) is rebuilt
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad[:3]
    assert not back.training and not any(p.requires_grad for p in back.parameters())


def test_i2v_single_file_keeps_the_learned_positional_table(i2v, comps_i2v, tmp_path):
    path = i2v.save_single_file(
        {"transformer": comps_i2v["transformer"].state_dict()},
        i2v.module_configs(comps_i2v),
        tmp_path / "i2v.safetensors",
    )
    back = i2v.load(ModelConfig(path=path, config="cogvideox-tiny-i2v"), ["transformer"], torch.float32, "cpu")[
        "transformer"
    ]
    a, b = comps_i2v["transformer"].state_dict(), back.state_dict()
    assert "patch_embed.pos_embedding" in b and set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_single_file_without_the_other_parts_says_which_are_missing(fam, single):
    mcfg = ModelConfig(path=single, config="cogvideox-tiny")
    with pytest.raises(ModelLoadError) as e:
        fam.load(mcfg, ["vae", "text_encoder"], torch.float32, "cpu")
    assert "VAE" in e.value.message and "T5-XXL" in e.value.message
    assert "diffusers CogVideoX folder" in e.value.hint and "precompute with the base model" in e.value.hint
    with pytest.raises(ModelLoadError):
        fam.fingerprint(mcfg, "vae", {})  # precompute hears it before anything loads
    memo: dict = {}
    assert fam.fingerprint(mcfg, "transformer", memo) == fam.fingerprint(mcfg, "transformer", memo) and memo


def test_single_file_of_another_architecture_names_the_config(fam, i2v, comps, single, tmp_path):
    with pytest.raises(ModelLoadError) as e:
        fam.load(ModelConfig(path=single, config="cogvideox-5b"), ["transformer"], torch.float32, "cpu")
    assert "cogvideox-5b" in e.value.message and "model.config: cogvideox-tiny" in e.value.hint
    from safetensors.torch import save_file

    bare = tmp_path / "bare.safetensors"  # no header: the architecture is guessed from the shapes
    save_file({k: v.contiguous() for k, v in comps["transformer"].state_dict().items()}, str(bare))
    with pytest.raises(ModelLoadError) as e:
        fam.load(ModelConfig(path=bare, config="cogvideox-2b"), ["transformer"], torch.float32, "cpu")
    assert "model.config: cogvideox-tiny" in e.value.hint
    assert fam.load(ModelConfig(path=bare, config="cogvideox-tiny"), ["transformer"], torch.float32, "cpu")
    with pytest.raises(ModelLoadError) as e:
        i2v.load(ModelConfig(path=single, config="cogvideox-tiny-i2v"), ["transformer"], torch.float32, "cpu")
    assert "family: cogvideox." in e.value.hint


def test_build_random_transformer_is_a_loadable_single_file(fam, tmp_path):
    path = fam.build_random("cogvideox-tiny", tmp_path / "random.safetensors", seed=1, parts=["transformer"])
    with safe_open(str(path), "pt") as h:
        assert h.metadata()["difftrain.config"] == "cogvideox-tiny"
        assert h.get_tensor("proj_out.weight").dtype == torch.bfloat16
    got = fam.load(ModelConfig(path=path, config="cogvideox-tiny"), ["transformer"], torch.float32, "cpu")[
        "transformer"
    ]
    assert count(got) == meta_count("cogvideox-tiny", "transformer")
    folder = fam.build_random("cogvideox-tiny", tmp_path / "random", seed=1, parts=["transformer", "vae"])
    loaded = fam.load(ModelConfig(path=folder), ["transformer", "vae"], torch.float32, "cpu")
    assert count(loaded["vae"]) == meta_count("cogvideox-tiny", "vae")
    assert json.loads((folder / "model_index.json").read_text())["text_encoder"] == [None, None]


def test_save_diffusers_round_trip_runs_in_the_pipeline(fam, comps, tiny, tmp_path):
    from diffusers import CogVideoXPipeline

    sds = {part: comps[part].state_dict() for part in ("transformer", "vae")}  # T5 never trains: copied from the source
    out = fam.save_diffusers(sds, fam.module_configs(comps), tmp_path / "export", ModelConfig(path=tiny))
    back = fam.load(ModelConfig(path=out), PARTS, torch.float32, "cpu")
    for part in PARTS:
        a, b = comps[part].state_dict(), back[part].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), part
    assert back["tokenizer"]("a cat").input_ids == comps["tokenizer"]("a cat").input_ids
    pipe = CogVideoXPipeline.from_pretrained(out, local_files_only=True)
    frames = pipe(
        "a red cat",
        num_inference_steps=2,
        num_frames=9,
        height=32,
        width=32,
        guidance_scale=1.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 9, 3, 32, 32) and torch.isfinite(frames).all()
    with pytest.raises(CheckpointError):
        fam.save_diffusers({"vae": sds["vae"]}, fam.module_configs(comps), tmp_path / "bad", ModelConfig(path=tiny))


# ------------------------------------------------------------------ encoding
@torch.no_grad()
def test_encode_images_is_the_scaled_posterior_mean_of_video(fam, comps):
    vae = comps["vae"]
    pixels = video(frames=9, side=32)
    got = fam.encode_images(comps, pixels)
    assert got.shape == (2, 16, 3, 4, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got, vae.encode(pixels).latent_dist.mean * 1.15258426)
    torch.testing.assert_close(got[1:], fam.encode_images(comps, pixels[1:]))  # slicing: one clip at a time
    one = fam.encode_images(comps, pixels[:, :, :1])
    assert one.shape == (2, 16, 1, 4, 4)
    torch.testing.assert_close(fam.encode_images(comps, pixels[:, :, 0]), one)  # an image batch is one-frame clips
    with pytest.raises(DataError) as e:
        fam.encode_images(comps, pixels[:, :, :8])
    assert "4k + 1" in e.value.message
    with pytest.raises(DataError):
        fam.encode_images(comps, pixels[..., :24])


@torch.no_grad()
def test_encode_prompts_equals_the_pipelines_prompt_encoding(fam, comps, prompt_embeds, monkeypatch):
    assert prompt_embeds.shape == (2, T5_TOKENS, 96) and prompt_embeds.dtype == torch.float32
    want, _ = _pipe(comps).encode_prompt(
        CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=226, device="cpu"
    )
    torch.testing.assert_close(prompt_embeds, want, rtol=0, atol=0)
    # 226 tokens whatever text_encoders.t5.max_length says (CogVideoX was trained with 226); a longer caption is cut
    warned: list[str] = []
    monkeypatch.setattr("difftrain.console.warn", warned.append)
    again = fam.encode_prompts(comps, CAPTIONS, "t5", options(max_length=77))["prompt_embeds"]
    assert torch.equal(again, prompt_embeds)
    assert len(warned) == 1 and "1 caption(s)" in warned[0] and "226" in warned[0]
    got = fam.combine_texts({"t5": {"prompt_embeds": prompt_embeds}}, options())
    assert got.keys() == {"prompt_embeds"} and got["prompt_embeds"] is prompt_embeds


def test_text_stage_options(fam, comps):
    assert fam.enabled_stages(options()) == ["t5"] and fam.text_stages == {"t5": ("text_encoder",)}
    assert fam.text_stage_tag("t5", options(precision="nf4")) == "t5:nf4:226"
    assert fam.stage_precision("t5", options(precision="int8")) == {"text_encoder": "int8"}
    assert fam.trainable_text_encoders == () and tuple(fam.text_encoder_lora_targets) == ()
    with pytest.raises(ConfigError) as e:
        fam.enabled_stages(options(enabled=False))
    assert "text_encoders.t5.enabled" in e.value.hint
    with pytest.raises(ConfigError):
        fam.encode_prompts(comps, CAPTIONS, "clip_l", options())


def test_cache_shapes(fam, i2v, comps, prompt_embeds):
    assert fam.cache_shapes("cogvideox-5b") == {
        "latent": {"latents": (16, 13, 60, 90), "crop": (2,)},
        "t5": {"prompt_embeds": (226, 4096)},
    }
    assert i2v.cache_shapes("cogvideox-5b-i2v")["latent"]["image_latents"] == (16, 13, 60, 90)
    assert fam.cache_shapes("cogvideox-2b", 768, frames=81)["latent"]["latents"] == (16, 21, 96, 96)
    shapes = fam.cache_shapes("cogvideox-tiny", 32, frames=9)
    with torch.no_grad():
        assert shapes["latent"]["latents"] == tuple(fam.encode_images(comps, video(1, 9, 32)).shape[1:])
    assert shapes["t5"]["prompt_embeds"] == tuple(prompt_embeds.shape[1:])


# ------------------------------------------------------------------ training
@torch.no_grad()
def test_denoise_keeps_the_cache_layout(fam, comps, prompt_embeds):
    tr = comps["transformer"]
    noisy = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([10, 900])
    out = fam.denoise(tr, noisy, t, {"prompt_embeds": prompt_embeds})
    assert out.shape == noisy.shape and torch.isfinite(out).all()
    want = tr(noisy.permute(0, 2, 1, 3, 4), encoder_hidden_states=prompt_embeds, timestep=t, return_dict=False)[0]
    torch.testing.assert_close(out, want.permute(0, 2, 1, 3, 4), rtol=0, atol=0)
    assert fam.conditioning({"bucket": [32, 32]}, {"latents": noisy[0]}) == {}
    with pytest.raises(CacheMismatch):
        fam.denoise(tr, noisy, t, {"prompt_embeds": prompt_embeds, "image_latents": noisy})


@torch.no_grad()
def test_denoise_with_rope_uses_the_pipelines_rotary_embeddings(fam, comps, prompt_embeds):
    cfg = {**dict(comps["transformer"].config), "use_rotary_positional_embeddings": True}
    torch.manual_seed(1)
    tr = _new_module("transformer", cfg).eval()
    pipe = _pipe(comps, transformer=tr)
    noisy = torch.randn(2, 16, 3, 6, 4, generator=torch.Generator().manual_seed(0))  # not the base aspect: a crop box
    t = torch.tensor([3, 700])
    rope = pipe._prepare_rotary_positional_embeddings(height=6 * 8, width=4 * 8, num_frames=3, device="cpu")
    mine = fam.rotary_embeddings(tr, 3, 6, 4, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(mine, rope))
    out = fam.denoise(tr, noisy, t, {"prompt_embeds": prompt_embeds})
    want = tr(
        noisy.permute(0, 2, 1, 3, 4),
        encoder_hidden_states=prompt_embeds,
        timestep=t,
        image_rotary_emb=rope,
        return_dict=False,
    )[0].permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert fam.rotary_embeddings(comps["transformer"], 3, 4, 4, "cpu") is None  # 2b-style sincos positions


@torch.no_grad()
def test_i2v_denoise_concatenates_the_image_latents_as_the_pipeline(i2v, comps_i2v):
    tr, pipe = comps_i2v["transformer"], _pipe(comps_i2v, "CogVideoXImageToVideoPipeline")
    img = i2v.encode_first_frame(comps_i2v, video(2, 9, 64), torch.Generator().manual_seed(0))
    lat = torch.randn(2, 16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    cond = i2v.conditioning({}, {"latents": lat[0], "image_latents": img[0]})
    assert torch.equal(cond["image_latents"], img[0])
    embeds = i2v.encode_prompts(comps_i2v, CAPTIONS, "t5", options())["prompt_embeds"]
    noisy, t = torch.randn_like(lat), torch.tensor([5, 999])
    out = i2v.denoise(tr, noisy, t, {"prompt_embeds": embeds, "image_latents": img})
    assert out.shape == noisy.shape == (2, 16, 3, 8, 8)
    rope = pipe._prepare_rotary_positional_embeddings(height=64, width=64, num_frames=3, device="cpu")
    x = torch.cat([noisy, img], dim=1).permute(0, 2, 1, 3, 4)
    want = tr(x, encoder_hidden_states=embeds, timestep=t, image_rotary_emb=rope, return_dict=False)[0]
    torch.testing.assert_close(out, want.permute(0, 2, 1, 3, 4), rtol=0, atol=0)
    with pytest.raises(CacheMismatch):
        i2v.denoise(tr, noisy, t, {"prompt_embeds": embeds})


@torch.no_grad()
def test_encode_first_frame_is_the_noise_augmented_first_frame_padded_with_zeros(i2v, comps_i2v):
    vae = comps_i2v["vae"]
    pixels = video(2, 9, 32)
    img = i2v.encode_first_frame(comps_i2v, pixels, torch.Generator().manual_seed(3))
    assert img.shape == (2, 16, 3, 4, 4) and img.dtype == torch.float32
    assert img[:, :, 1:].abs().sum() == 0 and img[:, :, 0].abs().sum() > 0
    assert torch.equal(img, i2v.encode_first_frame(comps_i2v, pixels, torch.Generator().manual_seed(3)))
    g = torch.Generator().manual_seed(3)  # what diffusers' I2V training script does, with the same draws
    sigma = torch.exp(torch.normal(-3.0, 0.5, size=(2,), generator=g))
    first = pixels[:, :, :1]
    noisy = first + torch.randn(first.shape, generator=g) * sigma[:, None, None, None, None]
    want = vae.encode(noisy).latent_dist.sample(g) * 0.7
    torch.testing.assert_close(img[:, :, :1], want)
    # a one-frame entry (an image) is padded to the video's latent frames by conditioning
    cond = i2v.conditioning({}, {"latents": torch.zeros(16, 3, 4, 4), "image_latents": img[0, :, :1]})
    assert torch.equal(cond["image_latents"], img[0])
    with pytest.raises(CacheMismatch):
        i2v.conditioning({}, {"latents": torch.zeros(16, 3, 4, 4)})
    dropped = i2v.drop_image_conditioning({"image_latents": img, "x": pixels}, torch.Generator().manual_seed(0), p=1.0)
    assert dropped["image_latents"].abs().sum() == 0 and dropped["x"] is pixels and img.abs().sum() > 0


@torch.no_grad()
def test_learned_positional_table_is_resampled_per_bucket_and_untouched_at_the_native_size(i2v, comps_i2v):
    cfg = dict(comps_i2v["transformer"].config)
    stock, tr = (_new_module("transformer", cfg).eval() for _ in range(2))
    stock.load_state_dict(comps_i2v["transformer"].state_dict())
    tr.load_state_dict(comps_i2v["transformer"].state_dict())
    pe = tr.patch_embed
    table = pe.pos_embedding
    grid = table[:, T5_TOKENS:].reshape(3, 4, 4, -1)  # the tiny table: 9 frames of 64x64 -> 3 x 4 x 4 patches
    assert grid.abs().sum() > 0
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, T5_TOKENS, 96, generator=g)

    def run(model, f, h, w):
        noisy, img = torch.randn(1, 16, f, h, w, generator=g), torch.randn(1, 16, f, h, w, generator=g)
        return noisy, img, i2v.denoise(model, noisy, torch.tensor([7]), {"prompt_embeds": embeds, "image_latents": img})

    # native size: the stored table, exactly what the stock pipeline's transformer computes
    noisy, img, out = run(tr, 3, 8, 8)
    want = stock(
        hidden_states=torch.cat([noisy, img], 1).permute(0, 2, 1, 3, 4),
        encoder_hidden_states=embeds,
        timestep=torch.tensor([7]),
        image_rotary_emb=i2v.rotary_embeddings(stock, 3, 8, 8, "cpu"),
        return_dict=False,
    )[0].permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # other sizes, which stock diffusers refuses (height/width) or silently gives a sincos table (frames)
    with pytest.raises(ValueError, match="different resolution"):
        stock.patch_embed(embeds, torch.zeros(1, 3, 32, 4, 8))
    assert run(tr, 2, 4, 8)[2].shape == (1, 16, 2, 4, 8)
    assert pe.pos_embedding is table and (pe.sample_frames, pe.sample_height, pe.sample_width) == (9, 8, 8)
    # fewer frames: the table's first frames; 2 x 4 patches in the 4 x 4 grid: RoPE's crop rows 1 and 1.5
    torch.testing.assert_close(resample_positional_table(pe, 2, 8, 8), table[:, : T5_TOKENS + 2 * 16], rtol=0, atol=0)
    got = resample_positional_table(pe, 2, 4, 8)[0, T5_TOKENS:].reshape(2, 2, 4, -1)
    assert got.shape[0] == 2 and table[:, :T5_TOKENS].abs().sum() == 0
    torch.testing.assert_close(got[:, 0], grid[:2, 1])
    torch.testing.assert_close(got[:, 1], (grid[:2, 1] + grid[:2, 2]) / 2)
    # a forward that raises leaves the stored table in place (the state dict a checkpoint would save)
    with pytest.raises(RuntimeError):
        pe(torch.zeros(1, T5_TOKENS, 5), torch.zeros(1, 2, 32, 4, 8))
    assert pe.pos_embedding is table and pe.sample_height == 8
    assert torch.equal(tr.state_dict()["patch_embed.pos_embedding"], stock.state_dict()["patch_embed.pos_embedding"])


@torch.no_grad()
@pytest.mark.parametrize("image", [False, True])
def test_cogvideox15_pairs_frames_pads_odd_counts_and_passes_ofs(fam, i2v, comps, prompt_embeds, image):
    """A tiny 1.5-style transformer (patch_size_t 2, Linear patch, RoPE by slices, ofs for I2V)."""
    cfg = {
        **dict(comps["transformer"].config),
        "patch_size_t": 2,
        "patch_bias": False,
        "use_rotary_positional_embeddings": True,
        "in_channels": 32 if image else 16,
        "ofs_embed_dim": 16 if image else None,
    }
    torch.manual_seed(2)
    tr = _new_module("transformer", cfg).eval()
    family = i2v if image else fam
    pipe = _pipe(comps, "CogVideoXImageToVideoPipeline" if image else "CogVideoXPipeline", transformer=tr)
    g = torch.Generator().manual_seed(0)
    noisy, img = torch.randn(2, 16, 3, 4, 4, generator=g), torch.randn(2, 16, 3, 4, 4, generator=g)
    img[:, :, 1:] = 0
    batch = {"prompt_embeds": prompt_embeds, **({"image_latents": img} if image else {})}
    t = torch.tensor([100, 600])
    out = family.denoise(tr, noisy, t, batch)
    assert out.shape == noisy.shape
    # what CogVideo's 1.5 fine-tuning feeds: the first frame copied in front; image latents at frame 0, then zeros
    x = torch.cat([noisy[:, :, :1], noisy], dim=2)
    if image:
        x = torch.cat([x, torch.cat([img, torch.zeros_like(img[:, :, :1])], dim=2)], dim=1)
    rope = pipe._prepare_rotary_positional_embeddings(height=32, width=32, num_frames=4, device="cpu")
    ofs = torch.full((1,), 2.0) if image else None
    want = tr(
        x.permute(0, 2, 1, 3, 4),
        encoder_hidden_states=prompt_embeds,
        timestep=t,
        ofs=ofs,
        image_rotary_emb=rope,
        return_dict=False,
    )[0][:, 1:].permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    even = torch.randn(2, 16, 4, 4, 4, generator=g)
    if image:
        batch["image_latents"] = torch.zeros_like(even)
    assert family.denoise(tr, even, t, batch).shape == even.shape


def test_training_objective_is_v_prediction_on_integer_timesteps(fam, tiny, comps, prompt_embeds):
    sched = fam.training_scheduler(ModelConfig(path=tiny))
    assert type(sched).__name__ == "CogVideoXDPMScheduler" and fam.objective == "ddpm"
    assert sched.config.prediction_type == "v_prediction" and sched.alphas_cumprod[-1] < 1e-6  # zero terminal SNR
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 16, 3, 4, 4, generator=g), torch.randn(2, 16, 3, 4, 4, generator=g)
    t = torch.randint(0, sched.config.num_train_timesteps, (2,), generator=g)  # int64, as the trainer draws them
    noisy = sched.add_noise(x0, noise, t)
    v = sched.get_velocity(x0, noise, t)
    a = sched.alphas_cumprod[t].float().view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(noisy, a.sqrt() * x0 + (1 - a).sqrt() * noise)
    torch.testing.assert_close(v, a.sqrt() * noise - (1 - a).sqrt() * x0)
    with torch.no_grad():
        pred = fam.denoise(comps["transformer"], noisy, t, {"prompt_embeds": prompt_embeds})
    # diffusers' / cogvideox-factory's loss: 1/(1 - a) |get_velocity(pred, noisy, t) - x0|^2 ... is the plain v-MSE
    factory = (1 / (1 - a) * (sched.get_velocity(pred, noisy, t) - x0) ** 2).flatten(1).mean(1)
    plain = ((pred - v) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(factory, plain, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError):
        fam.training_scheduler(ModelConfig(path=tiny, prediction_type="epsilon"))


def test_swap_blocks_are_the_transformer_blocks(fam, comps):
    assert len(fam.swap_blocks(comps["transformer"])) == 2
    with torch.device("meta"):
        tr = _new_module("transformer", config("cogvideox-5b", "transformer"))
    assert len(fam.swap_blocks(tr)) == 42


def test_memory_hints_count_the_real_transformer(fam, tmp_path):
    hints = fam.memory_hints(
        ModelConfig(path=tmp_path / "t.safetensors", config="cogvideox-5b"),
        fam.default_lora_targets,
        16,
        592,
        ["transformer"],
        ["transformer"],
        "lora",
    )
    assert hints["parts"]["transformer"]["total"] == 5_570_283_072
    assert hints["lora_params"] == 42 * 4 * 16 * (3072 + 3072)  # to_q, to_k, to_v, to_out.0 of every block
    assert hints["latent_pixels"] == 13 * 74 * 74  # 49 frames -> 13 latent frames of the largest bucket's area
    assert len(hints["swap_units"]) == 42 and sum(hints["swap_units"]) < hints["parts"]["transformer"]["total"]
    with torch.device("meta"):
        tr = _new_module("transformer", config("cogvideox-5b", "transformer"))
    in_blocks = sum(m.weight.numel() for m in tr.transformer_blocks.modules() if isinstance(m, torch.nn.Linear))
    assert hints["parts"]["transformer"]["fp8_eligible"] == in_blocks  # the embeddings and output layers stay out
    assert (
        fam.memory_hints(
            ModelConfig(path=tmp_path / "t.safetensors", config="cogvideox-5b"),
            [],
            16,
            592,
            ["transformer"],
            ["transformer"],
            "lora",
            frames=81,
        )["latent_pixels"]
        == 21 * 74 * 74
    )


def test_lora_saved_by_the_family_loads_in_the_pipeline(fam, comps, tiny, prompt_embeds, tmp_path):
    from diffusers import CogVideoXPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = CogVideoXPipeline.from_pretrained(tiny, local_files_only=True)
    noisy = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond, t = {"prompt_embeds": prompt_embeds[:1]}, torch.tensor([500])
    with torch.no_grad():
        base = fam.denoise(pipe.transformer, noisy, t, cond)
    tr = _new_module("transformer", dict(comps["transformer"].config))
    tr.load_state_dict(comps["transformer"].state_dict())
    lcfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=fam.default_lora_targets)
    tr.add_adapter(lcfg)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        trained = fam.denoise(tr, noisy, t, cond)
    fam.save_lora(
        tmp_path / "lora", {"transformer": get_peft_model_state_dict(tr)}, metadata={"transformer": lcfg.to_dict()}
    )
    pipe.load_lora_weights(tmp_path / "lora")
    with torch.no_grad():
        loaded = fam.denoise(pipe.transformer, noisy, t, cond)
    assert (loaded - base).abs().max() > 1e-3  # the LoRA changes the transformer's output ...
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)  # ... exactly as in training (alpha kept)
    with pytest.raises(CheckpointError):
        fam.save_lora(tmp_path / "bad", {"text_encoder": {"x": torch.zeros(1)}})


def test_family_pipelines_are_built_over_the_loaded_parts(fam, i2v, comps, comps_i2v, tiny, tiny_i2v):
    pipe = fam.pipeline(comps, ModelConfig(path=tiny))
    assert type(pipe).__name__ == "CogVideoXPipeline" and pipe.transformer is comps["transformer"]
    assert type(pipe.scheduler).__name__ == "CogVideoXDPMScheduler" and pipe.scheduler.config.snr_shift_scale == 3.0
    pipe = i2v.pipeline(comps_i2v, ModelConfig(path=tiny_i2v))
    assert type(pipe).__name__ == "CogVideoXImageToVideoPipeline" and pipe.vae is comps_i2v["vae"]
    assert i2v.name == "cogvideox-i2v" and i2v.image_conditioned and not fam.image_conditioned
