"""Training objectives: what the denoiser is asked to predict, from which noisy inputs, with which weight.

``ddpm``: epsilon or v-prediction on the family's DDPM scheduler (SDXL, CogVideoX), with optional Min-SNR
weighting. ``flow``: rectified flow (SD3): x_s = (1 - s) x0 + s noise, target noise - x0, with SD3's sigma
sampling, shift and loss weightings. Everything random is drawn through :class:`Draws`, from the trainer's
seeded generator, so a resumed run draws what an uninterrupted one would.

The loss per latent element is ``train.loss_type``'s (sd-scripts' conditional_loss: l2, l1, pseudo-Huber with a
threshold per sample from its noise level), times the batch's ``loss_mask`` where the config trains with masks
(sd-scripts' apply_masked_loss: the mask at latent resolution, then the mean over every position).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..config.schema import Config, FlowConfig, TrainConfig
from ..families.base import ModelFamily


def snr(alphas_cumprod: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a = alphas_cumprod.to(t.device)[t].float()
    return a / (1 - a)


def sample_sigmas(
    flow: FlowConfig, n: int, shift: float, gen: torch.Generator, device, band: tuple[float, float] = (0.0, 1.0)
) -> torch.Tensor:
    """Noise levels in (0, 1) drawn as diffusers' SD3 scripts and sd-scripts do, then shifted.

    logit_normal: sigmoid of N(mean, std); mode: 1 - u - scale (cos^2(pi u / 2) - 1 + u)
    (Esser et al. 2024, eq. 20); uniform: u. Shift: s' = shift s / (1 + (shift - 1) s).

    ``band`` (lo, hi) keeps the shifted levels inside [lo, hi] with the distribution's shape there (a two-expert
    model's expert, flow.min_timestep / max_timestep): each method maps a uniform p through a monotone function, so
    p is drawn uniformly from the interval of p whose level falls in the band. Without a band the draws are those
    of the plain methods above, unchanged.
    """
    if band[0] <= 0 and band[1] >= 1:
        if flow.timestep_sampling == "logit_normal":
            u = torch.sigmoid(flow.logit_mean + flow.logit_std * torch.randn(n, generator=gen, device=device))
        else:
            u = torch.rand(n, generator=gen, device=device)
            if flow.timestep_sampling == "mode":
                u = 1 - u - flow.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    else:
        lo, hi = _band_p(flow.timestep_sampling, flow.logit_mean, flow.logit_std, flow.mode_scale, shift, *band)
        p = torch.rand(n, generator=gen, device=device, dtype=torch.float64)
        u = _quantile(flow, lo + (hi - lo) * p).float()
    u = u.clamp(1e-5, 1 - 1e-5)
    return shift * u / (1 + (shift - 1) * u)


def unshift(s: float, shift: float) -> float:
    """The level before the shift that the shift maps to ``s``."""
    return s / (shift - (shift - 1) * s)


def _quantile(flow: FlowConfig, p):
    """The sampling method's level for a uniform p (a float64 tensor or float): monotone in p."""
    p = torch.as_tensor(p, dtype=torch.float64)
    if flow.timestep_sampling == "logit_normal":
        z = math.sqrt(2) * torch.erfinv((2 * p - 1).clamp(-1 + 1e-15, 1 - 1e-15))
        return torch.sigmoid(flow.logit_mean + flow.logit_std * z)
    if flow.timestep_sampling == "mode":
        return 1 - p - flow.mode_scale * (torch.cos(math.pi * p / 2) ** 2 - 1 + p)
    return p


@functools.lru_cache(maxsize=256)
def _band_p(sampling: str, mean: float, std: float, scale: float, shift: float, lo: float, hi: float):
    """The interval of uniform p whose shifted level falls in [lo, hi]: two bisections, kept (a run asks the same
    every step; Flux's dynamic shift, once per bucket size)."""
    flow = FlowConfig(timestep_sampling=sampling, logit_mean=mean, logit_std=std, mode_scale=scale)  # type: ignore[arg-type]
    ends = [_inverse(lambda p: _quantile(flow, p), unshift(x, shift)) for x in (lo, hi)]
    return min(ends), max(ends)


