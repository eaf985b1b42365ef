"""Image-to-video Wan on tiny seeded models: the first-frame conditioning, the mask and the CLIP states are what
WanImageToVideoPipeline builds; training on clips (2.1 with CLIP; a 2.2 expert) exports LoRAs its pipeline loads;
an image item is refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import DataError, ModelLoadError
from difftrain.families.wan import Wan, WanI2V


@pytest.fixture(scope="module")
def tiny_i2v(tmp_path_factory):
    return WanI2V().build_tiny(tmp_path_factory.mktemp("wani2v") / "m", seed=0)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from difftrain.flows.quickstart import make_clips

    pytest.importorskip("av")
    return make_clips(tmp_path_factory.mktemp("clips") / "clips", n=2, frames=12, size=64)


def test_the_conditioning_is_the_pipelines(tiny_i2v):
    """Condition latents and mask of WanImageToVideoPipeline.prepare_latents, its CLIP states of the first frame,
    and the transformer's input: [noisy, mask, condition] on channels."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    fam = WanI2V()
    comps = fam.load(ModelConfig(path=tiny_i2v), ["vae"])
    assert {"image_encoder", "image_processor"} <= set(comps)  # CLIP comes with the VAE
    g = torch.Generator().manual_seed(0)
    video = torch.rand(1, 3, 9, 32, 48, generator=g) * 2 - 1
    entries = fam.image_condition_entries(comps, video)
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_i2v)
    _, cond = pipe.prepare_latents(
        video[:, :, 0], 1, 16, 32, 48, 9, torch.float32, torch.device("cpu"), generator=torch.Generator().manual_seed(1)
    )
    assert cond.shape == (1, 20, 3, 4, 6)
    torch.testing.assert_close(entries["condition_latents"], cond[:, 4:])
    rgb = ((video[0, :, 0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    torch.testing.assert_close(entries["image_embeds"], pipe.encode_image(Image.fromarray(rgb), torch.device("cpu")))
    tr = fam.load(ModelConfig(path=tiny_i2v), ["transformer"])["transformer"]
    noisy, text = torch.randn(1, 16, 3, 4, 6, generator=g), torch.randn(1, 512, 32, generator=g)
    t = torch.tensor([400.0])
    batch = {"prompt_embeds": text, **entries}
    with torch.no_grad():
        got = fam.denoise(tr, noisy, t, batch)
        want = tr(
            hidden_states=torch.cat([noisy, cond], dim=1),
            timestep=t,
            encoder_hidden_states=text,
            encoder_hidden_states_image=entries["image_embeds"],
            return_dict=False,
        )[0]
    torch.testing.assert_close(got, want)


def test_an_image_item_and_the_wrong_family_are_refused_by_name(tiny_i2v):
    fam = WanI2V()
    comps = fam.load(ModelConfig(path=tiny_i2v), ["vae"])
    with pytest.raises(DataError, match="one-frame item"):
        fam.image_condition_entries(comps, torch.zeros(1, 3, 32, 48))
    with pytest.raises(ModelLoadError, match="family: wan-i2v"):
        Wan().load(ModelConfig(path=tiny_i2v), ["transformer"])
    t2v = Wan().build_tiny(tiny_i2v.parent / "t2v")
    with pytest.raises(ModelLoadError, match="text-to-video"):
        fam.load(ModelConfig(path=t2v), ["transformer"])


@pytest.mark.slow
def test_wan21_i2v_trains_on_clips_and_its_lora_loads_into_the_i2v_pipeline(tiny_i2v, clips, tmp_path):
    from diffusers import WanImageToVideoPipeline

    sets = tiny_sets(
        tiny_i2v, clips, tmp_path, **{"family": "wan-i2v", "model.config": "wan-tiny-i2v", "train.max_steps": 2}
    )
    cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import train

    precompute(cfg)
    r = train(cfg)
    assert len(r.losses) == 2 and all(torch.isfinite(torch.tensor(r.losses)))
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_i2v)
    pipe.load_lora_weights(str(r.lora_path))
    assert (r.lora_path.parent / "lora_kohya.safetensors").exists()


@pytest.mark.slow
def test_a_wan22_i2v_expert_trains_below_its_boundary(clips, tmp_path):
    fam = WanI2V()
    model = fam.build_tiny(tmp_path / "a14b", config="wan-tiny-i2v-a14b")
    mcfg = ModelConfig(path=model, expert="low_noise")
    assert fam.timestep_range(mcfg) == (0.0, 0.9)  # the I2V boundary
    assert not fam.clip(mcfg) and "image_encoder" not in fam.load(mcfg, ["vae"])
    sets = tiny_sets(model, clips, tmp_path, **{"family": "wan-i2v", "model.expert": "low_noise", "train.max_steps": 2})
    cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import train

    precompute(cfg)
    r = train(cfg)
    assert len(r.losses) == 2 and (r.lora_path.parent / "lora_kohya_low_noise.safetensors").exists()


@pytest.mark.slow
def test_an_i2v_run_without_start_images_stops_before_precompute_through_the_console_script(tiny_i2v, clips, tmp_path):
    from conftest import clean_failure, script_train, set_args

    sets = tiny_sets(tiny_i2v, clips, tmp_path, **{"family": "wan-i2v", "validation.prompts": "[a fox]"})
    r = script_train("--recipe", "tiny-wan-lora", *set_args(sets))
    clean_failure(r, 2, "image-to-video need a start image per prompt", "validation.images")
    assert not (tmp_path / "cache").exists()  # nothing encoded


def test_an_experts_lora_is_refused_by_the_other_expert(tmp_path):
    from safetensors.torch import save_file

    from difftrain.errors import CheckpointError
    from difftrain.lora.files import read_lora_file

    f = tmp_path / "high.safetensors"
    save_file(
        {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24)},
        f,
        metadata={"difftrain.expert": "high_noise"},
    )
    for expert in ("low_noise", None):
        with pytest.raises(CheckpointError, match="trained for the high_noise expert") as e:
            read_lora_file(f, ModelConfig(path=tmp_path, expert=expert), WanI2V(), ["transformer"])
        assert "model.expert: high_noise" in e.value.hint


# ------------------------------------------------------------------ TI2V-5B's image-to-video mode (in place)
@pytest.fixture(scope="module")
def tiny_ti2v(tmp_path_factory):
    return WanI2V().build_tiny(tmp_path_factory.mktemp("ti2v") / "m", seed=0, config="wan-tiny-ti2v")


def test_ti2v_conditions_in_place_as_the_pipeline_with_expand_timesteps(tiny_ti2v):
    """The start frame's latents are the clip's own first latent frame (the pipeline encodes the image alone: the
    same, the VAE being causal); the transformer reads the latents with that frame clean and timestep 0 for each
    of its tokens, as WanImageToVideoPipeline's denoising loop with expand_timesteps builds them."""
    from diffusers import WanImageToVideoPipeline

    fam = WanI2V()
    mcfg = ModelConfig(path=tiny_ti2v, config="wan-tiny-ti2v")
    comps = fam.load(mcfg, ["vae"])
    g = torch.Generator().manual_seed(0)
    video = torch.rand(1, 3, 9, 64, 96, generator=g) * 2 - 1
    assert fam.image_condition_entries(comps, video) == {}  # nothing more cached
    latents = fam.encode_images(comps, video)
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_ti2v)
    assert pipe.config.expand_timesteps
    noise, cond, first_mask = pipe.prepare_latents(
        video[:, :, 0], 1, 48, 64, 96, 9, torch.float32, torch.device("cpu"), generator=torch.Generator().manual_seed(1)
    )
    assert cond.shape == (1, 48, 1, 4, 6) and latents.shape == (1, 48, 3, 4, 6)
    torch.testing.assert_close(latents[:, :, :1], cond, atol=1e-4, rtol=1e-4)
    keep = fam.kept_clean(latents)
    assert keep is not None and keep.flatten().tolist() == [True, False, False]
    assert fam.kept_clean(torch.zeros(1, 16, 3, 4, 6)) is None  # 2.1 / 2.2 I2V: channels, not in place
    tr = fam.load(mcfg, ["transformer"])["transformer"]
    text = torch.randn(1, 512, 32, generator=g)
    t = torch.tensor([700.0])
    model_input = (1 - first_mask) * cond + first_mask * noise  # the pipeline's latent_model_input
    with torch.no_grad():
        got = fam.denoise(tr, torch.where(keep, latents, noise), t, {"prompt_embeds": text})
        want = tr(
            hidden_states=model_input,
            timestep=(first_mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0),
            encoder_hidden_states=text,
            return_dict=False,
        )[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(DataError, match="one-frame item"):
        fam.image_condition_entries(comps, torch.zeros(1, 3, 64, 96))


def test_the_objective_keeps_ti2vs_start_frame_clean_and_out_of_the_loss(tiny_ti2v):
    """The noisy input's first latent frame is the clean one; what the model predicts there does not change the
    loss, which is the mean over the other frames."""
    from difftrain.trainers.objectives import Draws, Objective

    fam = WanI2V()
    cfg = resolve(
        recipe="tiny-wan-lora",
        sets=[f"model.path={tiny_ti2v}", "data.dir=.", "family=wan-i2v", "model.config=wan-tiny-ti2v"],
    ).config
    obj = Objective(
        cfg, fam, fam.training_scheduler(cfg.model), Draws(torch.Generator(), torch.device("cpu")), torch.float32, None
    )
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 48, 3, 4, 6, generator=g)
    seen = {}

    def fake_denoise(den, noisy, t, batch):
        seen["noisy"] = noisy
        return den(noisy)

    fam.denoise = fake_denoise  # type: ignore[method-assign]  # this instance only
    noise, q = torch.randn(latents.shape, generator=g), torch.tensor([0.3, 0.8])
    pred = torch.randn(latents.shape, generator=g)
    base = obj.loss(lambda x: pred, {"latents": latents}, fixed=(noise, q), per_sample=True)
    torch.testing.assert_close(seen["noisy"][:, :, 0], latents[:, :, 0])
    assert not torch.allclose(seen["noisy"][:, :, 1:], latents[:, :, 1:])
    other = pred.clone()
    other[:, :, 0] += 100.0  # the start frame's prediction: not learned
    torch.testing.assert_close(obj.loss(lambda x: other, {"latents": latents}, fixed=(noise, q), per_sample=True), base)
    _, _, target, _ = obj.flow_inputs(latents, noise, q)
    want = (pred[:, :, 1:] - target[:, :, 1:]).square().mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(base, want)


@pytest.mark.slow
def test_ti2v_trains_image_to_video_on_clips_and_its_lora_loads_into_the_i2v_pipeline(tiny_ti2v, clips, tmp_path):
    from diffusers import WanImageToVideoPipeline

    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import train

    sets = tiny_sets(
        tiny_ti2v,
        clips,
        tmp_path,
        **{
            "family": "wan-i2v",
            "model.config": "wan-tiny-ti2v",
            "train.max_steps": 2,
            "data.bucket_step": 32,
            "data.resolution": 64,
        },
    )
    cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
    precompute(cfg)
    r = train(cfg)
    assert len(r.losses) == 2 and all(torch.isfinite(torch.tensor(r.losses)))
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_ti2v)
    pipe.load_lora_weights(str(r.lora_path))
