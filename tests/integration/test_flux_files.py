"""Flux.1's files (issue 27): the Black Forest Labs transformer file, ae / clip_l / t5xxl files and ComfyUI's one-file
checkpoint read and written; the sd-scripts / ComfyUI LoRA layout (fused q/k/v) checked against diffusers' own Flux
kohya conversion; lora merge / resize on Flux LoRAs; a full fine-tune saved as the BFL file."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.families.common import LazyTensors
from difftrain.families.flux import family as flux
from difftrain.families.flux import single_file as sf
from difftrain.families.registry import get_family
from difftrain.lora import kohya
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train
from difftrain.utils import stream_save_safetensors

FILES = {"transformer": "flux1.safetensors", "vae": "ae.safetensors", "text_encoder": "clip_l.safetensors",
         "text_encoder_2": "t5xxl.safetensors"}  # fmt: skip


def _real_width_transformer(doubles: int = 2, singles: int = 2):
    """FLUX.1 [dev]'s widths with few blocks, on the meta device, and its config."""
    cfg = flux._read_json(flux.bundled_config_dir("flux-dev") / "transformer" / "config.json")
    cfg = {**cfg, "num_layers": doubles, "num_single_layers": singles}
    with torch.device("meta"):
        return flux._new_module("transformer", cfg), cfg


def test_the_bfl_layout_is_diffusers_converter_inverted_tensor_for_tensor():
    """At FLUX.1's widths (3072, MLP 12288: what diffusers' converter assumes) with a small input width so the test
    is cheap: ours to BFL, then diffusers' convert_flux_transformer_checkpoint_to_diffusers and ours back, equal."""
    from diffusers.loaders import single_file_utils as sfu

    m, cfg = _real_width_transformer()
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn((v.shape[0], 3) if v.dim() > 1 else v.shape, generator=g) for k, v in m.state_dict().items()}
    bfl = {k: make() for k, make in sf.transformer_to_bfl(sd, cfg).items()}
    assert "double_blocks.1.img_attn.qkv.weight" in bfl and "single_blocks.1.linear1.weight" in bfl
    assert bfl["single_blocks.0.linear1.weight"].shape[0] == 3 * 3072 + 12288
    assert "guidance_in.in_layer.weight" in bfl and not any(k.startswith("transformer_blocks") for k in bfl)
    theirs = sfu.convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    ours = sf.transformer_to_diffusers(bfl, cfg)
    assert set(theirs) == set(ours) == set(sd)
    for k in sd:
        assert torch.equal(theirs[k], sd[k]) and torch.equal(ours[k], sd[k]), k
    # the final adaLN's halves are swapped between the layouts
    assert not torch.equal(bfl["final_layer.adaLN_modulation.1.weight"], sd["norm_out.linear.weight"])


