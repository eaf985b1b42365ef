"""SDXL single-file <-> diffusers conversion (difftrain.families.sdxl.single_file).

Tiny components are built from the bundled `sdxl-tiny` configs with every
parameter (norms included) drawn from a seeded generator, so a swapped or
misplaced mapping shows up as unequal tensors. The converter is checked three
ways: exact round trip, diffusers' own single-file loaders reading our output
(an independent implementation of the same layout), and, for the real
`sdxl-base-1.0` architecture on the meta device, key sets and shapes.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import difftrain.families as families_pkg
from difftrain.errors import ModelLoadError
from difftrain.families.sdxl.single_file import (
    COMPONENTS,
    detect_sdxl_single_file,
    diffusers_to_original,
    original_to_diffusers,
)

CONFIGS = Path(families_pkg.__file__).parent / "configs"
TINY = CONFIGS / "sdxl-tiny"
BASE = CONFIGS / "sdxl-base-1.0"

UNET = "model.diffusion_model."
VAE = "first_stage_model."
TE1 = "conditioner.embedders.0.transformer."
TE2 = "conditioner.embedders.1.model."


def load_configs(folder: Path) -> dict[str, dict]:
    return {c: json.loads((folder / c / "config.json").read_text()) for c in COMPONENTS}


def build_models(configs: dict[str, dict]) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    return {
        "unet": UNet2DConditionModel.from_config(configs["unet"]),
        "vae": AutoencoderKL.from_config(configs["vae"]),
        "text_encoder": CLIPTextModel(CLIPTextConfig(**configs["text_encoder"])),
        "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder_2"])),
    }


def randomized_state_dict(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every floating tensor of the state dict replaced by seeded N(0, 1) draws."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("position_ids")}


def drop_position_ids(sd):
    return {k: v for k, v in sd.items() if not k.endswith("position_ids")}


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str):
    actual, expected = drop_position_ids(actual), drop_position_ids(expected)
    assert set(actual) == set(expected), (
        f"{what}: missing {sorted(set(expected) - set(actual))[:5]}, extra {sorted(set(actual) - set(expected))[:5]}"
    )
    bad = [k for k in expected if actual[k].dtype != expected[k].dtype or not torch.equal(actual[k], expected[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:5]}"


@pytest.fixture(scope="module")
def tiny_configs():
    return load_configs(TINY)


@pytest.fixture(scope="module")
def tiny_state_dicts(tiny_configs):
    models = build_models(tiny_configs)
    return {c: randomized_state_dict(m, seed=i) for i, (c, m) in enumerate(models.items())}


@pytest.fixture(scope="module")
def tiny_original(tiny_state_dicts, tiny_configs):
    return diffusers_to_original(tiny_state_dicts, tiny_configs)


@pytest.fixture
def no_network(monkeypatch):
    """Fail any attempt to open a network connection (the loaders must stay offline)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# --- 2. layout of the written file ----------------------------------------------------------