def _inverse(f, y: float) -> float:
    """The p in [0, 1] with f(p) = y for a monotone f (bisection; the nearest end when y is outside f's range)."""
    lo, hi = 0.0, 1.0
    rising = float(f(1.0)) >= float(f(0.0))
    for _ in range(60):
        mid = (lo + hi) / 2
        if (float(f(mid)) < y) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def dynamic_shift(sched_config: Any, image_tokens: int) -> float:
    """The shift of a scheduler with ``use_dynamic_shifting`` (Flux.1 [dev]) for an image of ``image_tokens`` 2x2
    patches: mu linear from base_shift at base_image_seq_len tokens to max_shift at max_image_seq_len, shift = e^mu
    (the pipelines' calculate_shift and time_shift with sigma 1, which is s' = e^mu s / (1 + (e^mu - 1) s))."""
    c = sched_config
    lo, hi = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    b0, b1 = c.get("base_shift", 0.5), c.get("max_shift", 1.15)
    mu = b0 + (b1 - b0) * (image_tokens - lo) / (hi - lo)
    return math.exp(mu)


def flow_loss_weight(kind: str, sigmas: torch.Tensor) -> torch.Tensor | None:
    """SD3's loss weightings (diffusers' compute_loss_weighting_for_sd3)."""
    if kind == "sigma_sqrt":
        return sigmas.float() ** -2.0
    if kind == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas**2
        return 2 / (math.pi * bot)
    return None


def huber_threshold(train: TrainConfig, timesteps: torch.Tensor, scheduler: Any, objective: str) -> torch.Tensor | None:
    """The pseudo-Huber threshold c of each sample for ``train.loss_type`` huber / smooth_l1 (None for the others),
    from its timestep: sd-scripts' get_huber_threshold_if_needed. ``timesteps`` are the denoiser's: integer steps
    (ddpm) or sigma x 1000 (flow, as sd-scripts' Flux and SD3 scripts pass them). Its snr schedule needs the DDPM
    scheduler's alphas_cumprod, and sd-scripts refuses it for flow models; here a flow model's sigma is its
    noise-to-signal ratio s / (1 - s), what sqrt((1 - alpha_bar) / alpha_bar) is for DDPM."""
    if train.loss_type not in ("huber", "smooth_l1"):
        return None
    c, scale, t = train.huber_c, train.huber_scale, timesteps.float()
    if train.huber_schedule == "constant":
        return torch.full_like(t, c * scale)
    if train.huber_schedule == "exponential":
        try:  # DDPM's and the flow schedulers' step count (1000 where a scheduler has none)
            n = int(scheduler.config.num_train_timesteps)
        except AttributeError:
            n = 1000
        return torch.exp(math.log(c) / n * t) * scale  # exp(-alpha t), alpha = -ln(c) / T
    if objective == "flow":
        s = (t / 1000).clamp(max=1 - 1e-6)
        sigmas = s / (1 - s)
    else:
        a = scheduler.alphas_cumprod.to(timesteps.device)[timesteps.long()].float()
        sigmas = ((1 - a) / a) ** 0.5
    return (1 - c) / (1 + sigmas) ** 2 + c


def elementwise_loss(pred: torch.Tensor, target: torch.Tensor, loss_type: str, c: torch.Tensor | None) -> torch.Tensor:
    """The loss of each element (no reduction): sd-scripts' conditional_loss. ``c``: one threshold per sample."""
    if loss_type == "l2":
        return F.mse_loss(pred, target, reduction="none")
    if loss_type == "l1":
        return F.l1_loss(pred, target, reduction="none")
    assert c is not None  # huber_threshold gives one for huber and smooth_l1
    c = c.view(-1, *([1] * (pred.ndim - 1)))
    pseudo = torch.sqrt((pred - target) ** 2 + c**2) - c
    return 2 * c * pseudo if loss_type == "huber" else 2 * pseudo


