"""The Wan family on its tiny seeded model: loading (diffusers folder, the original single file, fp8-stored and
ComfyUI-prefixed too), what precompute encodes (against WanPipeline's own encoding), the flow objective against
its formulas, and the inputs it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from difftrain.config.schema import ModelConfig, TextEncodersConfig
from difftrain.errors import DataError, ModelLoadError
from difftrain.families.wan import Wan
from difftrain.families.wan import single_file as sf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Wan().build_tiny(tmp_path_factory.mktemp("wan") / "tiny-wan", seed=0)


def _mcfg(path, **kw) -> ModelConfig:
    return ModelConfig(path=path, **kw)


def _sd(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_the_original_single_file_loads_as_the_folder_does(tiny, tmp_path):
    """save_single_file writes the original names (blocks.N.self_attn.q, head.head ...); load reads them back,
    prefixed as ComfyUI's one-file checkpoints are or not, into the transformer the folder holds."""
    fam = Wan()
    ref = fam.load(_mcfg(tiny), ["transformer"])["transformer"]
    path = fam.save_single_file(
        {"transformer": _sd(ref)}, fam.module_configs({"transformer": ref}), tmp_path / "w.safetensors"
    )
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())  # safe_open has no __iter__
    assert "blocks.0.self_attn.q.weight" in keys and "head.head.weight" in keys and "blocks.0.norm3.weight" in keys
    assert not any(k.startswith(("attn1", "condition_embedder")) or ".attn1." in k for k in keys)
    got = fam.load(_mcfg(path, config="wan-tiny"), ["transformer"])["transformer"]
    want = _sd(ref)
    assert set(got.state_dict()) == set(want)
    assert all(torch.equal(got.state_dict()[k], want[k]) for k in want)
    # ComfyUI's prefix
    from safetensors.torch import load_file

    prefixed = tmp_path / "comfy.safetensors"
    save_file({sf.PREFIX + k: v for k, v in load_file(path).items()}, prefixed)
    got2 = fam.load(_mcfg(prefixed, config="wan-tiny"), ["transformer"])["transformer"]
    assert all(torch.equal(got2.state_dict()[k], want[k]) for k in want)