def test_original_layout(tiny_original, tiny_state_dicts):
    orig, sd = tiny_original, tiny_state_dicts
    assert all(k.startswith((UNET, VAE, TE1, TE2)) for k in orig)
    assert sum(k.startswith(UNET) for k in orig) == len(sd["unet"])
    assert sum(k.startswith(VAE) for k in orig) == len(sd["vae"])
    assert sum(k.startswith(TE1) for k in orig) == len(sd["text_encoder"])
    # Per layer, q/k/v (6 tensors) fuse into in_proj (2); plus logit_scale.
    n_layers = 3
    assert sum(k.startswith(TE2) for k in orig) == len(sd["text_encoder_2"]) - 4 * n_layers + 1
    assert not any(k.endswith("position_ids") for k in orig)

    u, v, t1, t2 = sd["unet"], sd["vae"], sd["text_encoder"], sd["text_encoder_2"]
    same = {
        # UNet: conv_in, embeddings, out, resnet renames, transformer pass-through.
        UNET + "input_blocks.0.0.weight": u["conv_in.weight"],
        UNET + "time_embed.0.weight": u["time_embedding.linear_1.weight"],
        UNET + "time_embed.2.bias": u["time_embedding.linear_2.bias"],
        UNET + "label_emb.0.0.weight": u["add_embedding.linear_1.weight"],
        UNET + "label_emb.0.2.weight": u["add_embedding.linear_2.weight"],
        UNET + "out.0.weight": u["conv_norm_out.weight"],
        UNET + "out.2.weight": u["conv_out.weight"],
        UNET + "input_blocks.1.0.in_layers.0.weight": u["down_blocks.0.resnets.0.norm1.weight"],
        UNET + "input_blocks.2.0.out_layers.0.bias": u["down_blocks.0.resnets.1.norm2.bias"],
        UNET + "input_blocks.2.0.emb_layers.1.weight": u["down_blocks.0.resnets.1.time_emb_proj.weight"],
        UNET + "input_blocks.3.0.op.weight": u["down_blocks.0.downsamplers.0.conv.weight"],
        UNET + "input_blocks.4.0.skip_connection.weight": u["down_blocks.1.resnets.0.conv_shortcut.weight"],
        UNET + "input_blocks.5.1.transformer_blocks.1.attn2.to_k.weight": u[
            "down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_k.weight"
        ],
        UNET + "middle_block.0.in_layers.2.weight": u["mid_block.resnets.0.conv1.weight"],
        UNET + "middle_block.1.proj_in.weight": u["mid_block.attentions.0.proj_in.weight"],
        UNET + "middle_block.2.out_layers.3.weight": u["mid_block.resnets.1.conv2.weight"],
        # up block 0 has attention: its upsampler is entry .2 of the last output block.
        UNET + "output_blocks.2.2.conv.weight": u["up_blocks.0.upsamplers.0.conv.weight"],
        UNET + "output_blocks.2.1.norm.weight": u["up_blocks.0.attentions.2.norm.weight"],
        UNET + "output_blocks.3.0.skip_connection.weight": u["up_blocks.1.resnets.0.conv_shortcut.weight"],
        UNET + "output_blocks.5.0.in_layers.0.bias": u["up_blocks.1.resnets.2.norm1.bias"],
        # VAE: decoder levels are numbered in reverse.
        VAE + "encoder.norm_out.weight": v["encoder.conv_norm_out.weight"],
        VAE + "encoder.down.0.downsample.conv.weight": v["encoder.down_blocks.0.downsamplers.0.conv.weight"],
        VAE + "encoder.down.1.block.0.nin_shortcut.weight": v["encoder.down_blocks.1.resnets.0.conv_shortcut.weight"],
        VAE + "encoder.mid.block_2.norm1.weight": v["encoder.mid_block.resnets.1.norm1.weight"],
        VAE + "encoder.mid.attn_1.norm.weight": v["encoder.mid_block.attentions.0.group_norm.weight"],
        VAE + "decoder.up.3.block.1.conv2.weight": v["decoder.up_blocks.0.resnets.1.conv2.weight"],
        VAE + "decoder.up.3.upsample.conv.weight": v["decoder.up_blocks.0.upsamplers.0.conv.weight"],
        VAE + "decoder.up.0.block.0.nin_shortcut.weight": v["decoder.up_blocks.3.resnets.0.conv_shortcut.weight"],
        VAE + "quant_conv.weight": v["quant_conv.weight"],
        VAE + "post_quant_conv.bias": v["post_quant_conv.bias"],
        # CLIP-L keeps transformers naming under text_model. (whatever the installed layout).
        TE1 + "text_model.encoder.layers.0.self_attn.q_proj.weight": t1[
            next(k for k in t1 if k.endswith("encoder.layers.0.self_attn.q_proj.weight"))
        ],
        TE1 + "text_model.final_layer_norm.weight": t1[next(k for k in t1 if k.endswith("final_layer_norm.weight"))],
        # OpenCLIP naming.
        TE2 + "token_embedding.weight": t2["text_model.embeddings.token_embedding.weight"],
        TE2 + "positional_embedding": t2["text_model.embeddings.position_embedding.weight"],
        TE2 + "ln_final.bias": t2["text_model.final_layer_norm.bias"],
        TE2 + "transformer.resblocks.1.ln_1.weight": t2["text_model.encoder.layers.1.layer_norm1.weight"],
        TE2 + "transformer.resblocks.1.ln_2.weight": t2["text_model.encoder.layers.1.layer_norm2.weight"],
        TE2 + "transformer.resblocks.2.attn.out_proj.weight": t2[
            "text_model.encoder.layers.2.self_attn.out_proj.weight"
        ],
        TE2 + "transformer.resblocks.0.mlp.c_fc.weight": t2["text_model.encoder.layers.0.mlp.fc1.weight"],
        TE2 + "transformer.resblocks.0.mlp.c_proj.bias": t2["text_model.encoder.layers.0.mlp.fc2.bias"],
    }
    for key, expected in same.items():
        assert key in orig, key
        assert torch.equal(orig[key], expected), key

    # VAE mid attention: Linear [C, C] stored as 1x1 conv [C, C, 1, 1].
    q = orig[VAE + "encoder.mid.attn_1.q.weight"]
    assert q.ndim == 4 and q.shape[2:] == (1, 1)
    assert torch.equal(q[:, :, 0, 0], v["encoder.mid_block.attentions.0.to_q.weight"])
    assert torch.equal(
        orig[VAE + "decoder.mid.attn_1.proj_out.weight"][:, :, 0, 0],
        v["decoder.mid_block.attentions.0.to_out.0.weight"],
    )

    # OpenCLIP: q, k, v fused along dim 0; projection transposed; logit_scale = ln(100).
    L = "text_model.encoder.layers.0.self_attn."
    in_w = orig[TE2 + "transformer.resblocks.0.attn.in_proj_weight"]
    assert torch.equal(in_w, torch.cat([t2[L + "q_proj.weight"], t2[L + "k_proj.weight"], t2[L + "v_proj.weight"]]))
    in_b = orig[TE2 + "transformer.resblocks.0.attn.in_proj_bias"]
    assert torch.equal(in_b, torch.cat([t2[L + "q_proj.bias"], t2[L + "k_proj.bias"], t2[L + "v_proj.bias"]]))
    assert torch.equal(orig[TE2 + "text_projection"], t2["text_projection.weight"].T)
    assert orig[TE2 + "logit_scale"].shape == ()
    assert orig[TE2 + "logit_scale"].item() == pytest.approx(4.6052, abs=1e-4)

    assert detect_sdxl_single_file(orig)