def test_the_real_files_are_recognised_by_their_names():
    m, cfg = _real_width_transformer(19, 38)
    bfl = list(sf.transformer_to_bfl(m.state_dict(), cfg))
    assert sf.guess_architecture(bfl) == "flux-dev"
    assert sf.guess_architecture([k for k in bfl if not k.startswith("guidance_in")]) == "flux-schnell"
    assert sf.guess_architecture(["model.diffusion_model." + k for k in bfl]) == "flux-dev"
    fam = get_family("flux")
    assert fam.recognises_single_file(bfl) and not get_family("sd3").recognises_single_file(bfl)
    assert not fam.recognises_single_file(["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"])
    assert sf.parts_in_file(["encoder.down.0.block.0.conv1.weight"]) == {"vae"}
    assert sf.parts_in_file(["text_model.encoder.layers.0.mlp.fc1.weight"]) == {"text_encoder"}
    assert sf.parts_in_file(["encoder.block.0.layer.0.SelfAttention.q.weight", "shared.weight"]) == {"text_encoder_2"}
    with pytest.raises(Exception, match="scaled-fp8"):
        sf.refuse_scaled_fp8(["double_blocks.0.img_attn.qkv.scale_weight"], "flux1-dev-scaled.safetensors")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Flux as a diffusers folder and as the four files a ComfyUI user has (T5 stored in fp8)."""
    root = tmp_path_factory.mktemp("flux-files")
    fam = get_family("flux")
    folder = fam.build_tiny(root / "folder", seed=0)
    comps = fam.load(ModelConfig(path=folder), flux.PARTS, tokenizers=False)
    configs = fam.module_configs(comps)
    for part, name in FILES.items():
        tensors = LazyTensors(sf.to_single_file({part: comps[part].state_dict()}, configs))
        stream_save_safetensors(root / name, tensors, dtype=torch.float8_e4m3fn if part == "text_encoder_2" else None)
    # the tokenizers are in no file: a folder of them as a diffusers download has (the tiny CLIP's vocabulary is not
    # CLIP-L's, which difftrain derives offline when tokenizer/ is absent)
    (root / "tok").mkdir()
    for name in ("tokenizer", "tokenizer_2"):
        os.symlink(folder / name, root / "tok" / name)
    return root, folder


def _files_model(root: Path, **extra) -> ModelConfig:
    return ModelConfig(path=root / FILES["transformer"], config="flux-tiny", ae=root / FILES["vae"],
                       clip_l=root / FILES["text_encoder"], t5xxl=root / FILES["text_encoder_2"],
                       tokenizer_path=root / "tok", **extra)  # fmt: skip


def test_separate_files_and_a_comfyui_checkpoint_load_as_the_folder(tiny):
    root, folder = tiny
    fam = get_family("flux")
    ref = fam.load(ModelConfig(path=folder), flux.PARTS, tokenizers=False)
    got = fam.load(_files_model(root), flux.PARTS)
    for part in flux.PARTS:
        a, b = ref[part].state_dict(), got[part].state_dict()
        assert a.keys() == b.keys(), part
        for k in a:
            want = (
                a[k].to(torch.float8_e4m3fn).float() if part == "text_encoder_2" and a[k].is_floating_point() else a[k]
            )
            assert torch.equal(b[k], want), (part, k)  # T5 was stored in fp8: read back as fp8 rounds it
    assert got["tokenizer_2"] is not None and got["tokenizer"] is not None
    # ComfyUI's checkpoint: every part under its prefix in one file
    fam.save_single_file(
        {p: ref[p].state_dict() for p in flux.PARTS}, fam.module_configs(ref), root / "comfy.safetensors"
    )
    keys = list(load_file(root / "comfy.safetensors"))
    assert any(k.startswith("model.diffusion_model.double_blocks.0.") for k in keys)
    assert any(k.startswith("vae.encoder.") for k in keys) and any(k.startswith("text_encoders.t5xxl.") for k in keys)
    comfy = fam.load(ModelConfig(path=root / "comfy.safetensors", config="flux-tiny"), flux.PARTS, tokenizers=False)
    for part in flux.PARTS:
        a, b = ref[part].state_dict(), comfy[part].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), part
    # a part's fingerprint hashes its own tensors: the transformer file's does not change the VAE's
    memo: dict[str, str] = {}
    assert fam.fingerprint(_files_model(root), "vae", memo) != fam.fingerprint(_files_model(root), "transformer", memo)


def test_a_lone_transformer_file_says_which_option_gives_the_missing_part(tiny, tmp_path):
    """Through the console script: exit non-zero, the option to set, no traceback."""
    root, _ = tiny
    sets = tiny_sets(root / FILES["transformer"], tmp_path / "none", tmp_path, **{"model.config": "flux-tiny"})
    (tmp_path / "none").mkdir()
    from PIL import Image

    Image.new("RGB", (64, 64), "red").save(tmp_path / "none" / "a.png")
    args = ["precompute", "--recipe", "tiny-flux-lora", *[a for s in sets for a in ("--set", s)]]
    r = subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, timeout=300)
    text = " ".join(r.stderr.split())
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "holds no VAE (ae) weights" in text and "model.ae" in text, text[-2000:]


def test_training_from_the_files_matches_the_folder(tiny, _dataset_master, tmp_path):
    """The same model from four files (T5 in fp8 aside: T5 disabled) trains to the same LoRA as from the folder."""
    root, folder = tiny
    extra = {
        "train.max_steps": 2,
        "train.checkpoint_every": 100,
        "report.to": "[]",
        "text_encoders.t5.enabled": "false",
    }
    a = resolve(recipe="tiny-flux-lora", sets=tiny_sets(folder, _dataset_master, tmp_path / "a", **extra)).config
    m = _files_model(root)
    files = {
        "model.ae": m.ae,
        "model.clip_l": m.clip_l,
        "model.t5xxl": m.t5xxl,
        "model.tokenizer_path": m.tokenizer_path,
    }
    b = resolve(
        recipe="tiny-flux-lora", sets=tiny_sets(m.path, _dataset_master, tmp_path / "b", **extra, **files)
    ).config
    for c in (a, b):
        precompute(c)
    ra, rb = train(a), train(b)
    assert ra.losses == rb.losses and all(math.isfinite(x) for x in ra.losses)
    la, lb = load_file(ra.lora_path), load_file(rb.lora_path)
    assert all(torch.equal(la[k], lb[k]) for k in la)


# ------------------------------------------------------------------ LoRA in the sd-scripts / ComfyUI layout
def _fake_layers(cfg, rank: int, targets: set[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """peft-named LoRA weights of the real widths' out dimension (input width 5: cheap), on ``targets``."""
    with torch.device("meta"):
        m = flux._new_module("transformer", cfg)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            out[f"{name}.lora_A.weight"] = torch.randn(rank, 5, generator=g)
            out[f"{name}.lora_B.weight"] = torch.randn(mod.out_features, rank, generator=g)
    return out


