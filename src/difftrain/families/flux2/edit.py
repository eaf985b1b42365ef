"""FLUX.2 with reference images ("flux2-edit"): the same checkpoints (klein 4B / 9B, [dev]) trained to edit or to
follow references, as Flux2KleinPipeline / Flux2Pipeline run them with ``image=``: each reference's latents (the VAE's
posterior mean cut into 2x2 patches and normalised by its batch-norm statistics, as the target's) packed after the
noisy target's tokens, with position ids (t, row, column, 0) whose time axis numbers the references 10, 20, ...
(the pipelines' _prepare_image_ids); the prediction is the target's tokens alone, so the loss is on the target. The
caption is encoded as FLUX.2 encodes any prompt (the pipelines' text encoding takes no image).

Training resizes each reference to its target's bucket (musubi-tuner's default; the pipeline at inference caps a
reference at about 1024 x 1024 keeping its aspect: a reference's positions are its own grid either way). Precompute
caches the references' latents beside the target's ("reference_latents", ``image_condition_entries``). The pairs (a
target, its references, the caption) come from data.control_dir or a pairs file, as for Qwen-Image-Edit.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CacheMismatch
from ..base import CachedItem
from ..llm_image import cached_references, check_2x2, encoded_references
from .family import Flux2, patchify, unpatchify


class Flux2Edit(Flux2):
    name = "flux2-edit"
    image_conditioned: ClassVar[bool] = True  # the references' latents are cached beside the target's
    references: ClassVar[bool] = True
    tiny_recipe = "tiny-flux2-edit-lora"

    def encode_prompts_with_images(
        self,
        comps: dict[str, Any],
        captions: list[str],
        images: list[list[Any]],
        stage: str,
        options: TextEncodersConfig,
        mcfg: ModelConfig,
    ) -> dict[str, Any]:
        """The caption as FLUX.2 encodes any prompt: its pipelines' text encoding takes no image."""
        return self.encode_prompts(comps, captions, stage, options)

    def image_condition_entries(
        self,
        comps: dict[str, Any],
        pixels: torch.Tensor,
        generator: torch.Generator | None = None,
        references: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """references [B, N, 3, H, W] in [-1, 1] (each fitted to its target's bucket) -> "reference_latents" [B, N,
        32, H/8, W/8], normalised as the target's latents (the pipelines' _encode_vae_image)."""
        return encoded_references(references, lambda x: self.encode_images(comps, x), "FLUX.2 edit training needs")

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return cached_references(
            latent_entry,
            "FLUX.2 edit training",
            "Run `difftrain precompute` with family: flux2-edit and data.control_dir (the cache is per family).",
        )

    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction for noisy latents [B, 32, h, w]: the target's packed patches, then each reference's
        (batch["reference_latents"] [B, N, 32, h', w']), the target's position ids then the references' (time axis 10,
        20, ...), as the pipelines call the transformer with ``image=``; the target's tokens of the output, unpacked."""
        from diffusers import Flux2Pipeline

        refs = batch.get("reference_latents")
        if refs is None:
            raise CacheMismatch("FLUX.2 edit training needs reference latents, and the batch has none.")
        b, _, h, w = noisy.shape
        check_2x2("FLUX.2", h, w)
        check_2x2("FLUX.2", *refs.shape[-2:])
        x = patchify(noisy)
        target = Flux2Pipeline._pack_latents(x)
        patched = [patchify(refs[:, i].to(noisy.dtype)) for i in range(refs.shape[1])]
        ref_ids = Flux2Pipeline._prepare_image_ids([r[:1] for r in patched]).to(noisy.device)
        text = batch["prompt_embeds"]
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=noisy.device, dtype=torch.float32)
        out = transformer(
            hidden_states=torch.cat([target] + [Flux2Pipeline._pack_latents(r) for r in patched], dim=1),
            timestep=(timesteps / 1000).to(noisy.dtype),
            guidance=guidance,
            encoder_hidden_states=text,
            txt_ids=Flux2Pipeline._prepare_text_ids(text).to(noisy.device),
            img_ids=torch.cat([Flux2Pipeline._prepare_latent_ids(x).to(noisy.device), ref_ids.expand(b, -1, -1)], 1),
            return_dict=False,
        )[0]
        return unpatchify(out[:, : target.shape[1]].transpose(1, 2).reshape(x.shape))

    def validation_image(self, images: list[Any], side: int, mcfg: ModelConfig) -> Any:
        """A validation prompt's references as the pipelines take them: the list, as read (they resize them)."""
        return list(images)

    def cache_shapes(self, config_name: str, resolution: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """As FLUX.2's, with one reference's latents at the target's size."""
        shapes = super().cache_shapes(config_name, resolution)
        shapes["latent"]["reference_latents"] = (1, *shapes["latent"]["latents"])
        return shapes