def test_detect_sdxl_single_file(tiny_original):
    assert detect_sdxl_single_file(iter(tiny_original))
    unet_only = [k for k in tiny_original if k.startswith(UNET)]
    assert detect_sdxl_single_file(unet_only)  # a UNet-only SDXL file: known by its label_emb
    assert not detect_sdxl_single_file([k for k in unet_only if ".label_emb." not in k])  # SD 1.x's UNet has none
    # SD 1.x style and the SDXL refiner (bigG as embedder 0) are not SDXL base files.
    assert not detect_sdxl_single_file([UNET + "out.2.weight", "cond_stage_model.transformer.text_model.x"])
    assert not detect_sdxl_single_file([UNET + "out.2.weight", "conditioner.embedders.0.model.text_projection"])


# --- 3. round trip ----------------------------------------------------------------------------


def test_round_trip_is_exact(tiny_original, tiny_state_dicts, tiny_configs):
    back = original_to_diffusers(tiny_original.__getitem__, list(tiny_original), tiny_configs)
    assert set(back) == set(COMPONENTS)
    for c in COMPONENTS:
        assert_same_tensors(back[c], tiny_state_dicts[c], c)


def test_round_trip_loads_into_models(tiny_original, tiny_configs):
    """The returned dicts load strictly into freshly built models (the installed transformers layout)."""
    back = original_to_diffusers(tiny_original.__getitem__, tiny_original.keys(), tiny_configs)
    for c, model in build_models(tiny_configs).items():
        missing, unexpected = model.load_state_dict(back[c], strict=False)
        assert not unexpected, (c, unexpected)
        assert [k for k in missing if not k.endswith("position_ids")] == [], (c, missing)


def test_subset_of_components(tiny_state_dicts, tiny_configs):
    part = {c: tiny_state_dicts[c] for c in ("unet", "vae")}
    orig = diffusers_to_original(part, {c: tiny_configs[c] for c in ("unet", "vae")})
    assert all(k.startswith((UNET, VAE)) for k in orig)
    back = original_to_diffusers(orig.__getitem__, orig, tiny_configs, components=("unet", "vae"))
    assert set(back) == {"unet", "vae"}
    assert_same_tensors(back["vae"], tiny_state_dicts["vae"], "vae")
    # Asking for a component the file lacks names its missing keys.
    with pytest.raises(ModelLoadError, match=r"no text_encoder_2 weights.*conditioner\.embedders\.1\.model"):
        original_to_diffusers(orig.__getitem__, orig, tiny_configs, components=("text_encoder_2",))


def test_ignores_position_ids_and_foreign_keys(tiny_original, tiny_configs, tiny_state_dicts):
    orig = dict(tiny_original)
    orig[TE1 + "text_model.embeddings.position_ids"] = torch.arange(77)[None].float()  # as A1111 merges save it
    orig["denoiser.sigmas"] = torch.ones(3)  # outside every component prefix
    del orig[TE2 + "logit_scale"]
    back = original_to_diffusers(orig.__getitem__, orig, tiny_configs)
    assert_same_tensors(back["text_encoder"], tiny_state_dicts["text_encoder"], "text_encoder")