def test_an_fp8_scaled_file_loads_its_weights_times_their_scales(tiny, tmp_path):
    """ComfyUI's *_fp8_scaled files: float8 Linear weights with a scale_weight each (and a scaled_fp8 marker)."""
    from safetensors.torch import load_file

    fam = Wan()
    ref = fam.load(_mcfg(tiny), ["transformer"])["transformer"]
    plain = load_file(
        fam.save_single_file(
            {"transformer": _sd(ref)}, fam.module_configs({"transformer": ref}), tmp_path / "a.safetensors"
        )
    )
    scaled: dict[str, torch.Tensor] = {"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    want = {}
    for k, v in plain.items():
        if k.startswith("blocks.") and k.endswith(".weight") and v.ndim == 2:
            scale = v.abs().max().float() / 448
            q = (v.float() / scale).to(torch.float8_e4m3fn)
            scaled[k], scaled[k.removesuffix(".weight") + ".scale_weight"] = q, scale.reshape(1)
            want[sf.to_diffusers(k)] = q.float() * scale
        else:
            scaled[k] = v
    save_file(scaled, tmp_path / "fp8.safetensors")
    got = fam.load(_mcfg(tmp_path / "fp8.safetensors", config="wan-tiny"), ["transformer"])["transformer"].state_dict()
    assert want and all(torch.equal(got[k], w) for k, w in want.items())
    assert not torch.equal(got["blocks.0.attn1.to_q.weight"], ref.state_dict()["blocks.0.attn1.to_q.weight"])


def test_a_file_of_another_architecture_is_named(tiny, tmp_path):
    fam = Wan()
    ref = fam.load(_mcfg(tiny), ["transformer"])["transformer"]
    path = fam.save_single_file(
        {"transformer": _sd(ref)}, fam.module_configs({"transformer": ref}), tmp_path / "w.safetensors"
    )
    with pytest.raises(ModelLoadError, match=r"wan2\.1-t2v-1\.3b") as e:
        fam.load(_mcfg(path, config="wan2.1-t2v-1.3b"), ["transformer"])
    assert "model.config: wan-tiny" in e.value.hint
    with pytest.raises(ModelLoadError, match="holds the Wan transformer only"):
        fam.load(_mcfg(path, config="wan-tiny"), ["transformer", "vae"])


def test_image_to_video_folders_and_two_experts_without_model_expert_are_refused_by_name(tiny, tmp_path):
    fam = Wan()
    i2v = shutil.copytree(tiny, tmp_path / "i2v")
    cfg = json.loads((i2v / "transformer" / "config.json").read_text())
    (i2v / "transformer" / "config.json").write_text(json.dumps({**cfg, "in_channels": 36}))
    with pytest.raises(ModelLoadError, match="image-to-video"):
        fam.load(_mcfg(i2v), ["transformer"])
    a14b = shutil.copytree(tiny, tmp_path / "a14b")
    shutil.copytree(a14b / "transformer", a14b / "transformer_2")
    with pytest.raises(ModelLoadError, match="two-expert"):
        fam.load(_mcfg(a14b), ["transformer"])


def test_prompts_encode_as_the_pipeline_encodes_them(tiny):
    """512 UMT5 positions, zero past each caption's tokens: WanPipeline.encode_prompt's embeddings exactly."""
    from diffusers import WanPipeline

    fam = Wan()
    comps = fam.load(_mcfg(tiny), ["text_encoder"])
    caps = ["a red fox in snow", "x"]
    got = fam.encode_prompts(comps, caps, "t5", TextEncodersConfig())["prompt_embeds"]
    pipe = WanPipeline.from_pretrained(tiny)
    want, _ = pipe.encode_prompt(caps, do_classifier_free_guidance=False, max_sequence_length=512)
    assert got.shape == (2, 512, 32)
    torch.testing.assert_close(got, want.float())  # float32 rounding of another batch layout: 7e-7
    assert got[1, 3:].abs().sum() == 0 and got[1, :2].abs().sum() > 0  # "x" + </s>: two tokens, then zeros


def test_latents_are_normalised_per_channel_and_clips_need_4k_plus_1_frames(tiny):
    fam = Wan()
    comps = fam.load(_mcfg(tiny), ["vae"])
    vae = comps["vae"]
    video = torch.rand(1, 3, 5, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    got = fam.encode_images(comps, video)
    z = vae.encode(video).latent_dist.mean
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    assert got.shape == (1, 16, 2, 4, 6)
    torch.testing.assert_close(got, (z - mean) / std)
    assert fam.encode_images(comps, video[:, :, 0]).shape == (1, 16, 1, 4, 6)  # an image: a one-frame clip
    with pytest.raises(DataError, match="4k \\+ 1"):
        fam.encode_images(comps, video[:, :, :4])
    with pytest.raises(DataError, match="multiples of 16"):
        fam.encode_images(comps, video[:, :, :, :24])


def test_the_flow_objective_is_the_formula_with_the_models_shift(tiny):
    """x_s = (1 - s) x0 + s noise, s the quantile shifted by the scheduler's flow_shift (3.0), timestep 1000 s,
    loss |v - (noise - x0)|^2 per sample."""
    from difftrain.config.load import resolve
    from difftrain.trainers.objectives import Draws, Objective

    cfg = resolve(recipe="tiny-wan-lora", sets=[f"model.path={tiny}", "data.dir=."]).config
    fam = Wan()
    tr = fam.load(cfg.model, ["transformer"])["transformer"]
    obj = Objective(
        cfg, fam, fam.training_scheduler(cfg.model), Draws(torch.Generator(), torch.device("cpu")), torch.float32, None
    )
    assert obj.flow_shift == 3.0
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 16, 2, 4, 6, generator=g)
    text = torch.randn(2, 512, 32, generator=g)
    q = torch.tensor([0.25, 0.7])
    got = obj.loss(tr, {"latents": x0, "prompt_embeds": text}, fixed=(noise, q), per_sample=True)
    s = 3 * q / (1 + 2 * q)
    xs = (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * noise
    with torch.no_grad():
        v = tr(hidden_states=xs, timestep=1000 * s, encoder_hidden_states=text, return_dict=False)[0]
    want = ((v - (noise - x0)) ** 2).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(got.detach(), want)


def test_kohya_names_are_musubi_tuners(tiny):
    names = Wan().kohya_names(_mcfg(tiny), "transformer")
    assert names["blocks.1.attn1.to_q"] == "blocks.1.self_attn.q"
    assert names["blocks.0.attn2.to_out.0"] == "blocks.0.cross_attn.o"
    assert names["blocks.0.ffn.net.0.proj"] == "blocks.0.ffn.0"
    assert names["proj_out"] == "head.head"


# ------------------------------------------------------------------ Wan2.2 A14B: two experts
@pytest.fixture(scope="module")
def tiny_a14b(tmp_path_factory):
    return Wan().build_tiny(tmp_path_factory.mktemp("wan14") / "tiny-a14b", seed=0, config="wan-tiny-a14b")


def test_each_expert_loads_from_its_folder_and_trains_on_its_side_of_the_boundary(tiny_a14b):
    from safetensors.torch import load_file

    fam = Wan()
    for expert, folder, band in (
        ("high_noise", "transformer", (0.875, 1.0)),
        ("low_noise", "transformer_2", (0.0, 0.875)),
    ):
        mcfg = _mcfg(tiny_a14b, expert=expert)
        got = fam.load(mcfg, ["transformer"])["transformer"].state_dict()
        want = load_file(tiny_a14b / folder / "diffusion_pytorch_model.safetensors")
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert fam.timestep_range(mcfg) == band
        assert fam.fingerprint(mcfg, "transformer", {}) != fam.fingerprint(
            _mcfg(tiny_a14b, expert="low_noise" if expert == "high_noise" else "high_noise"), "transformer", {}
        )
    with pytest.raises(ModelLoadError, match="two-expert") as e:
        fam.load(_mcfg(tiny_a14b), ["transformer"])
    assert "model.expert: high_noise" in e.value.hint


def test_an_experts_validation_pipeline_says_it_runs_the_expert_alone(tiny_a14b, capsys):
    fam = Wan()
    mcfg = _mcfg(tiny_a14b, expert="high_noise")
    pipe = fam.pipeline(fam.load(mcfg, ["transformer", "vae", "text_encoder"]), mcfg)
    assert pipe.transformer_2 is None
    assert "the high_noise expert alone over every step" in " ".join(capsys.readouterr().err.split())


def test_model_expert_on_a_one_transformer_model_is_refused(tiny):
    with pytest.raises(ModelLoadError, match="one transformer"):
        Wan().load(_mcfg(tiny, expert="low_noise"), ["transformer"])


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform", "mode"])
def test_a_band_keeps_the_draws_inside_it_with_the_shape_of_the_distribution(sampling):
    """Draws inside [lo, hi] after the shift, distributed as the unbanded draws that fall there (the histogram of
    the banded draws against the unbanded draws conditioned on the band)."""
    from difftrain.config.schema import FlowConfig
    from difftrain.trainers.objectives import sample_sigmas

    flow = FlowConfig(timestep_sampling=sampling)
    g = torch.Generator().manual_seed(0)
    banded = sample_sigmas(flow, 20000, 3.0, g, "cpu", (0.0, 0.875))
    assert banded.max() <= 0.875 and banded.min() >= 0
    free = sample_sigmas(flow, 200000, 3.0, g, "cpu")
    inside = free[free <= 0.875]
    edges = torch.linspace(0, 0.875, 8)
    h1 = torch.histogram(banded, edges).hist / len(banded)
    h2 = torch.histogram(inside, edges).hist / len(inside)
    assert (h1 - h2).abs().max() < 0.015
    high = sample_sigmas(flow, 5000, 3.0, g, "cpu", (0.875, 1.0))
    assert high.min() >= 0.875 - 1e-6


def test_the_objective_draws_the_experts_levels_and_flow_min_timestep_overrides(tiny_a14b):
    from difftrain.config.load import resolve
    from difftrain.trainers.objectives import Draws, Objective

    fam = Wan()
    for expert, sets, ok in (
        ("low_noise", [], lambda s: s.max() < 0.875),
        ("high_noise", [], lambda s: s.min() >= 0.875 - 1e-6),
        ("low_noise", ["flow.min_timestep=500"], lambda s: s.min() >= 0.5 - 1e-6 and s.max() < 0.875),
    ):
        cfg = resolve(
            recipe="tiny-wan-lora", sets=[f"model.path={tiny_a14b}", "data.dir=.", f"model.expert={expert}", *sets]
        ).config
        obj = Objective(
            cfg,
            fam,
            fam.training_scheduler(cfg.model),
            Draws(torch.Generator(), torch.device("cpu")),
            torch.float32,
            None,
        )
        x0 = torch.zeros(256, 16, 1, 2, 2)
        _, t, _, _ = obj.flow_inputs(x0, torch.randn_like(x0))
        assert ok(t / 1000), (expert, sets)
        _, tq, _, _ = obj.flow_inputs(x0[:3], x0[:3], torch.tensor([0.0, 0.5, 1.0]))  # validation quantiles
        assert ok(tq / 1000 - torch.tensor([0.0, 0.0, 1e-6]))


@pytest.mark.slow
def test_ti2v_5b_trains_text_to_video_on_the_22_vae_and_its_lora_loads(_dataset_master, tmp_path):
    """Wan2.2 TI2V-5B's layout: 48-channel latents of the 16x VAE, frame sides in multiples of 32, shift 5."""
    from diffusers import WanPipeline

    from conftest import tiny_sets
    from difftrain.config.load import resolve
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import train

    model = Wan().build_tiny(tmp_path / "ti2v", config="wan-tiny-ti2v")
    comps = Wan().load(_mcfg(model), ["vae"])
    assert Wan().encode_images(comps, torch.zeros(1, 3, 5, 64, 96)).shape == (1, 48, 2, 4, 6)
    with pytest.raises(DataError, match="multiples of 32"):
        Wan().encode_images(comps, torch.zeros(1, 3, 5, 48, 96))
    assert Wan().training_scheduler(_mcfg(model)).config.shift == 5.0
    sets = tiny_sets(
        model, _dataset_master, tmp_path, **{"train.max_steps": 2, "data.bucket_step": 32, "data.resolution": 64}
    )
    cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
    precompute(cfg)
    r = train(cfg)
    assert len(r.losses) == 2 and all(torch.isfinite(torch.tensor(r.losses)))
    pipe = WanPipeline.from_pretrained(model)
    assert pipe.config.expand_timesteps
    pipe.load_lora_weights(str(r.lora_path))


# ------------------------------------------------------------------ the VAE's and UMT5's own files (ComfyUI's)
def _wan_vae_name(key: str) -> str:
    """A diffusers AutoencoderKLWan key in Wan's own names (wan_2.1_vae.safetensors), for writing test files: the
    converse of diffusers' convert_wan_vae_to_diffusers, which the test checks it is."""
    import re

    res = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
           "conv2": "residual.6", "conv_shortcut": "shortcut"}  # fmt: skip

    def resid(tail: str) -> str:
        for a, b in res.items():
            if tail == a or tail.startswith(a + "."):
                return b + tail[len(a) :]
        return tail

    if key.startswith("quant_conv."):
        return key.replace("quant_conv", "conv1")
    if key.startswith("post_quant_conv."):
        return key.replace("post_quant_conv", "conv2")
    for side in ("encoder", "decoder"):
        if key.startswith(f"{side}.conv_in."):
            return key.replace("conv_in", "conv1")
        if key == f"{side}.norm_out.gamma":
            return f"{side}.head.0.gamma"
        if key.startswith(f"{side}.conv_out."):
            return key.replace("conv_out", "head.2")
        if m := re.match(rf"{side}\.mid_block\.resnets\.(\d)\.(.+)", key):
            return f"{side}.middle.{2 * int(m[1])}.{resid(m[2])}"
        if m := re.match(rf"{side}\.mid_block\.attentions\.0\.(.+)", key):
            return f"{side}.middle.1.{m[1]}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.(.+)", key):
        return f"encoder.downsamples.{m[1]}.{resid(m[2])}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        return f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{resid(m[3])}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", key):
        return f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
    raise KeyError(key)