def test_the_kohya_layout_converts_back_through_diffusers_own_flux_converter(tmp_path):
    """Our block-diagonal fused q/k/v (and single blocks' q/k/v/MLP) file, read by FluxPipeline.lora_state_dict
    (diffusers' kohya Flux conversion), gives each module the same ΔW as our diffusers-layout layers; and
    from_kohya reads it back exactly. proj_mlp left out: its block is zeros in linear1 and comes back absent."""
    from diffusers import FluxPipeline

    _, cfg = _real_width_transformer()
    fam = get_family("flux")
    targets = {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.2", "proj_out", "norm1.linear"}  # fmt: skip
    layers = _fake_layers(cfg, 4, targets)
    layers = {k: v for k, v in layers.items() if not k.startswith("proj_out.")}
    alpha = {k[: -len(".lora_A.weight")]: 2.0 for k in layers if k.endswith("lora_A.weight")}
    alpha["transformer_blocks.0.attn.to_k"] = 8.0  # a member with its own alpha keeps its scale
    mcfg = ModelConfig(config="flux-dev")
    names = {"transformer": fam.kohya_names(mcfg, "transformer")}
    fused = {"transformer": fam.kohya_fused(mcfg, "transformer")}
    sd = kohya.to_kohya({"transformer": layers}, names, {"transformer": alpha}, fused, fam.kohya_prefixes)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in sd
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape == (12, 5)
    assert sd["lora_unet_single_blocks_1_linear1.lora_up.weight"].shape == (3 * 3072 + 12288, 16)
    assert "lora_unet_double_blocks_1_img_mod_lin.lora_down.weight" in sd
    save_file(sd, tmp_path / "k.safetensors")
    converted = FluxPipeline.lora_state_dict(str(tmp_path / "k.safetensors"))
    converted = converted[0] if isinstance(converted, tuple) else converted

    def delta(a, b, al):
        return b @ a * (al / a.shape[0])

    modules = sorted(alpha)
    for mod in modules:
        a, b = converted[f"transformer.{mod}.lora_A.weight"], converted[f"transformer.{mod}.lora_B.weight"]
        want = delta(layers[mod + ".lora_A.weight"], layers[mod + ".lora_B.weight"], alpha[mod])
        torch.testing.assert_close(b @ a, want, rtol=1e-5, atol=1e-5)  # diffusers folds the scale into the weights
    back_layers, back_alpha = kohya.from_kohya(sd, names, fused, fam.kohya_prefixes)
    assert set(back_alpha["transformer"]) == set(modules)  # the zero proj_mlp blocks are not read as adapters
    for mod in modules:
        got = delta(back_layers["transformer"][mod + ".lora_A.weight"], back_layers["transformer"][mod + ".lora_B.weight"],
                    back_alpha["transformer"][mod])  # fmt: skip
        want = delta(layers[mod + ".lora_A.weight"], layers[mod + ".lora_B.weight"], alpha[mod])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_fused_lora_trained_by_sd_scripts_reads_as_diffusers_reads_it():
    """sd-scripts trains the fused qkv as one Linear (down [r, in] shared): every member gets the whole down."""
    fam = get_family("flux")
    mcfg = ModelConfig(config="flux-tiny")
    names = {"transformer": fam.kohya_names(mcfg, "transformer")}
    fused = {"transformer": fam.kohya_fused(mcfg, "transformer")}
    width = dict(fused["transformer"]["double_blocks.0.img_attn.qkv"][0])["transformer_blocks.0.attn.to_q"]
    g = torch.Generator().manual_seed(1)
    down, up = torch.randn(4, width, generator=g), torch.randn(3 * width, 4, generator=g)
    sd = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down,
          "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
          "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(2.0)}  # fmt: skip
    layers, alphas = kohya.from_kohya(sd, names, fused, fam.kohya_prefixes)
    for i, mod in enumerate(("to_q", "to_k", "to_v")):
        m = f"transformer_blocks.0.attn.{mod}"
        got = layers["transformer"][m + ".lora_B.weight"] @ layers["transformer"][m + ".lora_A.weight"]
        torch.testing.assert_close(got * alphas["transformer"][m] / 4, (up @ down)[i * width : (i + 1) * width] * 0.5)


@pytest.fixture(scope="module")
def trained(tiny, _dataset_master, tmp_path_factory):
    """A tiny Flux LoRA (transformer and CLIP-L) trained from the folder; both layouts written by default."""
    _, folder = tiny
    out = tmp_path_factory.mktemp("flux-lora")
    sets = tiny_sets(folder, _dataset_master, out, **{"train.max_steps": 2, "train.checkpoint_every": 100,
                     "report.to": "[]", "train.train_text_encoders": "true"})  # fmt: skip
    cfg = resolve(recipe="tiny-flux-lora", sets=sets).config
    precompute(cfg)
    return cfg, train(cfg)


def test_a_trained_lora_is_written_in_both_layouts_that_load_alike(trained, tmp_path):
    """lora_kohya.safetensors beside the diffusers file: read back (init_weights' reader) they hold the same ΔW."""
    from difftrain.lora.files import KOHYA_FILE, read_lora_file

    cfg, result = trained
    kfile = result.lora_path.parent / KOHYA_FILE
    assert kfile.is_file()
    keys = load_file(kfile)
    assert any(k.startswith("lora_unet_single_blocks_0_linear1") for k in keys)
    assert any(k.startswith("lora_te1_text_model_encoder_layers_0_self_attn_q_proj") for k in keys)
    fam = get_family("flux")
    parts = ["transformer", "text_encoder"]
    dl, da = read_lora_file(result.lora_path, cfg.model, fam, parts)
    kl, ka = read_lora_file(kfile, cfg.model, fam, parts)
    for part in parts:
        assert set(da[part]) == set(ka[part]), part
        for mod in da[part]:
            d = dl[part][mod + ".lora_B.weight"] @ dl[part][mod + ".lora_A.weight"] * (da[part][mod] / 8)
            r = kl[part][mod + ".lora_A.weight"].shape[0]
            k = kl[part][mod + ".lora_B.weight"] @ kl[part][mod + ".lora_A.weight"] * (ka[part][mod] / r)
            torch.testing.assert_close(k, d, rtol=1e-5, atol=1e-7)


def test_lora_merge_and_resize_take_flux_loras(trained, tiny, tmp_path):
    """Merged into the folder (a ComfyUI checkpoint comes out), either layout gives the same W + ΔW; into the lone
    BFL transformer file a LoRA with CLIP-L layers is refused by name; resize keeps the kohya layout."""
    from difftrain.errors import CheckpointError
    from difftrain.lora.files import KOHYA_FILE
    from difftrain.lora.tools import merge, resize

    _cfg, result = trained
    root, folder = tiny
    fam = get_family("flux")
    base = fam.load(ModelConfig(path=folder), ["transformer"], tokenizers=False)["transformer"]
    merged = {}
    for name, lora in (("d", result.lora_path), ("k", result.lora_path.parent / KOHYA_FILE)):
        res = merge(folder, lora, tmp_path / f"{name}.safetensors")
        assert res.family == "flux" and res.layers["transformer"] > 0 and res.layers["text_encoder"] > 0
        merged[name] = load_file(tmp_path / f"{name}.safetensors")
    assert merged["d"].keys() == merged["k"].keys()
    for k in merged["d"]:
        torch.testing.assert_close(merged["d"][k], merged["k"][k], rtol=1e-5, atol=1e-6)
    prefix = sf.PREFIXES["transformer"]
    changed = [k for k, v in sf.transformer_to_bfl(base.state_dict(), base.config, prefix).items()
               if not torch.equal(v(), merged["d"][k])]  # fmt: skip
    assert prefix + "double_blocks.0.img_attn.qkv.weight" in changed and prefix + "img_in.weight" not in changed
    with pytest.raises(CheckpointError, match="adapts text_encoder"):
        merge(root / FILES["transformer"], result.lora_path, tmp_path / "x.safetensors", config="flux-tiny")
    r = resize(result.lora_path.parent / KOHYA_FILE, tmp_path / "r.safetensors", rank=2)
    assert r.layout == "kohya" and all(x.new_rank <= 2 for x in r.layers)
    assert (
        load_file(tmp_path / "r.safetensors")["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 2
    )


def test_a_full_fine_tune_saves_the_bfl_transformer_file(tiny, _dataset_master, tmp_path):
    """save.formats single_file: model.safetensors is the transformer alone in BFL names, loadable as model.path,
    holding the trained weights."""
    _root, folder = tiny
    sets = tiny_sets(folder, _dataset_master, tmp_path, **{"train.max_steps": 1, "train.checkpoint_every": 100,
                     "report.to": "[]", "train.method": "full", "save.formats": "[single_file]",
                     "train.learning_rate": "1e-3"})  # fmt: skip
    cfg = resolve(recipe="tiny-flux-lora", sets=sets).config
    precompute(cfg)
    train(cfg)
    out = cfg.train.output_dir / "model.safetensors"
    keys = list(load_file(out))
    assert sf.detect_prefix(keys) == "" and not any(k.startswith(("vae.", "text_encoders.")) for k in keys)
    fam = get_family("flux")
    tuned = fam.load(ModelConfig(path=out, config="flux-tiny"), ["transformer"], tokenizers=False)["transformer"]
    base = fam.load(ModelConfig(path=folder), ["transformer"], tokenizers=False)["transformer"]
    assert not torch.equal(tuned.state_dict()["transformer_blocks.0.attn.to_q.weight"],
                           base.state_dict()["transformer_blocks.0.attn.to_q.weight"])  # fmt: skip