def test_missing_and_unexpected_keys_raise(tiny_original, tiny_configs):
    orig = dict(tiny_original)
    gone = UNET + "output_blocks.2.2.conv.weight"
    del orig[gone]
    with pytest.raises(ModelLoadError, match=r"unet.*1 missing.*output_blocks\.2\.2\.conv\.weight"):
        original_to_diffusers(orig.__getitem__, orig, tiny_configs)

    orig = dict(tiny_original)
    orig[UNET + "input_blocks.9.0.in_layers.0.weight"] = torch.zeros(1)
    with pytest.raises(ModelLoadError, match=r"unexpected.*input_blocks\.9\.0"):
        original_to_diffusers(orig.__getitem__, orig, tiny_configs)

    # Names only are checked before any tensor is read.
    def never(key):
        raise AssertionError("tensor read before the key check")

    with pytest.raises(ModelLoadError):
        original_to_diffusers(never, [k for k in tiny_original if k != gone], tiny_configs)


def test_wrong_shape_raises(tiny_original, tiny_configs):
    orig = dict(tiny_original)
    key = UNET + "input_blocks.0.0.weight"
    orig[key] = torch.zeros(1, 2, 3, 3)
    with pytest.raises(ModelLoadError, match="wrong shape"):
        original_to_diffusers(orig.__getitem__, orig, tiny_configs)


def test_lazy_read_from_safetensors(tiny_original, tiny_configs, tiny_state_dicts, tmp_path):
    from safetensors import safe_open

    path = tmp_path / "sdxl.safetensors"
    save_file(tiny_original, str(path))
    with safe_open(str(path), framework="pt") as f:
        back = original_to_diffusers(f.get_tensor, f.keys(), tiny_configs)
    for c in COMPONENTS:
        assert_same_tensors(back[c], tiny_state_dicts[c], c)
    # The returned tensors can themselves be saved (no shared storage from the q/k/v split).
    save_file(back["text_encoder_2"], str(tmp_path / "te2.safetensors"))


# --- 4. diffusers' own single-file loaders read what we write ---------------------------------


def test_diffusers_from_single_file_reads_our_file(tiny_original, tiny_state_dicts, tmp_path, no_network):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    path = tmp_path / "sdxl-tiny.safetensors"
    save_file(tiny_original, str(path))
    # `config` is a local diffusers-layout folder; with local_files_only nothing is fetched.
    unet = UNet2DConditionModel.from_single_file(str(path), config=str(TINY), subfolder="unet", local_files_only=True)
    assert_same_tensors(unet.state_dict(), tiny_state_dicts["unet"], "unet via from_single_file")
    vae = AutoencoderKL.from_single_file(str(path), config=str(TINY), subfolder="vae", local_files_only=True)
    assert_same_tensors(vae.state_dict(), tiny_state_dicts["vae"], "vae via from_single_file")


def test_diffusers_clip_loader_reads_our_text_encoders(tiny_original, tiny_state_dicts, no_network):
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    # diffusers picks the conversion branch by probing keys *and* matching the hidden size:
    # with the whole file, "CLIP-L present and hidden size matches" wins before OpenCLIP is
    # tried. Real SDXL has 768 vs 1280 so that probe disambiguates; the tiny encoders are both
    # 32 wide, so we hand each loader only its own embedder's keys.
    te1_keys = {k: v for k, v in tiny_original.items() if k.startswith(TE1)}
    te2_keys = {k: v for k, v in tiny_original.items() if k.startswith(TE2)}
    te1 = create_diffusers_clip_model_from_ldm(
        CLIPTextModel, te1_keys, config=str(TINY), subfolder="text_encoder", local_files_only=True
    )
    assert_same_tensors(te1.state_dict(), tiny_state_dicts["text_encoder"], "text_encoder via diffusers")
    te2 = create_diffusers_clip_model_from_ldm(
        CLIPTextModelWithProjection, te2_keys, config=str(TINY), subfolder="text_encoder_2", local_files_only=True
    )
    assert_same_tensors(te2.state_dict(), tiny_state_dicts["text_encoder_2"], "text_encoder_2 via diffusers")


# --- 5. the real SDXL architecture, on the meta device -----------------------------------------


