"""Qwen-Image 2.1 on tiny seeded models of the real layout: the bundled real architecture's sizes, the captions as
QwenImage21Pipeline.encode_prompt gives them one prompt at a time, the VAE's latents as its _encode_vae_image makes
them (RGBA), the transformer's call as the pipeline makes it in a batch of captions of different lengths, and the
objective (noise level, shift, target's sign) against one step of the pipeline itself."""

from __future__ import annotations

import math

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import ConfigError, ModelLoadError
from difftrain.families.qwenimage import QwenImage21
from difftrain.families.qwenimage.v21 import pack, unpack

CAPTIONS = ["a fox", "a cat on a red sofa in the evening light"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return QwenImage21().build_tiny(tmp_path_factory.mktemp("qi21") / "m", seed=0)


@pytest.fixture(scope="module")
def loaded(tiny):
    fam = QwenImage21()
    mcfg = ModelConfig(path=tiny)
    comps = fam.load(mcfg, ["transformer", "vae", "text_encoder"])
    return fam, mcfg, comps, fam.pipeline(comps, mcfg)


def _opts(tiny):
    return resolve(recipe="tiny-qwen-image-2.1-lora", sets=[f"model.path={tiny}", "data.dir=."]).config.text_encoders


@pytest.mark.slow
def test_the_bundled_architecture_has_the_released_models_sizes():
    """The transformer and VAE as diffusers' classes default (32 blocks of 4 096: 7.12B; the 64-channel RGBA VAE),
    Qwen3-VL-8B-Instruct (8.77B with its vision tower and untied head), built on the meta device."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

    fam = QwenImage21()
    mcfg = ModelConfig(config="qwen-image-2.1")
    with torch.device("meta"):
        parts = {p: fam.empty_part(mcfg, p) for p in ("transformer", "text_encoder", "vae")}
        defaults = {"transformer": QwenImage21Transformer2DModel(), "vae": AutoencoderKLQwenImage21()}
    counts = {p: sum(x.numel() for x in m.parameters()) for p, m in parts.items()}
    assert counts == {"transformer": 7_115_124_736, "text_encoder": 8_767_123_696, "vae": 337_740_404}
    for p, m in defaults.items():
        assert counts[p] == sum(x.numel() for x in m.parameters())
    te = parts["text_encoder"].config.text_config
    assert te.hidden_size == parts["transformer"].config.context_in_dim == 4096
    assert parts["vae"].config.in_channels == 4 and parts["vae"].config.z_dim == 64


def test_captions_are_the_pipelines_prompt_embeds_one_prompt_at_a_time(tiny, loaded):
    fam, _, comps, pipe = loaded
    got = fam.encode_prompts(comps, CAPTIONS, "qwen3vl", _opts(tiny))["prompt_embeds"]
    assert got[0].shape[0] < got[1].shape[0]  # each at its own length, no padding rows
    for caption, g in zip(CAPTIONS, got):
        embeds, mask, image_mask = pipe.encode_prompt([caption], device=torch.device("cpu"))
        assert mask is None and not image_mask.any()  # one prompt: nothing padded, no image slot
        torch.testing.assert_close(g, embeds[0].float(), rtol=1e-5, atol=1e-6)
    # the states are taken before the final norm (the pipeline's hook): the norm would change them
    norm = comps["text_encoder"].model.language_model.norm
    assert not torch.allclose(norm(got[0]), got[0], atol=1e-3)


def test_latents_are_the_pipelines_rgba_encoding(loaded):
    """An RGB image in [-1, 1] is encoded as the pipeline encodes the same image made opaque RGBA (alpha 1.0)."""
    fam, _, comps, pipe = loaded
    from PIL import Image

    g = torch.Generator().manual_seed(3)
    rgb = torch.rand(1, 3, 64, 96, generator=g)
    img = Image.fromarray((rgb[0].permute(1, 2, 0) * 255).round().byte().numpy(), "RGB").convert("RGBA")
    pixels = pipe.image_processor.preprocess(img, height=64, width=96)
    assert pixels.shape[1] == 4 and torch.all(pixels[:, 3] == 1.0)
    with torch.no_grad():
        want = pipe._encode_vae_image(pixels.unsqueeze(2), None).squeeze(2)
        got = fam.encode_images(comps, pixels[:, :3])
    assert got.shape == (1, 16, 4, 6)  # 16x spatially
    torch.testing.assert_close(got, want)


def test_the_transformer_gets_the_pipelines_inputs_in_a_mixed_length_batch(tiny, loaded):
    """Two captions of different lengths (padded by collate_text) give each sample what the pipeline's transformer
    call gives it for its prompt alone (img_mask with the appended target slots, img_shapes, t / 1000)."""
    fam, _, comps, pipe = loaded
    cached = fam.encode_prompts(comps, CAPTIONS, "qwen3vl", _opts(tiny))["prompt_embeds"]
    batch = fam.collate_text("qwen3vl", [{"prompt_embeds": t} for t in cached])
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 16, 4, 6, generator=g)
    t = torch.tensor([250.0, 900.0])
    tr = comps["transformer"]
    with torch.no_grad():
        got = fam.denoise(tr, noisy, t, batch)
        for i in range(2):
            embeds, mask, image_mask = pipe.encode_prompt([CAPTIONS[i]], device=torch.device("cpu"))
            latents = pipe._pack_latents(noisy[i : i + 1], 1, 16, 4, 6)
            img_mask = torch.cat([image_mask, image_mask.new_ones(1, latents.shape[1] // 4)], dim=1)
            pred = tr(
                hidden_states=latents,
                timestep=t[i : i + 1] / 1000,
                encoder_hidden_states=embeds,
                encoder_hidden_states_mask=mask,
                img_shapes=[[(1, 4, 6)]],
                img_mask=img_mask,
                return_dict=False,
            )[0][:, -latents.shape[1] :]
            want = pipe._unpack_latents(pred, 64, 96, 16).squeeze(2)
            torch.testing.assert_close(got[i : i + 1], want, rtol=1e-4, atol=1e-5)
    # padding the shorter caption into the longer one's call would move its image's rotary frame: not the same
    padded = tr(
        hidden_states=pack(noisy[:1]),
        timestep=t[:1] / 1000,
        encoder_hidden_states=batch["prompt_embeds"][:1],
        encoder_hidden_states_mask=torch.arange(batch["prompt_embeds"].shape[1])[None] < cached[0].shape[0],
        img_shapes=[[(1, 4, 6)]],
        img_mask=torch.cat(
            [torch.zeros(1, batch["prompt_embeds"].shape[1], dtype=torch.bool), torch.ones(1, 6).bool()], 1
        ),
        return_dict=False,
    )[0][:, -24:]
    assert not torch.allclose(unpack(padded, 4, 6), got[:1], atol=1e-4)


def test_the_objective_is_one_step_of_the_pipeline(tiny, loaded):
    """The level the objective trains at is the scheduler's shifted sigma for this image's token count (h * w
    latent pixels, calculate_shift over the scheduler config), and one pipeline step from it with the model's
    prediction is x_s - sigma * prediction: so the ideal prediction, the target, is noise - x0 (the step lands on
    x0)."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    from difftrain.trainers.objectives import Draws, Objective

    fam, mcfg, comps, pipe = loaded
    cfg = resolve(recipe="tiny-qwen-image-2.1-lora", sets=[f"model.path={tiny}", "data.dir=."]).config
    obj = Objective(
        cfg, fam, fam.training_scheduler(mcfg), Draws(torch.Generator(), torch.device("cpu")), torch.float32, None
    )
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(1, 16, 8, 6, generator=g), torch.randn(1, 16, 8, 6, generator=g)
    q = torch.tensor([0.6])
    noisy, timesteps, target, _ = obj.flow_inputs(x0, noise, q)
    sigma = timesteps / 1000
    sc = pipe.scheduler.config
    mu = calculate_shift(48, sc.base_image_seq_len, sc.max_image_seq_len, sc.base_shift, sc.max_shift)
    assert float(sigma) == pytest.approx(math.exp(mu) * 0.6 / (1 + (math.exp(mu) - 1) * 0.6), rel=1e-6)
    torch.testing.assert_close(noisy - sigma * target, x0)
    cached = fam.encode_prompts(comps, [CAPTIONS[1]], "qwen3vl", _opts(tiny))["prompt_embeds"]
    batch = fam.collate_text("qwen3vl", [{"prompt_embeds": cached[0]}])
    with torch.no_grad():
        pred = fam.denoise(comps["transformer"], noisy, timesteps, batch)
        out = pipe(CAPTIONS[1], height=128, width=96, latents=pack(noisy), sigmas=[0.6], output_type="latent").images
    assert pipe.scheduler.sigmas[0].item() == pytest.approx(float(sigma), rel=1e-5)
    torch.testing.assert_close(unpack(out, 8, 6), noisy - sigma * pred, rtol=1e-4, atol=1e-5)


def test_odd_latent_sides_are_refused_with_the_bucket_step(loaded):
    fam, _, comps, _ = loaded
    batch = fam.collate_text("qwen3vl", [{"prompt_embeds": torch.randn(5, 32)}])
    with pytest.raises(ConfigError, match="multiples of 32 pixels"):
        fam.denoise(comps["transformer"], torch.randn(1, 16, 3, 4), torch.tensor([500.0]), batch)


def test_comfyui_transformer_files_load_with_the_fused_swiglu_split(tiny, loaded, tmp_path):
    from safetensors.torch import save_file

    fam, _, comps, _ = loaded
    sd = comps["transformer"].state_dict()
    comfy = {}
    for k, v in sd.items():
        if k.endswith("img_mlp.proj.weight"):
            continue
        if k.endswith("img_mlp.gate_layer.weight"):
            up = sd[k.replace("gate_layer", "proj")]
            comfy["model.diffusion_model." + k.replace("gate_layer", "gate_up")] = torch.cat([v, up]).contiguous()
        else:
            comfy["model.diffusion_model." + k] = v.contiguous()
    save_file(comfy, tmp_path / "qwen_image_2.1.safetensors")
    mcfg = ModelConfig(path=tmp_path / "qwen_image_2.1.safetensors", config="qwen-image-2.1-tiny")
    got = fam.load(mcfg, ["transformer"])["transformer"].state_dict()
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    with pytest.raises(ModelLoadError, match="transformer only; it has no Qwen3-VL text encoder"):
        fam.load(mcfg, ["text_encoder"])


def test_qwen_image_refuses_a_qwen_image_21_architecture_through_the_console_script():
    """`family: qwen-image` with model.config qwen-image-2.1 (the bundled name starts with its prefix) planned 76.9
    GiB for a model the family cannot build; now it says which family trains it, exit 1, no traceback."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "difftrain", "plan", "--recipe", "tiny-qwen-image-lora"]
    wrong = subprocess.run([*cmd, "--set", "model.config=qwen-image-2.1"], capture_output=True, text=True)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "Set family: qwen-image-2.1" in wrong.stderr and "Traceback" not in wrong.stderr
