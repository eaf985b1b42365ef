"""Qwen-Image-Edit (Edit, Edit-2509/2511) on tiny seeded models of the real layout: the bundled variants, the
instruction encoded with its references and the transformer's inputs exactly as QwenImageEditPipeline and
QwenImageEditPlusPipeline build them (the denoiser's prediction equals the pipeline's for the same latents), and the
pairs of edit training data (control folders, pairs files)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from difftrain.config.schema import ModelConfig, TextEncodersConfig
from difftrain.families.llm_image import pack_2x2, unpack_2x2
from difftrain.families.qwenimage import QwenImageEdit
from difftrain.families.qwenimage.edit import EDIT, EDIT_PLUS

#: the pipelines' reference sizes scaled down for a CPU test: VAE ~64x64 (not ~1024x1024), VL ~32x32 (not ~384x384)
SCALE = 256


@pytest.fixture(scope="module")
def tiny_plus(tmp_path_factory):
    return QwenImageEdit().build_tiny(tmp_path_factory.mktemp("qie") / "plus", seed=0)


@pytest.fixture(scope="module")
def tiny_edit(tmp_path_factory):
    return QwenImageEdit().build_tiny(tmp_path_factory.mktemp("qie") / "edit", seed=0, config="qwen-image-edit-tiny")


@pytest.fixture
def small_sizes(monkeypatch):
    """Both pipelines' reference sizes divided by SCALE in area (their own calculate_dimensions and constants, which
    the family reads too)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_mod
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_mod

    monkeypatch.setattr(plus_mod, "VAE_IMAGE_SIZE", plus_mod.VAE_IMAGE_SIZE // SCALE)
    monkeypatch.setattr(plus_mod, "CONDITION_IMAGE_SIZE", plus_mod.CONDITION_IMAGE_SIZE // SCALE * 4)
    orig = edit_mod.calculate_dimensions
    monkeypatch.setattr(edit_mod, "calculate_dimensions", lambda area, ratio: orig(area // SCALE, ratio))


def test_the_bundled_variants():
    """Edit is QwenImageEditPipeline, 2509 and 2511 QwenImageEditPlusPipeline; 2511's transformer has zero_cond_t and
    the same 20.43B parameters as Qwen-Image's; a transformer file's name tells 2509 / 2511 apart."""
    fam = QwenImageEdit()
    names = {c: fam.pipeline_name(ModelConfig(config=c)) for c in fam.known_configs()}
    assert names["qwen-image-edit"] == EDIT
    assert names["qwen-image-edit-2509"] == names["qwen-image-edit-2511"] == EDIT_PLUS
    with torch.device("meta"):
        t = fam.empty_part(ModelConfig(config="qwen-image-edit-2511"), "transformer")
    assert t.zero_cond_t and sum(p.numel() for p in t.parameters()) == 20_430_401_088
    assert not fam.part_config(ModelConfig(config="qwen-image-edit-2509"), "transformer").get("zero_cond_t")
    assert fam.architecture(ModelConfig(path="/x/qwen_image_edit_2511_bf16.safetensors")) == "qwen-image-edit-2511"
    assert fam.architecture(ModelConfig(path="/x/qwen_image_edit_2509_bf16.safetensors")) == "qwen-image-edit-2509"
    assert fam.architecture(ModelConfig(path="/x/qwen_image_edit_bf16.safetensors")) == "qwen-image-edit"


def test_comfyuis_edit_transformer_file_loads_as_the_named_version(tiny_plus, tmp_path):
    """ComfyUI's Edit transformer file (Qwen-Image's names) loads with the architecture model.config names: 2511's
    zero_cond_t is the config's, not the file's."""
    from safetensors.torch import save_file

    fam = QwenImageEdit()
    ref = fam.load(ModelConfig(path=tiny_plus), ["transformer"], tokenizers=False)["transformer"]
    f = tmp_path / "qwen_image_edit_2511_bf16.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in ref.state_dict().items()}, f)
    got = fam.load(ModelConfig(path=f, config="qwen-image-edit-plus-tiny"), ["transformer"])["transformer"]
    assert got.zero_cond_t and all(torch.equal(got.state_dict()[k], v) for k, v in ref.state_dict().items())
    flat = fam.load(ModelConfig(path=f, config="qwen-image-edit-tiny"), ["transformer"])["transformer"]
    assert not flat.zero_cond_t


def test_the_comfyui_set_loads_the_processor_from_the_bundled_config(tiny_plus, tmp_path):
    """Edit from ComfyUI's files: the transformer file, Qwen2.5-VL's own file (the Hub's names) and its tokenizer
    folder; the image processor comes from the named architecture's bundled config, as the folder's would."""
    from test_qwen_image_family import comfyui_set

    fam = QwenImageEdit()
    ref, mcfg = comfyui_set(fam, tiny_plus, "qwen-image-edit-plus-tiny", tmp_path)
    got = fam.load(mcfg, ["text_encoder"])
    want = ref["text_encoder"].state_dict()
    assert all(torch.equal(got["text_encoder"].state_dict()[k], v) for k, v in want.items())
    assert type(got["processor"]).__name__ == type(ref["processor"]).__name__
    assert got["processor"].image_processor.to_dict() == ref["processor"].image_processor.to_dict()


def _capture(pipe):
    """The transformer's keyword arguments and output of its first call in the pipeline."""
    seen: dict = {}

    def hook(module, args, kwargs, out):
        if not seen:
            seen.update(kwargs=dict(kwargs), out=out[0].detach().clone())

    pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("variant", ["plus", "edit"])
def test_the_denoiser_gets_the_edit_pipelines_inputs(variant, tiny_plus, tiny_edit, small_sizes):
    """For the same prompt, references and noisy latents: the cached instruction equals the pipeline's prompt
    embeddings, the cached reference latents its packed image latents, and ``denoise`` (the training call) gives
    the transformer the pipeline's inputs and returns the pipeline's prediction of the target's tokens."""
    folder = tiny_plus if variant == "plus" else tiny_edit
    fam, mcfg = QwenImageEdit(), ModelConfig(path=folder)
    comps = fam.load(mcfg, ["transformer", "vae", "text_encoder"])
    # two references of one aspect (the pipeline sizes each by its own; training's share the target's bucket)
    refs = [Image.new("RGB", (96, 64), (200, 30, 30)), Image.new("RGB", (120, 80), (20, 160, 40))]
    refs = refs if variant == "plus" else refs[:1]
    pipe = fam.pipeline(comps, mcfg)
    seen = _capture(pipe)
    g = torch.Generator().manual_seed(0)
    pipe(image=refs if variant == "plus" else refs[0], prompt="make the sky green", height=64, width=64,
         num_inference_steps=2, generator=g, output_type="latent")  # fmt: skip
    kw = seen["kwargs"]
    # the text: the instruction with its references, as the pipeline encodes it (one prompt: no mask)
    text = fam.encode_prompts_with_images(comps, ["make the sky green"], [refs], "qwen25vl", TextEncodersConfig(), mcfg)
    torch.testing.assert_close(text["prompt_embeds"][0], kw["encoder_hidden_states"][0].float())
    # the references' latents from the images the pipeline hands its VAE
    shapes = kw["img_shapes"][0]
    vae_in = torch.stack(
        [pipe.image_processor.preprocess(r, s[1] * 16, s[2] * 16)[0] for r, s in zip(refs, shapes[1:], strict=True)]
    )
    if variant == "plus":  # the VL sees the references smaller than the VAE does
        assert fam.vl_images(refs, True)[0].size < (shapes[1][2] * 16, shapes[1][1] * 16)
    ref_lat = []
    for r in vae_in:
        lat = fam.image_condition_entries(comps, r[None], references=r[None, None])["reference_latents"][0, 0]
        ref_lat.append(lat)
    h, w = shapes[0][1] * 2, shapes[0][2] * 2
    n_target = h * w // 4
    packed_refs = torch.cat([pack_2x2(lat[None]) for lat in ref_lat], dim=1)
    torch.testing.assert_close(packed_refs, kw["hidden_states"][:, n_target:], rtol=1e-4, atol=1e-4)
    # the training call: the pipeline's noisy target, its sigma, the cached text and references
    noisy = unpack_2x2(kw["hidden_states"][:, :n_target], h, w)
    batch = fam.collate_text("qwen25vl", [{"prompt_embeds": text["prompt_embeds"][0]}])
    got: dict = {}

    def hook(module, args, kwargs, out):
        got.update(kwargs)

    handle = comps["transformer"].register_forward_hook(hook, with_kwargs=True)
    batch["reference_latents"] = torch.stack(ref_lat)[None]
    with torch.no_grad():
        pred = fam.denoise(comps["transformer"], noisy, kw["timestep"] * 1000, batch)
    handle.remove()
    assert got["img_shapes"] == kw["img_shapes"]
    torch.testing.assert_close(got["hidden_states"], kw["hidden_states"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["timestep"], kw["timestep"])
    torch.testing.assert_close(pred, unpack_2x2(seen["out"][:, :n_target], h, w), rtol=1e-4, atol=1e-4)
