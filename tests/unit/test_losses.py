"""The loss per element (train.loss_type, sd-scripts' formulas) and the masked loss's weights, through the objective."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from difftrain.config.schema import Config, TrainConfig
from difftrain.trainers.objectives import Draws, Objective, elementwise_loss, huber_threshold


class _Pointwise:
    """A family whose denoiser is a 1x1 convolution: each latent pixel's prediction depends on that pixel only."""

    guidance_scale = 1.0
    full_precision_inputs: tuple[str, ...] = ()

    def __init__(self, objective: str):
        self.objective = objective

    def timestep_range(self, mcfg):
        return None

    def kept_clean(self, latents):
        return None

    def drop_image_conditioning(self, batch, generator):
        return batch

    def denoise(self, den, noisy, timesteps, batch):
        assert "loss_mask" not in batch  # the mask is the objective's, never the denoiser's
        return den(noisy)


def _objective(objective: str, **train) -> Objective:
    cfg = Config.model_validate({"family": "sdxl", "model": {"path": "."}, "train": train})
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0) if objective == "flow" else DDPMScheduler()
    fam = _Pointwise(objective)
    return Objective(cfg, fam, sched, Draws(torch.Generator().manual_seed(0), torch.device("cpu")), torch.float32, None)  # type: ignore[arg-type]


def _reference(e: float, c: float, kind: str) -> float:
    """sd-scripts' conditional_loss for one element, written out."""
    pseudo = math.sqrt(e * e + c * c) - c
    return 2 * c * pseudo if kind == "huber" else 2 * pseudo


@pytest.mark.parametrize("kind", ["huber", "smooth_l1"])
def test_huber_and_smooth_l1_follow_sd_scripts_formulas(kind):
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64), torch.randn(3, 2, 4, 4, generator=g)
    c = torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64)
    out = elementwise_loss(pred, target.double(), kind, c)
    for i in range(3):
        for j in (0, 7, 31):
            e = float((pred[i] - target[i]).flatten()[j])
            assert out[i].flatten()[j].item() == pytest.approx(_reference(e, float(c[i]), kind), rel=1e-12)
    # small errors are quadratic, large ones linear: huber ~ e^2 near 0, ~ 2c|e| far out
    zero, c01 = torch.zeros(1, 1, dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)
    small, big = torch.full_like(zero, 1e-3), torch.full_like(zero, 1e3)
    assert elementwise_loss(small, zero, "huber", c01).item() == pytest.approx(1e-6, rel=1e-3)
    assert elementwise_loss(big, zero, "huber", c01).item() == pytest.approx(200, rel=1e-3)


def test_l1_and_l2():
    pred, target = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 1.0]])
    assert elementwise_loss(pred, target, "l2", None).tolist() == [[0.25, 9.0]]
    assert elementwise_loss(pred, target, "l1", None).tolist() == [[0.5, 3.0]]


def test_huber_schedules():
    ddpm = DDPMScheduler()
    t = torch.tensor([0, 250, 999])
    constant = TrainConfig(loss_type="huber", huber_schedule="constant", huber_c=0.2, huber_scale=3.0)
    assert huber_threshold(constant, t, ddpm, "ddpm").tolist() == pytest.approx([0.6] * 3)
    expo = TrainConfig(loss_type="smooth_l1", huber_schedule="exponential", huber_c=0.1, huber_scale=2.0)
    got = huber_threshold(expo, torch.tensor([0, 500, 1000]), ddpm, "ddpm")
    assert got.tolist() == pytest.approx([2.0, 2.0 * 0.1**0.5, 0.2], rel=1e-6)  # scale x c^(t/T)
    snr = TrainConfig(loss_type="huber", huber_c=0.1)  # sd-scripts' default schedule
    a = ddpm.alphas_cumprod.double()[t]
    want = (0.9 / (1 + ((1 - a) / a).sqrt()) ** 2 + 0.1).tolist()
    assert huber_threshold(snr, t, ddpm, "ddpm").tolist() == pytest.approx(want, rel=1e-5)
    # flow: sigma is the noise-to-signal ratio s / (1 - s), so 1 / (1 + sigma)^2 = (1 - s)^2
    s = torch.tensor([0.0, 0.25, 0.9])
    flow = huber_threshold(snr, s * 1000, FlowMatchEulerDiscreteScheduler(), "flow")
    assert flow.tolist() == pytest.approx((0.9 * (1 - s) ** 2 + 0.1).tolist(), rel=1e-5)
    assert huber_threshold(TrainConfig(), t, ddpm, "ddpm") is None  # l2: none


