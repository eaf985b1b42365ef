"""difftrain lora merge (issue 11, merging): a LoRA baked into a single-file checkpoint gives the denoiser output of
the base model with the LoRA adapted through peft; both layouts give the same file; scale 0 gives the base back;
a LoRA that does not fit is refused, with what does not fit named, before anything is written."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftrain.config.load import resolve
from difftrain.config.schema import LoraConfig, ModelConfig
from difftrain.lora import files as lora_files
from difftrain.lora.adapters import adapter_metadata, add_lora, export_layers
from difftrain.lora.tools import merge

SDXL_UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "conv_shortcut"]  # Linear, 3x3 and 1x1 convs


def _adapted(family, model, recipe: str, denoiser_targets: list[str], out):
    """The base's denoiser and CLIPs with a random rank-4, alpha-2 LoRA (peft), and the LoRA written in both layouts."""
    parts = [family.denoiser, "text_encoder", "text_encoder_2"]
    comps = family.load(
        ModelConfig(path=model), [*parts, *(["text_encoder_3"] if family.name == "sd3" else [])], dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(0)
    for part in parts:
        targets = denoiser_targets if part == family.denoiser else family.text_encoder_lora_targets
        for p in add_lora(comps[part], LoraConfig(rank=4, alpha=2), targets):
            p.data = torch.randn(p.shape, generator=gen) * 0.2
        comps[part].eval()
    layers = {part: export_layers(comps[part]) for part in parts}
    meta = {part: adapter_metadata(comps[part]) for part in parts}
    family.save_lora(out, layers, meta)
    cfg = resolve(recipe=recipe, sets=[f"model.path={model}", f"train.output_dir={out}"]).config
    lora_files.write_kohya(out / lora_files.KOHYA_FILE, cfg, family, layers, meta)
    return comps, out / "pytorch_lora_weights.safetensors", out / lora_files.KOHYA_FILE


def _scaled(comps, parts, s: float):
    from peft.tuners.lora import LoraLayer

    for part in parts:
        for m in comps[part].modules():
            if isinstance(m, LoraLayer):
                m.scale_layer(s)


def _unet_out(fam, comps, ids):
    batch = fam.encode_tokens(comps, *ids)
    gen = torch.Generator().manual_seed(1)
    noisy = torch.randn(2, 4, 16, 16, generator=gen)
    batch["time_ids"] = torch.tensor([[64, 64, 0, 0, 64, 64]] * 2, dtype=torch.float32)
    return fam.denoise(comps["unet"], noisy, torch.tensor([10, 500]), batch)


def _mmdit_out(fam, comps, ids):
    batch = fam.encode_tokens(comps, *ids)
    noisy = torch.randn(2, comps["transformer"].config.in_channels, 16, 16, generator=torch.Generator().manual_seed(1))
    return fam.denoise(comps["transformer"], noisy, torch.tensor([100.0, 700.0]), batch)


@pytest.fixture(scope="module")
def sdxl(tiny_model, tmp_path_factory):
    from difftrain.families.sdxl import SDXL

    fam = SDXL()
    comps, diffusers_file, kohya_file = _adapted(
        fam, tiny_model, "tiny-sdxl-lora", SDXL_UNET_TARGETS, tmp_path_factory.mktemp("sdxl-lora")
    )
    return fam, comps, diffusers_file, kohya_file


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    from difftrain.families.sd3 import SD3

    fam = SD3()
    model = fam.build_tiny(tmp_path_factory.mktemp("sd3") / "tiny-sd3", seed=0)
    comps, diffusers_file, kohya_file = _adapted(
        fam, model, "tiny-sd3-lora", [*fam.default_lora_targets, "proj_out"], tmp_path_factory.mktemp("sd3-lora")
    )
    return fam, model, comps, diffusers_file, kohya_file


def test_sdxl_merged_checkpoint_gives_the_adapted_models_output(sdxl, tiny_model, tmp_path):
    fam, comps, diffusers_file, _ = sdxl
    parts = ["unet", "text_encoder", "text_encoder_2"]
    merge(tiny_model, diffusers_file, tmp_path / "merged.safetensors", scale=0.7)
    merged = fam.load(ModelConfig(path=tmp_path / "merged.safetensors", config="sdxl-tiny"), parts, tokenizers=False)
    base = fam.load(ModelConfig(path=tiny_model), parts, tokenizers=False)
    ids = fam.tokenize(comps, ["a photo of sks", "a red cube"])
    with torch.no_grad():
        _scaled(comps, parts, 0.7)
        try:
            want = _unet_out(fam, comps, ids)
        finally:
            _scaled(comps, parts, 1 / 0.7)
        got, plain = _unet_out(fam, merged, ids), _unet_out(fam, base, ids)
    assert (want - plain).abs().max() > 100 * (want - got).abs().max()  # the LoRA matters, and the merge reproduces it
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # every adapted text-encoder layer changed: the CLIPs' LoRA went in too
    for part in ("text_encoder", "text_encoder_2"):
        q = next(k for k in merged[part].state_dict() if k.endswith("layers.0.self_attn.q_proj.weight"))
        assert not torch.equal(merged[part].state_dict()[q], base[part].state_dict()[q])


def test_sdxl_both_layouts_give_the_same_merged_file(sdxl, tiny_model, tmp_path):
    _, _, diffusers_file, kohya_file = sdxl
    a = merge(tiny_model, diffusers_file, tmp_path / "a.safetensors").path
    b = merge(tiny_model, kohya_file, tmp_path / "b.safetensors").path
    sa, sb = load_file(a), load_file(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(k.startswith("conditioner.embedders.1.model.") for k in sa)  # the whole model, CLIP-G included


def test_scale_zero_gives_the_base_back_in_its_stored_dtype(sdxl, tiny_model, tmp_path):
    fam, _, _diffusers_file, kohya_file = sdxl
    parts = ["unet", "vae", "text_encoder", "text_encoder_2"]
    comps = fam.load(ModelConfig(path=tiny_model), parts, tokenizers=False)
    base = fam.save_single_file(
        {p: comps[p].state_dict() for p in parts},
        fam.module_configs(comps),
        tmp_path / "base16.safetensors",
        dtype=torch.float16,
    )
    same = merge(base, kohya_file, tmp_path / "zero.safetensors", scale=0.0, config="sdxl-tiny")
    sb, s0 = load_file(base), load_file(same.path)
    assert same.dtype == torch.float16 and sb.keys() == s0.keys()
    assert all(torch.equal(sb[k], s0[k]) for k in sb)
    one = load_file(merge(base, kohya_file, tmp_path / "one.safetensors", config="sdxl-tiny").path)
    changed = [k for k in sb if not torch.equal(sb[k], one[k])]
    assert {t.dtype for t in one.values()} == {torch.float16}
    # 3x3 convs, 1x1 shortcut convs, attention and both CLIPs all changed; the VAE did not
    assert any(".in_layers.2." in k for k in changed) and any(".skip_connection." in k for k in changed)
    assert any(k.startswith("conditioner.embedders.0.") for k in changed) and any(
        k.startswith("conditioner.embedders.1.") for k in changed
    )
    assert not any(k.startswith("first_stage_model.") for k in changed)
    assert (
        load_file(merge(base, kohya_file, tmp_path / "f32.safetensors", config="sdxl-tiny", precision="fp32").path)[
            changed[0]
        ].dtype
        == torch.float32
    )


@pytest.mark.parametrize("which", ["diffusers", "kohya"])
def test_sd3_merged_checkpoint_gives_the_adapted_models_output(sd3, tmp_path, which):
    fam, model, comps, diffusers_file, kohya_file = sd3
    parts = ["transformer", "text_encoder", "text_encoder_2"]
    out = merge(model, diffusers_file if which == "diffusers" else kohya_file, tmp_path / "merged.safetensors").path
    with safe_open(str(out), framework="pt") as f:
        assert any(k.startswith("text_encoders.t5xxl.") for k in f.keys())  # noqa: SIM118 (T5 is carried over)
    merged = fam.load(ModelConfig(path=out, config="sd3-tiny"), [*parts, "text_encoder_3"], tokenizers=False)
    base = fam.load(ModelConfig(path=model), [*parts, "text_encoder_3"], tokenizers=False)
    ids = fam.tokenize(comps, ["a photo of sks", "a red cube"], t5_max_length=16)
    with torch.no_grad():
        want, got, plain = (_mmdit_out(fam, c, ids) for c in (comps, merged, base))
    assert (want - plain).abs().max() > 100 * (want - got).abs().max()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_lora_that_does_not_fit_is_refused_before_anything_is_written(sdxl, sd3, tiny_model, tmp_path, cli):
    _, _, diffusers_file, kohya_file = sdxl
    out = tmp_path / "merged.safetensors"
    # a key naming no module of the model
    sd = load_file(kohya_file)
    sd["lora_unet_input_blocks_99_1_proj_in.lora_down.weight"] = torch.zeros(4, 8)
    save_file(sd, tmp_path / "stray.safetensors")
    r = cli("lora", "merge", tiny_model, tmp_path / "stray.safetensors", "-o", out)
    assert r.code == 1 and "lora_unet_input_blocks_99_1_proj_in.lora_down.weight" in r.err and "does not fit" in r.err
    # the same in the diffusers layout (checked against the model's modules, not by the file's own names)
    sd = load_file(diffusers_file)
    sd["unet.down_blocks.7.attentions.0.proj_in.lora_A.weight"] = torch.zeros(4, 8)
    save_file(sd, tmp_path / "stray2.safetensors")
    r = cli("lora", "merge", tiny_model, tmp_path / "stray2.safetensors", "-o", out)
    assert r.code == 1 and "unet.down_blocks.7.attentions.0.proj_in.lora_A.weight" in r.err
    # down and up of different ranks: not one LoRA
    sd = load_file(diffusers_file)
    k = next(k for k in sd if k.endswith("to_q.lora_B.weight") and k.startswith("unet."))
    sd[k] = sd[k][:, :3].contiguous()
    save_file(sd, tmp_path / "ranks.safetensors")
    r = cli("lora", "merge", tiny_model, tmp_path / "ranks.safetensors", "-o", out)
    assert r.code == 1 and "rank or kernel differ" in r.err and k.removesuffix(".lora_B.weight") in r.err
    # an SD3 LoRA on the SDXL base
    r = cli("lora", "merge", tiny_model, sd3[3], "-o", out)
    assert r.code == 1 and "made for SD3" in r.err
    # a pickle is not opened
    (tmp_path / "lora.ckpt").write_bytes(b"not opened")
    r = cli("lora", "merge", tiny_model, tmp_path / "lora.ckpt", "-o", out)
    assert r.code == 2 and "does not unpickle" in r.err
    assert "Traceback" not in r.err and not out.exists() and not list(tmp_path.glob(".merged*"))


def test_a_resized_lora_loads_through_diffusers_with_its_per_layer_ranks(sdxl, tiny_model, tmp_path):
    """diffusers' load_lora_weights reads the resized file's peft config (rank_pattern / alpha_pattern for the layers
    whose rank differs): the pipeline's adapted UNet gives the output of the resized LoRA merged into the base."""
    from diffusers import StableDiffusionXLPipeline

    from difftrain.lora.tools import resize

    fam, comps, diffusers_file, _ = sdxl
    r = resize(diffusers_file, tmp_path / "pytorch_lora_weights.safetensors", energy=0.8)
    assert len({x.new_rank for x in r.layers}) > 1 and r.overall < 1
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_model, local_files_only=True)
    pipe.load_lora_weights(str(tmp_path), weight_name=r.path.name)
    loaded = {"unet": pipe.unet, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    merged = fam.load(
        ModelConfig(path=merge(tiny_model, r.path, tmp_path / "m.safetensors").path, config="sdxl-tiny"),
        list(loaded),
        tokenizers=False,
    )
    ids = fam.tokenize(comps, ["a photo of sks", "a red cube"])
    with torch.no_grad():
        got, want, full = _unet_out(fam, loaded, ids), _unet_out(fam, merged, ids), _unet_out(fam, comps, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - full).abs().max() > 1e-3  # a lower rank: not the original LoRA's output


@pytest.mark.parametrize("which", ["diffusers", "kohya"])
def test_a_resized_lora_continues_training_through_init_weights(sdxl, tiny_model, tmp_path, which):
    """What lora.init_weights does (read_lora + load_into) accepts the resized file for lora.rank 2, lora.alpha 1."""
    from difftrain.lora.tools import resize

    fam, _, diffusers_file, kohya_file = sdxl
    src = resize(diffusers_file if which == "diffusers" else kohya_file, tmp_path / f"{which}.safetensors", rank=2).path
    mcfg = ModelConfig(path=tiny_model)
    parts = ["unet", "text_encoder", "text_encoder_2"]
    layers, alphas = lora_files.read_lora_file(src, mcfg, fam, parts)
    assert {a for part in alphas.values() for a in part.values()} == {1.0}  # 2 / 4 * 2: the scale 0.5 is kept
    comps = fam.load(mcfg, parts, tokenizers=False)
    for part in parts:
        targets = SDXL_UNET_TARGETS if part == "unet" else fam.text_encoder_lora_targets
        add_lora(comps[part], LoraConfig(rank=2, alpha=1), targets)
        lora_files.load_into(comps[part], part, layers[part], alphas[part], adapter_metadata(comps[part]), src)
        now = export_layers(comps[part])
        assert now.keys() == layers[part].keys() and all(torch.equal(now[k], layers[part][k].float()) for k in now)