def test_comfyui_files_of_the_vae_and_umt5_load_as_the_folders_parts(tiny, tmp_path):
    """model.path the transformer file, model.ae Wan's own VAE file (its names through diffusers' converter),
    model.t5xxl UMT5 in transformers' names stored once (shared.weight) and in fp8_scaled, model.tokenizer_path: every
    part as the diffusers folder has it, and precompute's encodings the same."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import save_file

    fam = Wan()
    ref = fam.load(_mcfg(tiny), ["transformer", "vae", "text_encoder"])
    vae_sd = _sd(ref["vae"])
    wan_names = {_wan_vae_name(k): v for k, v in vae_sd.items()}
    back = convert_wan_vae_to_diffusers(dict(wan_names))
    assert set(back) == set(vae_sd) and all(torch.equal(back[k], vae_sd[k]) for k in vae_sd)  # diffusers' converse
    save_file(wan_names, tmp_path / "wan_2.1_vae.safetensors")
    te_sd = {k: v for k, v in _sd(ref["text_encoder"]).items() if k != "encoder.embed_tokens.weight"}
    save_file(te_sd, tmp_path / "umt5_xxl_fp16.safetensors")
    tr = fam.save_single_file(
        {"transformer": _sd(ref["transformer"])}, fam.module_configs(ref), tmp_path / "wan2.1_t2v.safetensors"
    )
    mcfg = _mcfg(tr, config="wan-tiny", ae=tmp_path / "wan_2.1_vae.safetensors",
                 t5xxl=tmp_path / "umt5_xxl_fp16.safetensors", tokenizer_path=tiny)  # fmt: skip
    got = fam.load(mcfg, ["vae", "text_encoder"])
    for part in ("vae", "text_encoder"):
        want = ref[part].state_dict()
        assert all(torch.equal(got[part].state_dict()[k], want[k]) for k in want), part
    video = torch.rand(1, 3, 5, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    torch.testing.assert_close(fam.encode_images(got, video), fam.encode_images(ref, video))
    opts = TextEncodersConfig()
    ref["tokenizer"] = fam.load(_mcfg(tiny), ["text_encoder"])["tokenizer"]
    torch.testing.assert_close(
        fam.encode_prompts(got, ["a fox"], "t5", opts)["prompt_embeds"],
        fam.encode_prompts(ref, ["a fox"], "t5", opts)["prompt_embeds"],
    )
    assert fam.fingerprint(mcfg, "vae", {}) != fam.fingerprint(_mcfg(tiny), "vae", {})  # the file is what is hashed
    # fp8_scaled UMT5: each Linear's fp8 weight times its scale
    scaled = {}
    for k, v in te_sd.items():
        if k.endswith(".weight") and v.ndim == 2 and ".block." in k:
            s = v.abs().max().float() / 448
            scaled[k], scaled[k[: -len("weight")] + "scale_weight"] = (
                (v.float() / s).to(torch.float8_e4m3fn),
                s.reshape(1),
            )
        else:
            scaled[k] = v
    save_file(scaled, tmp_path / "umt5_fp8_scaled.safetensors")
    te8 = fam.load(mcfg.model_copy(update={"t5xxl": tmp_path / "umt5_fp8_scaled.safetensors"}), ["text_encoder"])
    k = "encoder.block.0.layer.0.SelfAttention.q.weight"
    assert torch.equal(te8["text_encoder"].state_dict()[k], scaled[k].float() * scaled[k[:-6] + "scale_weight"])


def test_missing_part_files_are_named_with_the_option_that_gives_them(tiny, tmp_path):
    fam = Wan()
    ref = fam.load(_mcfg(tiny), ["transformer"])["transformer"]
    tr = fam.save_single_file(
        {"transformer": _sd(ref)}, fam.module_configs({"transformer": ref}), tmp_path / "t.safetensors"
    )
    with pytest.raises(ModelLoadError, match="no UMT5-XXL text encoder weights") as e:
        fam.load(_mcfg(tr, config="wan-tiny"), ["text_encoder"])
    assert "model.t5xxl=umt5_xxl_fp16.safetensors" in e.value.hint
    with pytest.raises(ModelLoadError, match=r"model\.t5xxl .*umt5\.safetensors does not exist"):
        fam.load(_mcfg(tr, config="wan-tiny", t5xxl=tmp_path / "umt5.safetensors"), ["text_encoder"])
    with pytest.raises(ModelLoadError, match="is not the UMT5-XXL text encoder"):
        fam.load(_mcfg(tr, config="wan-tiny", t5xxl=tr), ["text_encoder"])  # the transformer file given as UMT5


def test_a_full_export_is_a_folder_wan_pipeline_loads_and_random_folders_load(tiny, tmp_path):
    from diffusers import WanPipeline

    fam = Wan()
    comps = fam.load(_mcfg(tiny), ["transformer"])
    sd = {k: v + 1 for k, v in _sd(comps["transformer"]).items()}  # "trained"
    out = fam.save_diffusers({"transformer": sd}, fam.module_configs(comps), tmp_path / "export", _mcfg(tiny))
    pipe = WanPipeline.from_pretrained(out)  # the VAE, UMT5, tokenizer and scheduler copied from the source
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in sd.items())
    folder = fam.build_random("wan-tiny", tmp_path / "random", seed=1, parts=["transformer", "vae"])
    got = fam.load(_mcfg(folder), ["transformer", "vae"])
    assert set(got) == {"transformer", "vae"} and not (folder / "text_encoder").exists()


def test_the_wan22_vae_file_in_wans_names_loads_as_the_ti2v_folders_vae(tmp_path):
    """model.ae=wan2.2_vae.safetensors (Wan's own names, as ComfyUI has it) for TI2V-5B: the folder's VAE, tensor
    for tensor, and the same latents; the 2.1 VAE's file given to TI2V (and the 2.2 one to a 2.1 model) is refused
    by name."""
    from safetensors.torch import save_file

    from difftrain.families.wan import single_file as sf

    fam = Wan()
    model = fam.build_tiny(tmp_path / "ti2v", config="wan-tiny-ti2v")
    ref = fam.load(_mcfg(model), ["transformer", "vae"])
    vae_sd = _sd(ref["vae"])
    n_res = ref["vae"].config.num_res_blocks
    save_file({sf.vae22_to_original(k, n_res): v for k, v in vae_sd.items()}, tmp_path / "wan2.2_vae.safetensors")
    tr = fam.save_single_file(
        {"transformer": _sd(ref["transformer"])}, fam.module_configs(ref), tmp_path / "ti2v.safetensors"
    )
    got = fam.load(_mcfg(tr, config="wan-tiny-ti2v", ae=tmp_path / "wan2.2_vae.safetensors"), ["vae"])["vae"]
    assert all(torch.equal(got.state_dict()[k], v) for k, v in vae_sd.items())
    video = torch.rand(1, 3, 5, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    torch.testing.assert_close(fam.encode_images({"vae": got}, video), fam.encode_images(ref, video))
    tiny21 = fam.build_tiny(tmp_path / "t21", config="wan-tiny")
    v21 = _sd(fam.load(_mcfg(tiny21), ["vae"])["vae"])
    save_file({_wan_vae_name(k): v for k, v in v21.items()}, tmp_path / "wan_2.1_vae.safetensors")
    with pytest.raises(ModelLoadError, match=r"it is the Wan2\.1 VAE and this model uses the Wan2\.2 one"):
        fam.load(_mcfg(tr, config="wan-tiny-ti2v", ae=tmp_path / "wan_2.1_vae.safetensors"), ["vae"])
    with pytest.raises(ModelLoadError, match=r"it is the Wan2\.2 VAE and this model uses the Wan2\.1 one"):
        fam.load(_mcfg(tiny21, ae=tmp_path / "wan2.2_vae.safetensors"), ["vae"])