@pytest.mark.parametrize("objective", ["ddpm", "flow"])
@pytest.mark.parametrize("kind", ["l2", "huber", "smooth_l1"])
def test_the_objectives_loss_is_the_formula_over_its_own_targets(objective, kind):
    """The training loss (noise and level drawn) equals the per-element formula on the prediction and target the
    objective made, with the schedule's c from the timesteps it drew; l2 is the mean squared error as before."""
    obj = _objective(objective, loss_type=kind, huber_schedule="snr")
    den = torch.nn.Conv2d(4, 4, 1)
    torch.manual_seed(0)
    latents = torch.randn(2, 4, 6, 6)
    seen = {}
    inputs = obj.flow_inputs if objective == "flow" else obj.ddpm_inputs

    def spy(*a):
        seen["out"] = inputs(*a)
        return seen["out"]

    setattr(obj, "flow_inputs" if objective == "flow" else "ddpm_inputs", spy)
    loss = obj.loss(den, {"latents": latents}, per_sample=True)
    noisy, t, target, _ = seen["out"]
    pred = den(noisy)
    err = pred - target
    if kind == "l2":
        want = err.square().mean(dim=(1, 2, 3))
    else:
        if objective == "flow":
            s = t / 1000
            c = 0.9 * (1 - s) ** 2 + 0.1
        else:
            a = DDPMScheduler().alphas_cumprod[t]
            c = 0.9 / (1 + ((1 - a) / a).sqrt()) ** 2 + 0.1
        c = c.view(-1, 1, 1, 1)
        pseudo = (err.square() + c.square()).sqrt() - c
        want = (2 * c * pseudo if kind == "huber" else 2 * pseudo).mean(dim=(1, 2, 3))
    torch.testing.assert_close(loss, want)


def test_the_validation_loss_stays_the_squared_error():
    obj = _objective("flow", loss_type="huber")
    den = torch.nn.Conv2d(4, 4, 1)
    latents, noise = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    q = torch.tensor([0.3, 0.7])
    noisy, _, target, _ = obj.flow_inputs(latents, noise, q)
    got = obj.loss(den, {"latents": latents}, fixed=(noise, q), per_sample=True)
    torch.testing.assert_close(got, (den(noisy) - target).square().mean(dim=(1, 2, 3)))


# ----------------------------------------------------------------- masked loss
def _mask(b: int = 2) -> torch.Tensor:
    m = torch.ones(b, 1, 6, 6)
    m[:, :, :, :3] = 0.0  # the left half is not learned
    m[:, :, 0, 4] = 0.5
    return m


def test_the_masked_loss_is_sd_scripts_weighted_mean():
    """sd-scripts' apply_masked_loss: the loss times the mask, then the mean over every position."""
    obj = _objective("flow")
    den = torch.nn.Conv2d(4, 4, 1)
    latents, noise, q = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6), torch.tensor([0.3, 0.7])
    noisy, _, target, _ = obj.flow_inputs(latents, noise, q)
    mask = _mask()
    got = obj.loss(den, {"latents": latents, "loss_mask": mask}, fixed=(noise, q), per_sample=True)
    torch.testing.assert_close(got, ((den(noisy) - target).square() * mask).mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("objective", ["ddpm", "flow"])
def test_masked_out_pixels_have_no_effect_on_the_gradient(objective):
    """Latent pixels under a zero mask changed (input and target both), the weights' gradients are the same bit for
    bit; the same change where the mask is 1 moves them. (The denoiser here sees each pixel alone: a real denoiser
    also reads masked-out pixels as context for the others, as in sd-scripts; only their loss is gone.)"""
    torch.manual_seed(0)
    den = torch.nn.Conv2d(4, 4, 1)
    latents = torch.randn(2, 4, 6, 6)
    mask = _mask()

    def grads(lat: torch.Tensor) -> list[torch.Tensor]:
        obj = _objective(objective, loss_type="huber")  # the same draws each time (seeded generator)
        den.zero_grad()
        obj.loss(den, {"latents": lat, "loss_mask": mask}).backward()
        return [p.grad.clone() for p in den.parameters()]

    base = grads(latents)
    hidden = latents.clone()
    hidden[:, :, :, :3] += 5 * torch.randn(2, 4, 6, 3)
    for a, b in zip(base, grads(hidden)):
        assert torch.equal(a, b)
    seen = latents.clone()
    seen[:, :, :, 3:] += 5 * torch.randn(2, 4, 6, 3)
    assert not all(torch.equal(a, b) for a, b in zip(base, grads(seen)))


def test_a_mask_for_all_frames_broadcasts_over_a_clips_latent_frames():
    obj = _objective("flow")
    den = torch.nn.Conv3d(4, 4, 1)
    latents, noise, q = torch.randn(1, 4, 3, 6, 6), torch.randn(1, 4, 3, 6, 6), torch.tensor([0.5])
    noisy, _, target, _ = obj.flow_inputs(latents, noise, q)
    mask = _mask(1)[:, :, None]  # [B, 1, 1, h, w]
    got = obj.loss(den, {"latents": latents, "loss_mask": mask}, fixed=(noise, q), per_sample=True)
    torch.testing.assert_close(got, ((den(noisy) - target).square() * mask).mean(dim=(1, 2, 3, 4)))


def test_convert_args_maps_sd_scripts_loss_and_mask_options():
    from difftrain.config.load import resolve
    from difftrain.config.sdscripts import convert

    c = convert(
        ["sdxl_train_network.py", "--network_dim=8", "--loss_type=huber", "--huber_schedule=exponential"]
        + ["--huber_c=0.2", "--huber_scale=1.5", "--alpha_mask", "--masked_loss"]
    )
    t = resolve(extra=c.config).config.train
    assert (t.loss_type, t.huber_schedule, t.huber_c, t.huber_scale) == ("huber", "exponential", 0.2, 1.5)
    assert resolve(extra=c.config).config.data.alpha_mask is True
    assert "data.mask_dir" in dict(c.unmapped)["--masked_loss"]
