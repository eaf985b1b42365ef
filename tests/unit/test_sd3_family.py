"""The SD3 family (difftrain.families.sd3): bundled configs, loading, encoding, saving.

A tiny seeded SD3 (configs/sd3-tiny: MMDiT with a dual-attention block and
RMS qk-norm, 16-channel VAE, CLIP-L, CLIP-G, T5, offline tokenizers) is built
once per module. Behaviour is checked against diffusers' own
StableDiffusion3Pipeline (prompt encoding, LoRA loading) and its single-file
loader, and real architectures are checked by parameter counts on the meta
device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from difftrain.config.schema import ModelConfig, T5Options, TextEncodersConfig
from difftrain.errors import BackendUnavailable, ModelLoadError, UnsafeCheckpoint
from difftrain.families.sd3.family import (
    PARTS,
    SD3,
    _new_module,
    _read_json,
    bundled_config_dir,
    known_configs,
)

CAPTIONS = ["a red cat on a mat", "two dogs, " + "running far away " * 12]
T5_LEN = 96
REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "configs" / "sd3_medium_transformer.json"


@pytest.fixture(scope="module")
def fam() -> SD3:
    return SD3()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, fam) -> Path:
    return fam.build_tiny(tmp_path_factory.mktemp("sd3") / "tiny-sd3", seed=0)


@pytest.fixture(scope="module")
def comps(fam, tiny) -> dict:
    return fam.load(ModelConfig(path=tiny), PARTS, torch.float32, "cpu")


@pytest.fixture(scope="module")
def single(fam, comps, tmp_path_factory) -> Path:
    sds = {part: comps[part].state_dict() for part in PARTS}
    return fam.save_single_file(
        sds, fam.module_configs(comps), tmp_path_factory.mktemp("sd3-file") / "tiny-sd3.safetensors"
    )


def options(**t5) -> TextEncodersConfig:
    return TextEncodersConfig(t5=T5Options(**{"max_length": T5_LEN, **t5}))


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def meta_count(config: str, part: str) -> int:
    with torch.device("meta"):
        return count(_new_module(part, _read_json(bundled_config_dir(config) / part / "config.json")))


# ------------------------------------------------------------------ bundled configs
def test_sd3_medium_transformer_has_the_published_parameter_count():
    assert meta_count("sd3-medium", "transformer") == 2_028_328_000
    if REFERENCE.exists():  # the bundled config is the published one (shared/reference, beside the repo)
        ref = json.loads(REFERENCE.read_text())
        bundled = _read_json(bundled_config_dir("sd3-medium") / "transformer" / "config.json")
        assert {k: v for k, v in ref.items() if not k.startswith("_")}.items() <= bundled.items()


@pytest.mark.parametrize(
    "config, part, low, high",
    [
        ("sd3.5-medium", "transformer", 2.20e9, 2.30e9),  # 2.24B: 13 dual-attention blocks, RMS qk-norm
        ("sd3.5-large", "transformer", 8.0e9, 8.2e9),  # ~8.1B: 38 blocks of width 2432
        ("sd3-medium", "text_encoder", 123e6, 124e6),  # CLIP-L with its 768x768 projection
        ("sd3-medium", "text_encoder_2", 694e6, 695e6),  # CLIP-G (bigG)
        ("sd3-medium", "text_encoder_3", 4.7e9, 4.8e9),  # T5-XXL v1.1 encoder
        ("sd3-medium", "vae", 83e6, 84e6),  # 16-channel VAE without quant convs
    ],
)
def test_bundled_architectures_have_their_real_sizes(config, part, low, high):
    assert low <= meta_count(config, part) <= high


def test_bundled_configs_agree_on_the_sd3_facts():
    for name in ("sd3-medium", "sd3.5-medium", "sd3.5-large"):
        d = bundled_config_dir(name)
        tr, vae = _read_json(d / "transformer" / "config.json"), _read_json(d / "vae" / "config.json")
        t5 = _read_json(d / "text_encoder_3" / "config.json")
        assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 1.5305, 0.0609)
        assert not vae["use_quant_conv"] and not vae["use_post_quant_conv"]
        assert tr["joint_attention_dim"] == t5["d_model"] == 4096 and t5["feed_forward_proj"] == "gated-gelu"
        assert tr["caption_projection_dim"] == tr["num_attention_heads"] * tr["attention_head_dim"]
        assert _read_json(d / "scheduler" / "scheduler_config.json")["shift"] == 3.0
    assert _read_json(bundled_config_dir("sd3.5-medium") / "transformer" / "config.json")[
        "dual_attention_layers"
    ] == list(range(13))


def test_unknown_config_names_the_known_ones():
    with pytest.raises(ModelLoadError) as e:
        bundled_config_dir("sd3-huge")
    assert "sd3.5-large" in e.value.hint and "sd3-medium" in e.value.hint
    with pytest.raises(ModelLoadError):
        bundled_config_dir("sdxl-base-1.0")  # another family's config is not an SD3 architecture
    assert {"sd3-medium", "sd3.5-medium", "sd3.5-large", "sd3-tiny"} <= set(known_configs())


# ------------------------------------------------------------------ loading
def test_tiny_loads_from_a_diffusers_folder(comps):
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    assert isinstance(comps["transformer"], SD3Transformer2DModel)
    assert isinstance(comps["vae"], AutoencoderKL) and comps["vae"].config.latent_channels == 16
    assert isinstance(comps["text_encoder"], CLIPTextModelWithProjection)
    assert isinstance(comps["text_encoder_2"], CLIPTextModelWithProjection)
    assert isinstance(comps["text_encoder_3"], T5EncoderModel)
    assert {"tokenizer", "tokenizer_2", "tokenizer_3"} <= set(comps)
    for part in PARTS:
        assert not comps[part].training
        assert not any(p.requires_grad for p in comps[part].parameters())


def test_only_the_tokenizers_of_loaded_encoders_are_loaded(fam, tiny):
    got = fam.load(
        ModelConfig(path=tiny), ["text_encoder_3"], torch.float32, "cpu", precision={"text_encoder_3": "bf16"}
    )
    assert set(got) == {"text_encoder_3", "tokenizer_3"}
    assert next(got["text_encoder_3"].parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("prec", ["int8", "nf4"])
def test_quantized_t5_is_refused_on_cpu_with_the_bf16_hint(fam, tiny, prec):
    with pytest.raises(BackendUnavailable) as e:
        fam.load(ModelConfig(path=tiny), ["text_encoder_3"], torch.float32, "cpu", precision={"text_encoder_3": prec})
    assert prec in e.value.message and "CUDA" in e.value.message
    assert "set text_encoders.t5.precision: bf16" in e.value.hint


def test_pickle_checkpoints_are_refused_unless_allowed(fam, tiny, single, tmp_path):
    ckpt = tmp_path / "tiny.ckpt"
    with safe_open(str(single), "pt") as h:
        torch.save({"state_dict": {k: h.get_tensor(k) for k in h.keys()}}, ckpt)  # noqa: SIM118
    with pytest.raises(UnsafeCheckpoint) as e:
        fam.load(ModelConfig(path=ckpt, config="sd3-tiny"), ["vae"], torch.float32, "cpu")
    assert "--allow-pickle" in e.value.hint
    vae = fam.load(ModelConfig(path=ckpt, config="sd3-tiny", allow_pickle=True), ["vae"], torch.float32, "cpu")["vae"]
    with safe_open(str(single), "pt") as h:
        assert torch.equal(vae.encoder.conv_in.weight, h.get_tensor("first_stage_model.encoder.conv_in.weight"))


# ------------------------------------------------------------------ single file
def test_single_file_has_the_distributed_sd3_layout(single):
    with safe_open(str(single), "pt") as h:
        keys = set(h.keys())
    for prefix in (
        "model.diffusion_model.",
        "first_stage_model.",
        "text_encoders.clip_l.transformer.text_model.",
        "text_encoders.clip_g.transformer.text_model.",
        "text_encoders.t5xxl.transformer.",
    ):
        assert any(k.startswith(prefix) for k in keys), prefix
    assert "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight" in keys
    assert "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight" in keys  # dual attention (SD3.5)
    assert "model.diffusion_model.final_layer.adaLN_modulation.1.weight" in keys
    assert (
        "model.diffusion_model.joint_blocks.1.context_block.attn.proj.weight" not in keys
    )  # last context block is pre-only
    assert "text_encoders.t5xxl.transformer.shared.weight" in keys
    assert not any("quant_conv" in k or "position_ids" in k for k in keys)


def test_single_file_round_trip_is_bit_exact_per_part(fam, comps, tiny, single):
    back = fam.load(ModelConfig(path=single, config="sd3-tiny", tokenizer_path=tiny), PARTS, torch.float32, "cpu")
    for part in PARTS:
        a, b = comps[part].state_dict(), back[part].state_dict()
        assert set(a) == set(b), part
        bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not bad, f"{part}: {bad[:3]}"
    t5 = back["text_encoder_3"]
    assert t5.encoder.embed_tokens.weight is t5.shared.weight


def test_single_file_loads_in_diffusers_own_single_file_loader(comps, tiny, single):
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    tr = SD3Transformer2DModel.from_single_file(
        str(single), config=str(tiny), subfolder="transformer", local_files_only=True
    )
    vae = AutoencoderKL.from_single_file(str(single), config=str(tiny), subfolder="vae", local_files_only=True)
    for mine, theirs in ((comps["transformer"], tr), (comps["vae"], vae)):
        a, b = mine.state_dict(), theirs.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_single_file_without_text_encoders_says_which_are_missing(fam, comps, tmp_path):
    sds = {part: comps[part].state_dict() for part in ("transformer", "vae")}
    path = fam.save_single_file(sds, fam.module_configs(comps), tmp_path / "no-encoders.safetensors")
    mcfg = ModelConfig(path=path, config="sd3-tiny")  # no tokenizer_path: the missing weights are named first
    assert set(fam.load(mcfg, ["transformer", "vae"], torch.float32, "cpu")) == {"transformer", "vae"}
    with pytest.raises(ModelLoadError) as e:
        fam.load(mcfg, ["text_encoder", "text_encoder_3"], torch.float32, "cpu")
    assert "CLIP-L" in e.value.message and "T5-XXL" in e.value.message
    assert "diffusers" in e.value.hint and "text_encoders.t5.enabled: false" in e.value.hint


def test_single_file_t5_needs_a_tokenizer_path(fam, single):
    with pytest.raises(ModelLoadError) as e:
        fam.load(ModelConfig(path=single, config="sd3-tiny"), ["text_encoder_3"], torch.float32, "cpu")
    assert "T5" in e.value.message
    assert "model.tokenizer_path" in e.value.hint and "text_encoders.t5.enabled: false" in e.value.hint


def test_single_file_of_another_architecture_names_the_config(fam, single):
    with pytest.raises(ModelLoadError) as e:  # default config sd3-medium, tiny weights
        fam.load(ModelConfig(path=single), ["transformer"], torch.float32, "cpu")
    assert "sd3-medium" in e.value.message and "model.config" in e.value.hint


def test_sdxl_files_are_recognised_as_such(fam, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "sdxl.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ModelLoadError) as e:
        fam.load(ModelConfig(path=path), ["vae"], torch.float32, "cpu")
    assert "family: sdxl" in e.value.hint


def test_save_diffusers_round_trip(fam, comps, tiny, tmp_path):
    sds = {part: comps[part].state_dict() for part in PARTS}
    out = fam.save_diffusers(sds, fam.module_configs(comps), tmp_path / "export", ModelConfig(path=tiny))
    back = fam.load(ModelConfig(path=out), PARTS, torch.float32, "cpu")
    for part in PARTS:
        a, b = comps[part].state_dict(), back[part].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), part
    assert back["tokenizer_3"]("a cat").input_ids == comps["tokenizer_3"]("a cat").input_ids


# ------------------------------------------------------------------ encoding
def _pipe(comps, t5: bool = True):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=comps["transformer"],
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=comps["vae"],
        text_encoder=comps["text_encoder"],
        tokenizer=comps["tokenizer"],
        text_encoder_2=comps["text_encoder_2"],
        tokenizer_2=comps["tokenizer_2"],
        text_encoder_3=comps["text_encoder_3"] if t5 else None,
        tokenizer_3=comps["tokenizer_3"] if t5 else None,
    )


@pytest.fixture(scope="module")
def stages(fam, comps) -> dict:
    """What precompute caches per stage for CAPTIONS (batched, as the trainer stacks cache entries)."""
    with torch.no_grad():
        return {s: fam.encode_prompts(comps, CAPTIONS, s, options()) for s in fam.enabled_stages(options())}


@torch.no_grad()
def test_cached_stages_join_into_the_pipelines_prompt_embeddings(fam, comps, stages):
    assert list(stages) == ["clip_l", "clip_g", "t5"]
    assert stages["clip_l"]["clip_l_embeds"].shape == (2, 77, 32) and stages["clip_g"]["clip_g_pooled"].shape == (2, 32)
    assert stages["t5"]["t5_embeds"].shape == (2, T5_LEN, 96)
    assert all(v.dtype == torch.float32 for out in stages.values() for v in out.values())
    got = fam.combine_texts(stages, options())
    want, _, pooled, _ = _pipe(comps).encode_prompt(
        CAPTIONS, None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=T5_LEN
    )
    assert want.shape == (2, 77 + T5_LEN, 96)
    torch.testing.assert_close(got["prompt_embeds"], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got["pooled_prompt_embeds"], pooled, rtol=0, atol=1e-6)
    assert fam.conditioning({"bucket": [64, 64], "original_size": [64, 64]}, {"latents": torch.zeros(16, 8, 8)}) == {}


@torch.no_grad()
def test_without_t5_the_joint_sequence_ends_in_zeros_as_in_the_pipeline(fam, comps, stages):
    off = options(enabled=False)
    assert fam.enabled_stages(off) == ["clip_l", "clip_g"]
    assert fam.encode_prompts(comps, CAPTIONS, "t5", off) == {}
    got = fam.combine_texts({s: stages[s] for s in fam.enabled_stages(off)}, off)["prompt_embeds"]
    want = _pipe(comps, t5=False).encode_prompt(
        CAPTIONS, None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=T5_LEN
    )[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[:, 77:].abs().sum() == 0 and got[:, :77].abs().sum() > 0
    # the zeros' width is the loaded transformer's joint_attention_dim; SD3's 4096 before any transformer is loaded
    assert SD3().combine_texts({s: stages[s] for s in ("clip_l", "clip_g")}, off)["prompt_embeds"].shape == (
        2,
        77 + T5_LEN,
        4096,
    )


def test_clip_stages_encoded_on_the_fly_are_differentiable_and_match_the_cache(fam, comps, stages):
    """A CLIP LoRA trains over cached T5 embeddings: the live stages give the cached numbers, and gradients."""
    w = comps["text_encoder"].text_model.encoder.layers[0].self_attn.q_proj.weight
    w.requires_grad_(True)
    try:
        live = {s: fam.encode_prompts(comps, CAPTIONS, s, options()) for s in ("clip_l", "clip_g")}
        out = fam.combine_texts({**live, "t5": stages["t5"]}, options())
        (out["prompt_embeds"].square().sum() + out["pooled_prompt_embeds"].sum()).backward()
        assert w.grad is not None and w.grad.abs().sum() > 0
    finally:
        w.requires_grad_(False)
        w.grad = None
    cached = fam.combine_texts(stages, options())
    for k in ("prompt_embeds", "pooled_prompt_embeds"):
        torch.testing.assert_close(out[k].detach(), cached[k], rtol=0, atol=1e-6)
    # the token-level path gives the same numbers
    with torch.no_grad():
        ids = fam.tokenize(comps, CAPTIONS, t5_max_length=T5_LEN)
        assert [tuple(i.shape) for i in ids] == [(2, 77), (2, 77), (2, T5_LEN)]
        tok = fam.encode_tokens(comps, *ids)
    torch.testing.assert_close(tok["prompt_embeds"], cached["prompt_embeds"], rtol=0, atol=1e-6)
    assert fam.trainable_text_encoders == ("text_encoder", "text_encoder_2")


def test_stage_tags_and_precisions(fam):
    assert fam.text_stage_tag("t5", options(precision="int8")) == f"t5:int8:{T5_LEN}"
    assert fam.text_stage_tag("t5", options(enabled=False)) == "t5:off"
    assert fam.text_stage_tag("clip_l", options()) == "" and fam.text_stage_tag("clip_g", options()) == ""
    assert fam.stage_precision("t5", options(precision="nf4")) == {"text_encoder_3": "nf4"}
    assert fam.stage_precision("clip_g", options()) is None


@torch.no_grad()
def test_encode_images_is_the_shifted_scaled_posterior_mean(fam, comps):
    torch.manual_seed(0)
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    got = fam.encode_images(comps, pixels)
    vae = comps["vae"]
    mean = vae.encode(pixels).latent_dist.mean
    assert got.shape == (2, 16, 4, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got, (mean - 0.0609) * 1.5305)


def test_cache_shapes_are_what_encoding_gives(fam, comps, stages):
    shapes = fam.cache_shapes("sd3-tiny", 64, t5_max_length=T5_LEN)
    assert shapes["latent"]["latents"] == (16, 8, 8)
    for stage, out in stages.items():
        assert shapes[stage] == {k: tuple(v.shape[1:]) for k, v in out.items()}


def test_cache_shapes_of_the_real_architecture(fam):
    shapes = fam.cache_shapes("sd3-medium", 1024)
    assert shapes == {
        "latent": {"latents": (16, 128, 128), "crop": (2,)},
        "clip_l": {"clip_l_embeds": (77, 768), "clip_l_pooled": (768,)},
        "clip_g": {"clip_g_embeds": (77, 1280), "clip_g_pooled": (1280,)},
        "t5": {"t5_embeds": (256, 4096)},
    }


# ------------------------------------------------------------------ training
@torch.no_grad()
def test_denoise_keeps_the_latent_shape_and_swap_blocks_are_the_joint_blocks(fam, comps):
    torch.manual_seed(0)
    noisy = torch.randn(2, 16, 8, 8)
    cond = fam.encode_tokens(comps, *fam.tokenize(comps, CAPTIONS, t5_max_length=T5_LEN))
    assert cond["prompt_embeds"].shape == (2, 77 + T5_LEN, 96)
    out = fam.denoise(comps["transformer"], noisy, torch.tensor([250.0, 900.5]), cond)
    assert out.shape == noisy.shape and torch.isfinite(out).all()
    assert len(fam.swap_blocks(comps["transformer"])) == comps["transformer"].config.num_layers == 2
    with torch.device("meta"):
        large = _new_module(
            "transformer", _read_json(bundled_config_dir("sd3.5-large") / "transformer" / "config.json")
        )
    assert len(fam.swap_blocks(large)) == 38


def test_training_scheduler_is_flow_matching_with_sd3_shift(fam, tiny):
    sched = fam.training_scheduler(ModelConfig(path=tiny))
    assert type(sched).__name__ == "FlowMatchEulerDiscreteScheduler" and sched.config.shift == 3.0
    assert fam.objective == "flow"


def test_memory_hints_count_the_real_transformer(fam, tmp_path):
    hints = fam.memory_hints(
        ModelConfig(path=tmp_path / "sd3.safetensors", config="sd3-medium"),
        fam.default_lora_targets,
        16,
        1024,
        ["transformer", "vae"],
        ["transformer"],
        "lora",
    )
    assert hints["parts"]["transformer"]["total"] == 2_028_328_000
    # 24 blocks x 8 projections of 1536 -> 1536 (the last block has no to_add_out): rank 16 x (in + out)
    assert hints["lora_params"] == (24 * 8 - 1) * 16 * (1536 + 1536)
    assert hints["latent_pixels"] == 128 * 128
    assert hints["denoiser"] == "transformer" and len(hints["swap_units"]) == 24
    assert sum(hints["swap_units"]) < hints["parts"]["transformer"]["total"]
    # fp8 may take every block's linear weights, none of the embeddings or the output layers
    with torch.device("meta"):
        tr = _new_module("transformer", _read_json(bundled_config_dir("sd3-medium") / "transformer" / "config.json"))
    in_blocks = sum(m.weight.numel() for m in tr.transformer_blocks.modules() if isinstance(m, torch.nn.Linear))
    assert hints["parts"]["transformer"]["fp8_eligible"] == hints["parts"]["transformer"]["linear"] == in_blocks


def test_lora_saved_by_the_family_loads_in_the_sd3_pipeline(fam, comps, tiny, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny, local_files_only=True)
    torch.manual_seed(0)
    noisy = torch.randn(1, 16, 8, 8)
    with torch.no_grad():
        cond = fam.encode_tokens(comps, *fam.tokenize(comps, CAPTIONS[:1], t5_max_length=T5_LEN))
        base = fam.denoise(pipe.transformer, noisy, torch.tensor([500.0]), cond)

    tr = _new_module("transformer", dict(comps["transformer"].config))
    tr.load_state_dict(comps["transformer"].state_dict())
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=fam.default_lora_targets)
    tr.add_adapter(config)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        trained = fam.denoise(tr, noisy, torch.tensor([500.0]), cond)
    layers = {"transformer": get_peft_model_state_dict(tr)}
    fam.save_lora(tmp_path / "lora", layers, metadata={"transformer": config.to_dict()})

    pipe.load_lora_weights(tmp_path / "lora")
    with torch.no_grad():
        loaded = fam.denoise(pipe.transformer, noisy, torch.tensor([500.0]), cond)
    assert (loaded - base).abs().max() > 1e-3  # the LoRA changes the transformer's output ...
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)  # ... exactly as it did in training (alpha kept)


def test_quantized_t5_without_bitsandbytes_names_the_install_and_the_bf16_way_out(fam, tiny, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(BackendUnavailable) as e:  # a CUDA device is named; the check comes before any CUDA call
        fam.load(
            ModelConfig(path=tiny), ["text_encoder_3"], torch.float32, "cuda", precision={"text_encoder_3": "int8"}
        )
    assert "bitsandbytes" in e.value.message and "not installed" in e.value.message
    assert "set text_encoders.t5.precision: bf16" in e.value.hint


def test_single_file_fingerprints_are_per_part(fam, comps, single, tmp_path):
    sds = {part: dict(comps[part].state_dict()) for part in PARTS}
    sds["transformer"]["proj_out.bias"] = sds["transformer"]["proj_out.bias"] + 1
    other = fam.save_single_file(sds, fam.module_configs(comps), tmp_path / "other.safetensors")
    memo: dict = {}
    a, b = ModelConfig(path=single, config="sd3-tiny"), ModelConfig(path=other, config="sd3-tiny")
    assert fam.fingerprint(a, "transformer", memo) != fam.fingerprint(b, "transformer", memo)
    for part in ("vae", "text_encoder", "text_encoder_3"):  # the cache of an unchanged encoder stays valid
        assert fam.fingerprint(a, part, memo) == fam.fingerprint(b, part, memo)


def test_save_diffusers_from_a_file_without_t5_runs_in_the_pipeline_without_t5(fam, comps, tiny, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    parts = [p for p in PARTS if p != "text_encoder_3"]
    sds = {part: comps[part].state_dict() for part in parts}
    src = fam.save_single_file(sds, fam.module_configs(comps), tmp_path / "no-t5.safetensors")
    mcfg = ModelConfig(path=src, config="sd3-tiny", tokenizer_path=tiny)
    loaded = fam.load(mcfg, parts, torch.float32, "cpu")
    out = fam.save_diffusers(
        {p: loaded[p].state_dict() for p in parts}, fam.module_configs(loaded), tmp_path / "export", mcfg
    )
    index = json.loads((out / "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and not (out / "text_encoder_3").exists()
    # as with a folder diffusers itself saved without T5: load it with text_encoder_3=None
    pipe = StableDiffusion3Pipeline.from_pretrained(out, text_encoder_3=None, tokenizer_3=None, local_files_only=True)
    image = pipe(
        "a red cat",
        num_inference_steps=2,
        height=64,
        width=64,
        guidance_scale=1.0,
        max_sequence_length=T5_LEN,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


def test_family_pipeline_is_built_over_the_loaded_parts(fam, comps, tiny):
    pipe = fam.pipeline(comps, ModelConfig(path=tiny))
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert pipe.transformer is comps["transformer"] and pipe.text_encoder_3 is comps["text_encoder_3"]
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and pipe.scheduler.config.shift == 3.0


def test_build_random_writes_a_loadable_single_file(fam, tmp_path):
    path = fam.build_random("sd3-tiny", tmp_path / "random.safetensors", seed=1)
    got = fam.load(ModelConfig(path=path, config="sd3-tiny"), ["transformer", "vae"], torch.float32, "cpu")
    assert count(got["transformer"]) == meta_count("sd3-tiny", "transformer")
    with safe_open(str(path), "pt") as h:
        assert (
            h.metadata()["modelspec.architecture"] == "stable-diffusion-v3.5-medium"
        )  # the tiny one has dual attention
        assert h.get_tensor("first_stage_model.encoder.conv_in.weight").dtype == torch.float16