class Draws:
    """Random draws of a micro-batch from the training generator. On several processes the whole global batch is
    drawn on each (same generator, same seed) and this process's slice kept, so N processes see exactly the draws
    one process would; ``share`` (set by the loop per micro-batch) is that slice and the global batch's size."""

    def __init__(self, gen: torch.Generator, device: torch.device) -> None:
        self.gen, self.device = gen, device
        self.share: tuple[slice, int] | None = None

    def __call__(self, draw: Callable[[int], torch.Tensor], n_local: int) -> torch.Tensor:
        if self.share is None:
            return draw(n_local)
        sl, n = self.share
        return draw(n)[sl]

    def randn(self, shape: tuple[int, ...], n_local: int) -> torch.Tensor:
        """N(0, 1) of ``(n_local, *shape)``."""
        return self(lambda n: torch.randn((n, *shape), generator=self.gen, device=self.device), n_local)


class Objective:
    """The loss of a micro-batch for one family's objective: noise, noise level, noisy input, target, weight."""

    def __init__(
        self,
        cfg: Config,
        family: ModelFamily,
        scheduler: Any,
        draws: Draws,
        compute_dtype: torch.dtype,
        amp_dtype: torch.dtype | None,
    ) -> None:
        self.cfg, self.family, self.scheduler, self.draws = cfg, family, scheduler, draws
        self.compute_dtype, self.amp_dtype = compute_dtype, amp_dtype
        self.device = draws.device
        if family.objective == "flow":
            self.flow_shift = cfg.flow.shift or float(scheduler.config.get("shift", 1.0))
            #: the shift follows each batch's image size (Flux.1 [dev]'s scheduler), unless flow.shift fixes it
            self.dynamic = not cfg.flow.shift and bool(scheduler.config.get("use_dynamic_shifting", False))
            family.guidance_scale = cfg.flow.guidance_scale
            #: the shifted levels drawn (timesteps / 1000): flow.min_timestep / max_timestep, else the model's range
            #: (a two-expert model's expert), else all of (0, 1)
            own = family.timestep_range(cfg.model) or (0.0, 1.0)
            lo, hi = cfg.flow.min_timestep, cfg.flow.max_timestep
            self.band = (own[0] if lo is None else lo / 1000, own[1] if hi is None else hi / 1000)

    def loss(
        self,
        denoiser: Any,
        batch: dict[str, torch.Tensor],
        fixed: tuple[torch.Tensor, torch.Tensor] | None = None,
        per_sample: bool = False,
    ) -> torch.Tensor:
        """The training loss of a micro-batch. ``fixed = (noise, q)`` gives the noise and the noise level as
        a quantile q in (0, 1) instead of drawing them, and drops what only training adds (noise offset,
        image dropout, loss weighting): the validation loss, comparable across trials."""
        latents = batch["latents"]
        # masked loss: a weight per latent pixel (precompute's area-downsampled mask), read here, never by the denoiser
        mask = batch.get("loss_mask")
        batch = {k: v for k, v in batch.items() if k != "loss_mask"}
        b = latents.shape[0]
        if fixed is not None:
            noise = fixed[0]
        else:
            noise = self.draws.randn(tuple(latents.shape[1:]), b)
            if self.cfg.train.noise_offset:
                shape = (latents.shape[1],) + (1,) * (latents.ndim - 2)
                noise = noise + self.cfg.train.noise_offset * self.draws.randn(shape, b)
            batch = self.family.drop_image_conditioning(batch, self.draws.gen)  # image-to-video only
        q = fixed[1] if fixed is not None else None
        inputs = self.flow_inputs if self.family.objective == "flow" else self.ddpm_inputs
        noisy, timesteps, target, weight = inputs(latents, noise, q)
        keep = self.family.kept_clean(latents)  # conditioning in place (TI2V's first frame): clean, not learned
        if keep is not None:
            noisy = torch.where(keep, latents, noisy)
        if fixed is not None:
            weight = None
        amp = self.amp_dtype
        with torch.autocast(self.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            cond = {
                k: (
                    v.to(self.compute_dtype)
                    if v.is_floating_point() and k not in self.family.full_precision_inputs
                    else v
                )
                for k, v in batch.items()
            }
            pred = self.family.denoise(denoiser, noisy.to(self.compute_dtype), timesteps, cond)
        # the validation loss (fixed) stays the squared error whatever train.loss_type: comparable across trials
        loss_type = "l2" if fixed is not None else self.cfg.train.loss_type
        c = huber_threshold(self.cfg.train, timesteps, self.scheduler, self.family.objective)
        err = elementwise_loss(pred.float(), target.float(), loss_type, c)
        if mask is not None:  # as sd-scripts' apply_masked_loss: weighted, then the mean over every position
            err = err * mask.to(err.dtype)
        dims = list(range(1, pred.ndim))
        if keep is None:
            loss = err.mean(dim=dims)
        else:  # the mean over the positions learned
            learn = (~keep).expand_as(err).to(err.dtype)
            loss = (err * learn).sum(dim=dims) / learn.sum(dim=dims).clamp_min(1)
        if weight is not None:
            loss = loss * weight
        return loss if per_sample else loss.mean()

    def ddpm_inputs(self, latents: torch.Tensor, noise: torch.Tensor, q: torch.Tensor | None = None):
        """Epsilon or v-prediction from the scheduler config, with optional Min-SNR weighting."""
        t, sched = self.cfg.train, self.scheduler
        n = sched.config.num_train_timesteps
        if q is None:
            gen, dev = self.draws.gen, self.device
            timesteps = self.draws(lambda k: torch.randint(0, n, (k,), generator=gen, device=dev), latents.shape[0])
        else:
            timesteps = (q * n).long().clamp(0, n - 1)
        noisy = sched.add_noise(latents, noise, timesteps)
        pred_type = sched.config.prediction_type
        target = noise if pred_type == "epsilon" else sched.get_velocity(latents, noise, timesteps)
        weight = None
        if t.min_snr_gamma:
            # Min-SNR weighting (Hang et al. 2023): min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v
            s = snr(sched.alphas_cumprod, timesteps)
            weight = torch.clamp(s, max=t.min_snr_gamma) / (s + 1 if pred_type == "v_prediction" else s)
        return noisy, timesteps, target, weight

    def flow_inputs(self, latents: torch.Tensor, noise: torch.Tensor, q: torch.Tensor | None = None):
        """Rectified flow: x_s = (1 - s) x0 + s noise, target noise - x0 (SD3, Flux). A given quantile q is shifted
        as the scheduler shifts its sigmas (by the image's token count where the scheduler shifts dynamically: its latent
        pixels over the family's latent_patch squared)."""
        shift = self.flow_shift
        if self.dynamic:
            tokens = latents.shape[-2] * latents.shape[-1] // self.family.latent_patch**2
            shift = dynamic_shift(self.scheduler.config, tokens)
        band = self.band
        if q is None:
            gen, dev = self.draws.gen, self.device
            sigmas = self.draws(lambda k: sample_sigmas(self.cfg.flow, k, shift, gen, dev, band), latents.shape[0])
        else:
            if band != (0.0, 1.0):  # the quantile spread over the band's levels before the shift
                lo, hi = unshift(band[0], shift), unshift(band[1], shift)
                q = lo + (hi - lo) * q
            sigmas = shift * q / (1 + (shift - 1) * q)
        s = sigmas.reshape(-1, *([1] * (latents.ndim - 1)))
        noisy = (1 - s) * latents + s * noise
        return noisy, sigmas * 1000, noise - latents, flow_loss_weight(self.cfg.flow.loss_weighting, sigmas)
