"""Image-to-video CogVideoX: the text-to-video family with the first frame's latents as conditioning."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import CacheMismatch
from ..base import CachedItem
from .family import DEFAULT_I2V_CONFIG, IMAGE_DROPOUT, IMAGE_NOISE_MEAN, IMAGE_NOISE_STD, CogVideoX
from .positions import latent_frames


class CogVideoXI2V(CogVideoX):
    """Image-to-video CogVideoX (5b-I2V, 1.5-5b-I2V): the first frame's latents condition every step.

    Precompute stores ``encode_first_frame``'s first latent frame in each latent entry as
    "image_latents" (``image_condition_entries``); ``conditioning`` hands it to ``denoise``, which concatenates
    it to the noisy latents on channels, as CogVideoXImageToVideoPipeline does.
    """

    name = "cogvideox-i2v"
    image_conditioned = True
    default_config = DEFAULT_I2V_CONFIG
    tiny_config = "cogvideox-tiny-i2v"

    def encode_first_frame(
        self, comps: dict[str, Any], pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The image conditioning of videos [B, 3, F, H, W]: [B, 16, (F - 1) / 4 + 1, H / 8, W / 8] (float32).

        As diffusers' CogVideoX image-to-video training does: the first frame is
        noise-augmented (pixels + N(0, 1) * sigma, sigma = exp(N(-3, 0.5)) per
        sample), encoded, a posterior sample taken and scaled, and zero frames
        appended up to the video's latent frame count. The scale follows the
        image-to-video pipeline: x scaling_factor, or / scaling_factor for a VAE
        with ``invert_scale_latents`` (CogVideoX 1.5). ``generator`` (a CPU one)
        makes the augmentation reproducible, so a cache entry is a function of its
        inputs and the seed.
        """
        vae = comps["vae"]
        video = self._video(pixels)
        first = video[:, :, :1].float().cpu()
        b = first.shape[0]
        sigma = torch.exp(torch.normal(IMAGE_NOISE_MEAN, IMAGE_NOISE_STD, size=(b,), generator=generator))
        noisy = first + torch.randn(first.shape, generator=generator) * sigma.view(b, 1, 1, 1, 1)
        dist = vae.encode(noisy.to(vae.device, vae.dtype)).latent_dist
        eps = torch.randn(dist.mean.shape, generator=generator).to(dist.mean.device, dist.mean.dtype)
        latents = (dist.mean + dist.std * eps).float()  # DiagonalGaussianDistribution.sample with this generator
        sf = vae.config.scaling_factor
        latents = latents / sf if getattr(vae.config, "invert_scale_latents", False) else latents * sf
        pad = latent_frames(video.shape[2]) - 1
        return torch.cat([latents, latents.new_zeros(b, latents.shape[1], pad, *latents.shape[3:])], dim=2)

    def image_condition_entries(
        self, comps: dict[str, Any], pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """The noise-augmented first frame's latents (``encode_first_frame``); only its first latent frame is stored
        (the rest are zeros, added back at training time by ``conditioning``)."""
        return {"image_latents": self.encode_first_frame(comps, pixels, generator=generator)[:, :, :1]}

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"image_latents": [16, F, h, w]} from the latent entry (a one-frame entry is zero-padded to the video's frames)."""
        img = latent_entry.get("image_latents")
        if img is None:
            raise CacheMismatch(
                "The cached latents have no image latents, which image-to-video CogVideoX needs.",
                hint="Run `difftrain precompute` with family: cogvideox-i2v (the cache is per family).",
            )
        frames = latent_entry["latents"].shape[1]
        if img.shape[1] < frames:
            img = torch.cat([img, img.new_zeros(img.shape[0], frames - img.shape[1], *img.shape[2:])], dim=1)
        return {"image_latents": img}

    def drop_image_conditioning(
        self, batch: dict[str, torch.Tensor], generator: torch.Generator, p: float = IMAGE_DROPOUT
    ) -> dict[str, torch.Tensor]:
        """A copy of ``batch`` whose image latents are zeroed per sample with probability ``p``.

        diffusers' I2V script zeroes the whole batch's with probability 0.05
        (``--noised_image_dropout``); per sample is the same at batch size 1. Draws
        one number per sample from ``generator`` (the trainer's, so resume is exact).
        """
        img = batch["image_latents"]
        keep = torch.rand(img.shape[0], generator=generator, device=generator.device) >= p
        return {**batch, "image_latents": img * keep.to(img.device, img.dtype).view(-1, *([1] * (img.ndim - 1)))}