@pytest.fixture(scope="module")
def base_meta():
    configs = load_configs(BASE)
    with torch.device("meta"):
        models = build_models(configs)
    sds = {c: drop_position_ids(m.state_dict()) for c, m in models.items()}
    return configs, models, sds, diffusers_to_original(sds, configs)


def test_real_sdxl_key_set(base_meta):
    configs, _models, sds, orig = base_meta
    # Counts of sd_xl_base_1.0.safetensors (2515 keys; CLIP-L's position_ids is the 197th
    # embedders.0 key there, and it is neither written nor needed).
    counts = {p: sum(k.startswith(p) for k in orig) for p in (UNET, VAE, TE1, TE2)}
    assert counts == {UNET: 1680, VAE: 248, TE1: 196, TE2: 390}
    assert len(sds["unet"]) == 1680

    shapes = {
        UNET + "input_blocks.0.0.weight": (320, 4, 3, 3),
        UNET + "label_emb.0.0.weight": (1280, 2816),
        UNET + "input_blocks.8.1.transformer_blocks.9.attn2.to_k.weight": (1280, 2048),
        UNET + "input_blocks.6.0.op.weight": (640, 640, 3, 3),
        UNET + "middle_block.1.transformer_blocks.9.ff.net.2.weight": (1280, 5120),
        UNET + "output_blocks.2.2.conv.weight": (1280, 1280, 3, 3),
        UNET + "output_blocks.5.2.conv.weight": (640, 640, 3, 3),
        UNET + "output_blocks.6.0.skip_connection.weight": (320, 960, 1, 1),
        UNET + "output_blocks.8.0.skip_connection.weight": (320, 640, 1, 1),
        UNET + "out.2.weight": (4, 320, 3, 3),
        VAE + "encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
        VAE + "encoder.down.1.block.0.nin_shortcut.weight": (256, 128, 1, 1),
        VAE + "decoder.up.1.block.0.nin_shortcut.weight": (256, 512, 1, 1),
        VAE + "decoder.up.0.block.0.nin_shortcut.weight": (128, 256, 1, 1),
        VAE + "decoder.up.3.upsample.conv.weight": (512, 512, 3, 3),
        TE1 + "text_model.encoder.layers.11.mlp.fc2.weight": (768, 3072),
        TE2 + "transformer.resblocks.31.attn.in_proj_weight": (3840, 1280),
        TE2 + "text_projection": (1280, 1280),
        TE2 + "logit_scale": (),
    }
    for key, shape in shapes.items():
        assert key in orig, key
        assert tuple(orig[key].shape) == shape, key
    # Not in real SDXL: the deepest decoder level (512 -> 512) has no shortcut conv, there is no
    # upsampler after the last (attention-free) up level, and no downsampler after the deepest.
    for key in (
        VAE + "decoder.up.3.block.2.nin_shortcut.weight",
        VAE + "decoder.up.0.upsample.conv.weight",
        UNET + "output_blocks.8.1.conv.weight",
        UNET + "input_blocks.9.0.op.weight",
    ):
        assert key not in orig, key

    # Every written key maps back, onto exactly the model's keys and shapes.
    back = original_to_diffusers(orig.__getitem__, orig, configs)
    for c in COMPONENTS:
        assert list(back[c]) == list(sds[c]), c
        assert all(back[c][k].shape == sds[c][k].shape for k in sds[c]), c


def test_real_sdxl_matches_diffusers_conversion(base_meta):
    """diffusers' own converters turn our real-size key set into exactly the model's keys and shapes."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )

    configs, models, sds, orig = base_meta

    def same_shapes(converted, expected, what):
        assert set(converted) == set(expected), (
            what,
            sorted(set(expected) - set(converted))[:5],
            sorted(set(converted) - set(expected))[:5],
        )
        assert all(tuple(converted[k].shape) == tuple(expected[k].shape) for k in expected), what

    same_shapes(convert_ldm_unet_checkpoint(orig, configs["unet"]), sds["unet"], "unet")
    same_shapes(convert_ldm_vae_checkpoint(dict(orig), configs["vae"]), sds["vae"], "vae")
    te1 = {k: v for k, v in convert_ldm_clip_checkpoint(orig).items() if not k.endswith("position_ids")}
    flat = {k.removeprefix("text_model."): v for k, v in te1.items()}
    same_shapes(
        te1 if "text_model.final_layer_norm.weight" in sds["text_encoder"] else flat, sds["text_encoder"], "te1"
    )
    te2 = convert_open_clip_checkpoint(models["text_encoder_2"], orig, prefix=TE2)
    same_shapes(te2, sds["text_encoder_2"], "text_encoder_2")
