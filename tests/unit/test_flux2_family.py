"""FLUX.2 on tiny seeded models of the real layouts (klein-like with Qwen3, [dev]-like with Mistral 3 and guidance):
the bundled real architectures' sizes, the latents, the text and the transformer's inputs exactly as Flux2Pipeline /
Flux2KleinPipeline build them, BFL's file layout both ways (against diffusers' own converter), loading the files
ComfyUI users have, FLUX.1 and FLUX.2 told apart, and a distilled klein warned about."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import ModelLoadError
from difftrain.families.common import read_json
from difftrain.families.flux2 import Flux2
from difftrain.families.flux2 import single_file as sf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Flux2().build_tiny(tmp_path_factory.mktemp("flux2") / "m", seed=0)


@pytest.fixture(scope="module")
def tiny_dev(tmp_path_factory):
    return Flux2().build_tiny(tmp_path_factory.mktemp("flux2dev") / "m", seed=1, config="flux2-tiny-dev")


def _opts(tiny):
    return resolve(recipe="tiny-flux2-lora", sets=[f"model.path={tiny}", "data.dir=."]).config.text_encoders


def test_the_bundled_architectures_have_the_released_models_sizes():
    """klein 4B (3.88B transformer, Qwen3-4B), klein 9B (9.08B, Qwen3-8B without its head), [dev] (32.2B,
    Mistral-Small-3's 24.0B with its vision tower and head) and the 32-channel VAE, built on the meta device."""
    fam = Flux2()
    counts, precomputed = {}, {}
    for arch in ("flux2-klein-4b", "flux2-klein-9b", "flux2-dev"):
        mcfg = ModelConfig(config=arch)
        with torch.device("meta"):
            counts[arch] = {
                p: sum(
                    x.numel() for x in fam.new_module(p, read_json(fam.bundled(arch) / p / "config.json")).parameters()
                )
                for p in ("transformer", "text_encoder", "vae")
            }
            # what precompute loads (and the planner counts): the text encoder up to the layers the pipeline taps
            precomputed[arch] = sum(x.numel() for x in fam.empty_part(mcfg, "text_encoder").parameters())
    assert counts == {
        "flux2-klein-4b": {"transformer": 3_875_544_576, "text_encoder": 4_022_468_096, "vae": 84_046_115},
        "flux2-klein-9b": {"transformer": 9_078_581_248, "text_encoder": 7_568_405_504, "vae": 84_046_115},
        "flux2-dev": {"transformer": 32_223_281_152, "text_encoder": 24_011_361_280, "vae": 84_046_115},
    }
    # 28 of Qwen3's 36 layers, 31 of Mistral 3's 40: one layer's parameters times the layers left out
    assert precomputed == {
        "flux2-klein-4b": 4_022_468_096 - 8 * 100_930_816,
        "flux2-klein-9b": 7_568_405_504 - 8 * 192_946_432,
        "flux2-dev": 24_011_361_280 - 9 * 555_755_520,
    }
    assert [fam.is_dev(ModelConfig(config=a)) for a in ("flux2-klein-4b", "flux2-dev")] == [False, True]


def test_latents_are_the_pipelines_normalised_patches(tiny):
    """The cached 32-channel latent, cut into 2x2 patches, is what the pipeline's _encode_vae_image gives (the
    posterior mean normalised by the VAE's batch-norm statistics, which the tiny model has drawn)."""
    from diffusers import Flux2KleinPipeline

    fam = Flux2()
    vae = fam.load(ModelConfig(path=tiny), ["vae"])["vae"]
    assert not torch.allclose(vae.bn.running_var, torch.ones_like(vae.bn.running_var))
    pixels = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    got = fam.encode_images({"vae": vae}, pixels)
    assert got.shape == (2, 4, 8, 12)
    pipe = Flux2KleinPipeline.from_pretrained(tiny)
    with torch.no_grad():
        want = pipe._encode_vae_image(pixels, generator=None)
    torch.testing.assert_close(pipe._patchify_latents(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_captions_are_encoded_as_the_pipeline_encodes_them(tiny, tiny_dev, variant):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    path = tiny if variant == "klein" else tiny_dev
    fam = Flux2()
    comps = fam.load(ModelConfig(path=path), ["text_encoder"])
    captions = ["a fox in the snow", "a much longer caption: a cat on a red sofa, evening light"]
    got = fam.encode_prompts(comps, captions, "llm", _opts(path))["prompt_embeds"]
    pipe = (Flux2KleinPipeline if variant == "klein" else Flux2Pipeline).from_pretrained(path)
    with torch.no_grad():
        want, _ = pipe.encode_prompt(captions, device=torch.device("cpu"))
    assert got.shape == (2, 512, 96) == want.shape  # every caption 512 rows, three layers of 32 stacked
    torch.testing.assert_close(got, want.float())
    assert not torch.allclose(got[0], got[1])
    assert fam.text_stage_tag("llm", _opts(path)).startswith("llm:fp32:512")


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_precompute_runs_the_text_encoder_only_to_the_deepest_layer_the_pipeline_takes(
    tiny, tiny_dev, variant, tmp_path
):
    """A text encoder with layers past the pipeline's deepest tap (4 more here) is loaded without them, and its
    captions are bit for bit what the pipeline makes of them with the whole model."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    src = tiny if variant == "klein" else tiny_dev
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    cfg = read_json(folder / "text_encoder" / "config.json")
    text = cfg["text_config"] if variant == "dev" else cfg
    deepest = text["num_hidden_layers"]  # the tiny models have just the layers the taps need
    text["num_hidden_layers"] = deepest + 4
    text.pop("layer_types", None)
    torch.manual_seed(3)
    hf = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "transformers_version")}
    whole = (Mistral3ForConditionalGeneration(Mistral3Config(**hf)) if variant == "dev"
             else Qwen3ForCausalLM(Qwen3Config(**hf)))  # fmt: skip
    shutil.rmtree(folder / "text_encoder")
    whole.save_pretrained(folder / "text_encoder", safe_serialization=True)
    fam = Flux2()
    comps = fam.load(ModelConfig(path=folder), ["text_encoder"])
    te = comps["text_encoder"]
    loaded = te.config.text_config if variant == "dev" else te.config
    assert loaded.num_hidden_layers == deepest
    assert not any(f"layers.{deepest}." in n for n, _ in te.named_parameters())
    captions = ["a fox in the snow", "a much longer caption: a cat on a red sofa, evening light"]
    got = fam.encode_prompts(comps, captions, "llm", _opts(folder))["prompt_embeds"]
    pipe = (Flux2KleinPipeline if variant == "klein" else Flux2Pipeline).from_pretrained(folder)
    assert pipe.text_encoder.config.get_text_config().num_hidden_layers == deepest + 4  # the pipeline's own: whole
    with torch.no_grad():
        want, _ = pipe.encode_prompt(captions, device=torch.device("cpu"))
    assert torch.equal(got, want.float())


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_the_transformer_gets_the_pipelines_inputs(tiny, tiny_dev, variant):
    """``denoise`` on [B, 4, h, w] latents is the pipeline's call on its packed patches with its position ids (and
    [dev]'s guidance), unpacked by the pipeline's own scatter and unpatched."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    path = tiny if variant == "klein" else tiny_dev
    fam = Flux2()
    fam.guidance_scale = 2.5
    tr = fam.load(ModelConfig(path=path), ["transformer"])["transformer"]
    assert tr.config.guidance_embeds == (variant == "dev")
    pipe_cls = Flux2KleinPipeline if variant == "klein" else Flux2Pipeline
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 12, generator=g)
    text = torch.randn(2, 11, 96, generator=g)
    t = torch.tensor([250.0, 900.0])
    with torch.no_grad():
        got = fam.denoise(tr, noisy, t, {"prompt_embeds": text})
        x = pipe_cls._patchify_latents(noisy)
        ids = pipe_cls._prepare_latent_ids(x)
        out = tr(
            hidden_states=pipe_cls._pack_latents(x),
            timestep=t / 1000,
            guidance=torch.full([2], 2.5) if variant == "dev" else None,
            encoder_hidden_states=text,
            txt_ids=pipe_cls._prepare_text_ids(text),
            img_ids=ids,
            return_dict=False,
        )[0]
        want = pipe_cls._unpatchify_latents(Flux2KleinPipeline._unpack_latents_with_ids(out, ids, 4, 6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bfl_s_layout_is_diffusers_converters_both_ways(tiny_dev):
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    from difftrain.families.common import LazyTensors

    tr = Flux2().load(ModelConfig(path=tiny_dev), ["transformer"])["transformer"]
    sd = tr.state_dict()
    original = dict(LazyTensors(sf.to_single_file(sd)).items())
    assert "double_blocks.0.img_attn.qkv.weight" in original and "single_blocks.1.linear2.weight" in original
    assert "double_blocks.1.txt_attn.norm.key_norm.scale" in original and "guidance_in.in_layer.weight" in original
    assert not torch.equal(original["final_layer.adaLN_modulation.1.weight"], sd["norm_out.linear.weight"])
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(original))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    ours = dict(sf.transformer_tensors(list(original), original.__getitem__))
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)
    assert sf.module_to_original("transformer_blocks.0.attn.to_out.0") == "double_blocks.0.img_attn.proj"
    assert sf.module_to_original("single_transformer_blocks.1.attn.to_out") == "single_blocks.1.linear2"
    assert sf.module_to_original("transformer_blocks.0.attn.add_k_proj") is None  # a member of txt_attn.qkv
    kohya_names = Flux2().kohya_names(ModelConfig(path=tiny_dev), "transformer")
    assert kohya_names["transformer_blocks.1.ff_context.linear_out"] == "double_blocks.1.txt_mlp.2"
    fused = Flux2().kohya_fused(ModelConfig(path=tiny_dev), "transformer")
    assert fused["double_blocks.0.txt_attn.qkv"] == (
        tuple((f"transformer_blocks.0.attn.add_{x}_proj", 32) for x in "qkv"),
        False,
    )


def test_comfyui_files_load_the_transformer_vae_and_qwen3(tiny, tmp_path):
    """The transformer in BFL's names under ComfyUI's prefix, the VAE in BFL's names (flux2-vae.safetensors: the
    LDM names, its quant convs inside the encoder and decoder, the batch norm) and in diffusers', Qwen3 as
    transformers names it with the head (qwen_3_4b.safetensors); the architecture told by the file's blocks."""
    from safetensors.torch import save_file

    from difftrain.families.common import LazyTensors
    from difftrain.families.ldm_vae import VAE_PREFIX, vae_to_original

    fam = Flux2()
    ref = fam.load(ModelConfig(path=tiny), ["transformer", "vae", "text_encoder"], tokenizers=False)
    original = dict(LazyTensors(sf.to_single_file(ref["transformer"].state_dict())).items())
    save_file({f"{sf.PREFIX}{k}": v.contiguous() for k, v in original.items()}, tmp_path / "flux2.safetensors")
    vae_sd = ref["vae"].state_dict()
    ldm = vae_to_original({k: v for k, v in vae_sd.items() if not k.startswith("bn.")}, dict(ref["vae"].config))
    ldm = {k.removeprefix(VAE_PREFIX): v for k, v in ldm.items()}
    moved = {"quant_conv.": "encoder.quant_conv.", "post_quant_conv.": "decoder.post_quant_conv."}
    bfl = {next((b + k[len(a) :] for a, b in moved.items() if k.startswith(a)), k): v for k, v in ldm.items()}
    bfl.update({k: v for k, v in vae_sd.items() if k.startswith("bn.")})
    assert "encoder.quant_conv.weight" in bfl and "encoder.down.0.block.0.conv1.weight" in bfl
    save_file({k: v.contiguous() for k, v in bfl.items()}, tmp_path / "flux2-vae.safetensors")
    save_file({k: v.contiguous() for k, v in vae_sd.items()}, tmp_path / "vae.safetensors")
    qwen = {f"model.{k}": v.contiguous() for k, v in ref["text_encoder"].state_dict().items()}
    save_file({**qwen, "lm_head.weight": torch.zeros(300, 32)}, tmp_path / "qwen_3_4b.safetensors")
    mcfg = ModelConfig(path=tmp_path / "flux2.safetensors", config="flux2-tiny", ae=tmp_path / "flux2-vae.safetensors",
                       text_encoder=tmp_path / "qwen_3_4b.safetensors", tokenizer_path=tiny / "tokenizer")  # fmt: skip
    got = fam.load(mcfg, ["transformer", "vae", "text_encoder"])
    for part in ("transformer", "vae", "text_encoder"):
        want, have = ref[part].state_dict(), got[part].state_dict()
        assert set(have) == set(want) and all(torch.equal(have[k], want[k]) for k in want), part
    plain = fam.load(ModelConfig(path=tiny, ae=tmp_path / "vae.safetensors"), ["vae"])["vae"].state_dict()
    assert all(torch.equal(plain[k], v) for k, v in vae_sd.items())
    assert fam.recognises_single_file(list(original)) and fam.parts_in_single_file(list(original)) == ["transformer"]
    with pytest.raises(ModelLoadError, match=r"does not look like a FLUX\.2 transformer"):
        fam.load(ModelConfig(path=tmp_path / "vae.safetensors", config="flux2-tiny"), ["transformer"])


@pytest.mark.parametrize("layout", ["comfyui", "transformers4"])
def test_devs_mistral3_loads_from_comfyuis_single_file(tiny_dev, tmp_path, layout, monkeypatch):
    """[dev]'s Mistral 3 as ComfyUI's mistral_3_small_flux2_bf16.safetensors names it (a causal LM's model.layers.N
    beside vision_tower / multi_modal_projector at the top, the tokenizer as a tekken_model byte tensor) or in
    transformers 4's multimodal names (language_model.model.layers.N): loaded as the folder's, bit for bit, through a
    folder of several shards next to the file, which is gone afterwards."""
    from safetensors.torch import save_file

    from difftrain.families.flux2 import mistral_file

    fam = Flux2()
    ref = fam.load(ModelConfig(path=tiny_dev), ["text_encoder"], tokenizers=False)["text_encoder"].state_dict()
    if layout == "comfyui":
        renames = [("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector.")]  # fmt: skip
    else:
        renames = [("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head.")]  # fmt: skip
    own = {}
    for k, v in ref.items():
        old = next((o for o, _ in renames if k.startswith(o)), None)
        own[k if old is None else dict(renames)[old] + k[len(old) :]] = v.contiguous()
    own["tekken_model"] = torch.arange(16, dtype=torch.uint8)
    # the tiny model's layers past the pipeline's deepest tap, as the real file has them: not written, not read
    text_cfg = read_json(tiny_dev / "text_encoder" / "config.json")["text_config"]
    extra = {}
    prefix = "model." if layout == "comfyui" else "language_model.model."
    for name, v in own.items():
        if name.startswith(prefix + "layers.0."):
            extra[name.replace("layers.0.", f"layers.{text_cfg['num_hidden_layers']}.")] = v.clone()
    folder = tmp_path / "models"
    folder.mkdir()
    f = folder / "mistral_3_small_flux2_bf16.safetensors"
    save_file({**own, **extra}, f)
    monkeypatch.setattr(mistral_file, "SHARD_BYTES", 4096)  # several shards, as the real file's 38 GB make
    written = []
    real = mistral_file.write_folder
    monkeypatch.setattr(mistral_file, "write_folder", lambda *a: (real(*a), written.append(a[3]))[0])
    mcfg = ModelConfig(path=tiny_dev, text_encoder=f)
    got = fam.load(mcfg, ["text_encoder"], tokenizers=False)["text_encoder"].state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert written and written[0].parent == folder and not written[0].exists()  # next to the file, then removed
    assert sorted(p.name for p in folder.iterdir()) == [f.name]


def test_an_fp8_scaled_mistral3_file_loads_each_weight_times_its_scale(tiny_dev, tmp_path):
    """fp8-scaled copies: a weight_scale of one number or one per output row multiplies the fp8 weight, the older
    scale_weight too; input_scale (an fp8 matmul's activation scale) is left out."""
    from safetensors.torch import save_file

    fam = Flux2()
    ref = fam.load(ModelConfig(path=tiny_dev), ["text_encoder"], tokenizers=False)["text_encoder"].state_dict()
    own = {("model." + k.removeprefix("model.language_model.") if k.startswith("model.language_model.") else k): v
           for k, v in ref.items()}  # fmt: skip
    want = {}
    layouts = {"q_proj": "row", "k_proj": "one", "v_proj": "old"}
    for k in list(own):
        kind = next((layouts[p] for p in layouts if k.startswith("model.layers.0.") and f".{p}.weight" in k), None)
        if kind is None:
            continue
        w = own[k].float()
        scale = w.abs().amax(1) / 448 if kind == "row" else w.abs().max().reshape(()) / 448
        q = (w / (scale[:, None] if kind == "row" else scale)).to(torch.float8_e4m3fn)
        own[k] = q
        base = k.removesuffix(".weight")
        own[f"{base}.scale_weight" if kind == "old" else f"{base}.weight_scale"] = scale
        own[f"{base}.input_scale"] = torch.tensor(1.0)
        want["model.language_model." + k.removeprefix("model.")] = q.float() * (
            scale[:, None] if kind == "row" else scale
        )
    own["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    assert len(want) == 3
    f = tmp_path / "mistral3_fp8_scaled.safetensors"
    save_file({k: v.contiguous() for k, v in own.items()}, f)
    got = fam.load(ModelConfig(path=tiny_dev, text_encoder=f), ["text_encoder"], tokenizers=False)["text_encoder"]
    sd = got.state_dict()
    assert set(sd) == set(ref)
    for k, w in want.items():
        assert torch.equal(sd[k], w.to(sd[k].dtype)), k
        assert not torch.equal(sd[k], ref[k])  # the fp8 rounding shows: the scale was applied, not the weight kept
    rest = [k for k in ref if k not in want]
    assert all(torch.equal(sd[k], ref[k]) for k in rest)


def test_an_fp8_scaled_qwen3_file_loads_each_weight_times_its_scale(tiny, tmp_path):
    """klein's Qwen3 as an fp8-scaled copy (the shared language-model loader, llm_image.py): each weight times its
    weight_scale (per row or one number) or scale_weight, input_scale left out; as bf16 it was read unscaled."""
    from safetensors.torch import save_file

    fam = Flux2()
    ref = fam.load(ModelConfig(path=tiny), ["text_encoder"], tokenizers=False)["text_encoder"].state_dict()
    own = {f"model.{k}": v.contiguous() for k, v in ref.items()}
    want = {}
    for k, kind in (("layers.0.self_attn.q_proj.weight", "row"), ("layers.0.mlp.up_proj.weight", "one"),
                    ("layers.0.mlp.down_proj.weight", "old")):  # fmt: skip
        w = ref[k].float()
        scale = w.abs().amax(1) / 448 if kind == "row" else w.abs().max().reshape(()) / 448
        full = scale[:, None] if kind == "row" else scale
        q = (w / full).to(torch.float8_e4m3fn)
        base = "model." + k.removesuffix(".weight")
        own[f"model.{k}"] = q
        own[f"{base}.scale_weight" if kind == "old" else f"{base}.weight_scale"] = scale
        own[f"{base}.input_scale"] = torch.tensor(1.0)
        want[k] = q.float() * full
    f = tmp_path / "qwen_3_4b_fp8_scaled.safetensors"
    save_file(own, f)
    mcfg = ModelConfig(path=tiny, text_encoder=f)
    sd = fam.load(mcfg, ["text_encoder"], tokenizers=False)["text_encoder"].state_dict()
    assert set(sd) == set(ref)
    for k, w in want.items():
        assert torch.equal(sd[k], w.to(sd[k].dtype)) and not torch.equal(sd[k], ref[k]), k
    assert all(torch.equal(sd[k], ref[k]) for k in ref if k not in want)


def test_a_killed_runs_rewritten_mistral3_is_removed_and_a_running_ones_kept(tmp_path):
    """A run killed while loading leaves its rewritten folder beside the file: the next load removes it, and leaves
    one whose process still runs (this test's)."""
    import os
    import subprocess
    import sys

    from difftrain.families.flux2 import mistral_file

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = tmp_path / (mistral_file.PREFIX + "a"), tmp_path / (mistral_file.PREFIX + "b")
    for d, pid in ((dead, int(gone.stdout)), (live, os.getpid())):
        (d / "text_encoder").mkdir(parents=True)
        (d / "pid").write_text(str(pid))
    other = tmp_path / "mistral_3_small_flux2_bf16.safetensors"
    other.write_bytes(b"")
    assert mistral_file.remove_stale(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()


def test_a_file_that_is_not_mistral3_is_refused_for_dev(tiny_dev, tmp_path):
    from safetensors.torch import save_file

    f = tmp_path / "clip_l.safetensors"
    save_file({"text_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(4, 4)}, f)
    with pytest.raises(ModelLoadError, match=r"does not look like FLUX\.2 \[dev\]'s Mistral 3"):
        Flux2().load(ModelConfig(path=tiny_dev, text_encoder=f), ["text_encoder"], tokenizers=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f.name]


def test_a_files_blocks_and_a_folders_config_name_the_architecture(tiny_dev):
    fam = Flux2()
    keys = [f"double_blocks.{i}.img_attn.qkv.weight" for i in range(8)]
    keys += [f"single_blocks.{i}.linear1.weight" for i in range(24)] + [sf.MARKER]
    assert fam.single_file_architecture(keys) == "flux2-klein-9b"
    keys += [f"single_blocks.{i}.linear1.weight" for i in range(24, 48)]
    assert fam.single_file_architecture(keys) == "flux2-dev"
    assert fam.single_file_architecture(["double_blocks.0.img_mod.lin.weight"]) is None  # FLUX.1's
    assert fam.architecture(ModelConfig(path=tiny_dev)) == "flux2-klein-4b"  # no real one matches: the default
    assert fam.is_dev(ModelConfig(path=tiny_dev))


def test_flux1_and_flux2_are_told_apart(tiny):
    """FLUX.1's family claims neither a FLUX.2 folder nor a FLUX.2 file (both are BFL's double/single block names),
    nor lists FLUX.2's bundled configs; FLUX.2's claims no FLUX.1 file."""
    from difftrain.families.registry import get_family

    flux1, flux2 = get_family("flux"), Flux2()
    assert not flux1.recognises_folder(tiny, "Flux2KleinPipeline") and flux2.recognises_folder(tiny, "Flux2Pipeline")
    assert flux1.recognises_folder(tiny, "FluxPipeline") and not flux2.recognises_folder(tiny, "FluxPipeline")
    two = ["double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight", sf.MARKER]
    one = [
        "double_blocks.0.img_mod.lin.weight",
        "double_blocks.0.img_attn.qkv.weight",
        "single_blocks.0.linear1.weight",
    ]
    assert flux2.recognises_single_file(two) and not flux1.recognises_single_file(two)
    assert flux1.recognises_single_file(one) and not flux2.recognises_single_file(one)
    with pytest.raises(ModelLoadError, match="No bundled Flux config"):
        flux1.empty_part(ModelConfig(config="flux2-klein-4b"), "transformer")


def test_a_distilled_klein_is_warned_about_naming_the_base_model(tiny, tmp_path, capsys):
    from difftrain.families import llm_image

    distilled = tmp_path / "distilled"
    shutil.copytree(tiny, distilled)
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    llm_image._WARNED.clear()
    Flux2().load(ModelConfig(path=distilled), ["transformer"])
    err = " ".join(capsys.readouterr().err.split())
    assert "step-distilled" in err and "FLUX.2-klein-base-4B" in err
    llm_image._WARNED.clear()
    Flux2().load(ModelConfig(path=tiny), ["transformer"])
    assert "distilled" not in capsys.readouterr().err
    fam = Flux2()
    for name in ("flux-2-klein-4b.safetensors", "flux-2-klein-base-4b.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert fam.distilled(ModelConfig(path=tmp_path / "flux-2-klein-4b.safetensors", config="flux2-klein-4b"))
    assert not fam.distilled(ModelConfig(path=tmp_path / "flux-2-klein-base-4b.safetensors", config="flux2-klein-4b"))
    llm_image._WARNED.clear()


def test_a_caption_past_512_tokens_is_cut_as_the_pipeline_cuts_it_and_said(tiny, capsys):
    from diffusers import Flux2KleinPipeline

    fam = Flux2()
    comps = fam.load(ModelConfig(path=tiny), ["text_encoder"])
    long = "a very long caption " * 40  # 800 bytes: the tiny byte-level tokenizer's 800 tokens
    got = fam.encode_prompts(comps, [long, "short"], "llm", _opts(tiny))["prompt_embeds"]
    err = " ".join(capsys.readouterr().err.split())
    assert "1 caption(s) longer than FLUX.2's 512 text tokens are cut to it" in err
    with torch.no_grad():
        want, _ = Flux2KleinPipeline.from_pretrained(tiny).encode_prompt([long], device=torch.device("cpu"))
    torch.testing.assert_close(got[:1], want.float())


def test_edit_training_gives_the_transformer_the_pipelines_reference_inputs(tiny):
    """flux2-edit: the target's packed patches then each reference's, with the pipeline's ids (the references' time
    axis 10, 20), the target's tokens of the output; the references' latents as prepare_image_latents makes them."""
    from diffusers import Flux2KleinPipeline

    from difftrain.families.flux2 import Flux2Edit

    fam = Flux2Edit()
    comps = fam.load(ModelConfig(path=tiny), ["transformer", "vae"])
    tr = comps["transformer"]
    g = torch.Generator().manual_seed(0)
    refs = torch.rand(1, 2, 3, 64, 96, generator=g) * 2 - 1
    cached = fam.image_condition_entries(comps, refs[:, 0], references=refs)["reference_latents"]
    assert cached.shape == (1, 2, 4, 8, 12)
    pipe = Flux2KleinPipeline.from_pretrained(tiny)
    with torch.no_grad():
        ref_tokens, ref_ids = pipe.prepare_image_latents(
            [refs[0, i : i + 1] for i in range(2)], 1, None, torch.device("cpu"), torch.float32
        )
    assert ref_ids[0, :, 0].unique().tolist() == [10, 20]
    noisy = torch.randn(1, 4, 8, 8, generator=g)
    text = torch.randn(1, 11, 96, generator=g)
    t = torch.tensor([600.0])
    with torch.no_grad():
        got = fam.denoise(tr, noisy, t, {"prompt_embeds": text, "reference_latents": cached})
        x = pipe._patchify_latents(noisy)
        latents, ids = pipe._pack_latents(x), pipe._prepare_latent_ids(x)
        out = tr(
            hidden_states=torch.cat([latents, ref_tokens], dim=1),
            timestep=t / 1000,
            guidance=None,
            encoder_hidden_states=text,
            txt_ids=pipe._prepare_text_ids(text),
            img_ids=torch.cat([ids, ref_ids], dim=1),
            return_dict=False,
        )[0][:, : latents.shape[1]]
        want = pipe._unpatchify_latents(pipe._unpack_latents_with_ids(out, ids, 4, 4))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    without = fam.denoise(tr, noisy, t, {"prompt_embeds": text, "reference_latents": cached[:, :1]})
    assert not torch.allclose(without, got, atol=1e-4)  # the second reference is seen


def test_a_random_transformer_too_big_for_the_disk_in_bf16_is_stored_and_loaded_as_fp8(tmp_path, monkeypatch):
    """build_random stores FLUX.2 dev's random transformer in fp8 (its 64 GB of bf16 filled a 64 GiB disk): the
    threshold lowered, the tiny one is written in fp8 and loads as its bf16 build's weights cast through fp8."""
    from safetensors import safe_open

    from difftrain.families.flux2 import family as f2

    fam = Flux2()
    plain = fam.build_random("flux2-tiny", tmp_path / "bf16", seed=3, parts=["transformer"])
    monkeypatch.setattr(f2, "RANDOM_FP8_ABOVE_BYTES", 0)
    small = fam.build_random("flux2-tiny", tmp_path / "fp8", seed=3, parts=["transformer"])
    stored = small / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(stored), "pt") as f:
        name = next(k for k in f.keys() if k.endswith("to_q.weight"))  # noqa: SIM118 - safe_open is no dict
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn

    def load(p):
        return fam.load(ModelConfig(path=p), ["transformer"], tokenizers=False)["transformer"].state_dict()

    want, got = load(plain), load(small)
    assert set(got) == set(want)
    for k, w in want.items():
        if w.is_floating_point():
            torch.testing.assert_close(got[k].float(), w.to(torch.float8_e4m3fn).float(), rtol=0, atol=0)
