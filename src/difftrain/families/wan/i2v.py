"""Wan image to video ("wan-i2v"): Wan2.1 I2V-14B (480P and 720P: one architecture), Wan2.2 I2V-A14B (two
experts, one per run as for T2V-A14B) and Wan2.2 TI2V-5B's image-to-video mode.

Conditioning, as WanImageToVideoPipeline builds it: the clip's first frame followed by F - 1 black frames (pixel
zeros, not zero latents: the VAE maps black to something else) is encoded (the posterior mean) and normalised like
the latents; a mask marks the first latent frame (four channels: one per pixel frame the VAE folds into it). The
transformer takes [noisy latents (16), mask (4), condition latents (16)] on channels: 36. Wan2.1 I2V also reads
CLIP ViT-H/14's penultimate hidden states of the first frame (257 x 1280 tokens) through its image cross-attention;
Wan2.2 I2V has no CLIP. Precompute caches the condition latents and the CLIP states beside each clip's latents
("condition_latents", "image_embeds"); the mask is built from shapes in ``denoise``.

A one-frame item (an image) has nothing to learn here (its condition is its target): precompute refuses it, and
the item is named. The CLIP encoder (and its image processor) loads with the VAE, the part precompute encodes
pixels with, so the latent stage needs nothing else; its weights are part of the latents' cache key (the VAE's
fingerprint covers both).

TI2V-5B conditions in place, as WanImageToVideoPipeline runs it with ``expand_timesteps``: its input is the noisy
latents with the first latent frame replaced by the start frame's clean latents, and every token of that frame
gets timestep 0 (the others the step's). The start frame's latents are the clip's own first latent frame (the
causal VAE encodes the first frame alone: the same as the pipeline's encoding of the image, tested), so nothing
more is cached; the objective keeps that frame clean and leaves it out of the loss (``kept_clean``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig
from ...errors import CacheMismatch, DataError, ModelLoadError
from .. import common
from ..base import CachedItem
from ..common import read_json as _read_json
from .family import PARTS, Wan, _new_module, bundled_config_dir

#: the 2.1 I2V's CLIP: its penultimate layer's tokens (a 16 x 16 grid and the class token) and width
CLIP_TOKENS = 257


def _has_clip(transformer_cfg: dict) -> bool:
    return bool(transformer_cfg.get("image_dim"))


#: TI2V-5B's latent channels (the 2.2 VAE's z_dim; its transformer takes them alone, in_channels 48)
TI2V_CHANNELS = 48


def _ti2v(transformer_cfg) -> bool:
    return int(transformer_cfg.get("in_channels", 16)) == TI2V_CHANNELS


class WanI2V(Wan):
    """Image-to-video Wan (2.1 I2V-14B with CLIP, 2.2 I2V-A14B)."""

    name = "wan-i2v"
    image_conditioned = True
    default_config = "wan2.1-i2v-14b"
    tiny_config = "wan-tiny-i2v"
    parts: ClassVar[tuple[str, ...]] = (*PARTS, "image_encoder")

    def _check_trainable(self, transformer_cfg, where: str) -> None:
        if int(transformer_cfg.get("in_channels", 16)) != 36 and not _ti2v(transformer_cfg):
            raise ModelLoadError(
                f"{where} is a text-to-video Wan (transformer in_channels {transformer_cfg.get('in_channels')}), not "
                "an image-to-video one (36: noisy latents, mask, first-frame latents; or TI2V-5B's 48).",
                hint="Set family: wan for it, or give Wan2.1-I2V-14B / Wan2.2-I2V-A14B / Wan2.2-TI2V-5B.",
            )

    def clip(self, mcfg: ModelConfig) -> bool:
        """The model reads CLIP image states (Wan2.1 I2V)."""
        return _has_clip(self.part_config(mcfg, "transformer"))

    # ------------------------------------------------------------ loading: CLIP with the VAE
    def load(
        self,
        mcfg: ModelConfig,
        parts: Sequence[str],
        dtype: torch.dtype = torch.float32,
        device="cpu",
        precision: dict[str, str] | None = None,
        tokenizers: bool = True,
    ) -> dict[str, Any]:
        """As Wan's; with the VAE, a CLIP model's image encoder and image processor too (what the image
        conditioning is encoded with)."""
        parts = list(parts)
        want_clip = "image_encoder" in parts or ("vae" in parts and self.clip(mcfg))
        comps = super().load(mcfg, [p for p in parts if p != "image_encoder"], dtype, device, precision, tokenizers)
        if want_clip:
            comps.update(self._load_clip(mcfg, dtype, device))
        return comps

    def _load_clip(self, mcfg: ModelConfig, dtype: torch.dtype, device) -> dict[str, Any]:
        from transformers import CLIPImageProcessor, CLIPVisionModel

        kind, p = self._source(mcfg)
        if kind != "diffusers" or not (p / "image_encoder").is_dir():
            raise ModelLoadError(
                f"{p.name} has no CLIP image encoder, which Wan2.1 image-to-video encodes the first frame with.",
                hint="Precompute with the base model's diffusers folder (Wan2.1-I2V-14B-480P-Diffusers: it holds "
                "image_encoder/ and image_processor/), then train with model.path set to this file.",
            )
        try:
            enc = CLIPVisionModel.from_pretrained(p / "image_encoder", torch_dtype=dtype, local_files_only=True)
            proc = CLIPImageProcessor.from_pretrained(p / "image_processor", local_files_only=True)
        except OSError as e:
            raise ModelLoadError(f"Could not load the CLIP image encoder from {p}: {e}") from None
        enc.requires_grad_(False).eval().to(device)
        return {"image_encoder": enc, "image_processor": proc}

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """The VAE's fingerprint covers the CLIP encoder too where there is one: both make the latent entries."""
        own = super().fingerprint(mcfg, part, memo)
        if part != "vae" or not self.clip(mcfg):
            return own
        _, p = self._source(mcfg)
        clip = common.hash_files(self.name, "image_encoder", common.weight_files(p / "image_encoder"), memo)
        from ...utils import sha256_text

        return sha256_text(own, clip)

    # ------------------------------------------------------------ the image conditioning
    def _clip(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """The videos checked as Wan's, and refused when one is a single frame (an image)."""
        video = self._video(vae, pixels)
        if video.shape[2] == 1:
            raise DataError(
                "Wan image-to-video learns the motion that follows a first frame; a one-frame item (an image) has "
                "none to learn.",
                hint="Train image-to-video on clips only (move the images out of data.dir), or use family: wan.",
            )
        return video

    def encode_first_frame(
        self, comps: dict[str, Any], pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Videos [B, 3, F, H, W] -> the condition latents [B, 16, (F - 1) / 4 + 1, h, w]: the first frame and
        F - 1 black frames, encoded (posterior mean) and normalised, as WanImageToVideoPipeline.prepare_latents.
        TI2V-5B: the first frame alone [B, 48, 1, h, w], as that pipeline encodes the image with expand_timesteps."""
        vae = comps["vae"]
        video = self._clip(vae, pixels)
        first = video[:, :, :1]
        if int(vae.config.z_dim) == TI2V_CHANNELS:
            return self.encode_images(comps, first)
        cond = torch.cat([first, first.new_zeros(*first.shape[:2], video.shape[2] - 1, *first.shape[3:])], dim=2)
        return self.encode_images(comps, cond)

    def clip_states(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """The first frames' CLIP penultimate hidden states [B, 257, 1280] (float32), through the model's own image
        processor on the frames as 8-bit RGB (what the pipeline hands it)."""
        enc, proc = comps["image_encoder"], comps["image_processor"]
        first = pixels[:, :, 0] if pixels.ndim == 5 else pixels
        rgb = ((first.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        inputs = proc(images=list(rgb), return_tensors="pt").to(enc.device)
        out = enc(pixel_values=inputs.pixel_values.to(enc.dtype), output_hidden_states=True)
        return out.hidden_states[-2].float()

    def image_condition_entries(
        self, comps: dict[str, Any], pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        if int(comps["vae"].config.z_dim) == TI2V_CHANNELS:
            self._clip(comps["vae"], pixels)  # a one-frame item is refused
            return {}  # TI2V: the clip's own first latent frame is its condition, already in the cache
        out = {"condition_latents": self.encode_first_frame(comps, pixels, generator)}
        if "image_encoder" in comps:
            out["image_embeds"] = self.clip_states(comps, pixels)
        return out

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if latent_entry["latents"].shape[0] == TI2V_CHANNELS:
            return {}  # TI2V conditions in place on the clip's own first frame
        img = latent_entry.get("condition_latents")
        if img is None:
            raise CacheMismatch(
                "The cached latents have no first-frame latents, which image-to-video Wan needs.",
                hint="Run `difftrain precompute` with family: wan-i2v (the cache is per family).",
            )
        out = {"condition_latents": img}
        if "image_embeds" in latent_entry:
            out["image_embeds"] = latent_entry["image_embeds"]
        return out

    def kept_clean(self, latents: torch.Tensor) -> torch.Tensor | None:
        """TI2V's first latent frame: the start frame, clean in the input and not learned."""
        if latents.ndim != 5 or latents.shape[1] != TI2V_CHANNELS:
            return None
        keep = torch.zeros(1, 1, latents.shape[2], 1, 1, dtype=torch.bool, device=latents.device)
        keep[:, :, 0] = True
        return keep

    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction for noisy latents [B, 16, F, h, w]: the transformer reads [noisy, mask, condition]
        on channels (the mask marks the first latent frame, four channels of it) and, for 2.1, the CLIP states.
        TI2V-5B (48 channels): the latents alone (their first frame already the clean start frame), with a
        timestep per token, 0 for the first frame's, as the pipeline's expand_timesteps."""
        if _ti2v(transformer.config):
            b, _, f, h, w = noisy.shape
            _, ph, pw = transformer.config.patch_size
            per_token = torch.ones(f, h // ph, w // pw, device=noisy.device, dtype=timesteps.dtype)
            per_token[0] = 0
            return transformer(
                hidden_states=noisy,
                timestep=timesteps.view(-1, 1) * per_token.flatten().view(1, -1),
                encoder_hidden_states=batch["prompt_embeds"],
                return_dict=False,
            )[0]
        cond = batch.get("condition_latents")
        if cond is None:
            raise CacheMismatch("Image-to-video Wan needs first-frame latents, and the batch has none.")
        b, _, f, h, w = noisy.shape
        scale_t = 4  # pixel frames per latent frame: the mask has a channel for each
        mask = noisy.new_zeros(b, scale_t, f, h, w)
        mask[:, :, 0] = 1
        states = batch.get("image_embeds")
        if _has_clip(transformer.config) and states is None:
            raise CacheMismatch(
                "This Wan2.1 image-to-video transformer reads CLIP image states, and the batch has none.",
                hint="Precompute with the model's diffusers folder (it holds the CLIP encoder).",
            )
        return transformer(
            hidden_states=torch.cat([noisy, mask, cond.to(noisy.dtype)], dim=1),
            timestep=timesteps,
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_hidden_states_image=states if _has_clip(transformer.config) else None,
            return_dict=False,
        )[0]

    # ------------------------------------------------------------ pipeline, shapes, tiny model
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

        self.warn_one_expert(mcfg)
        return WanImageToVideoPipeline(
            tokenizer=comps.get("tokenizer"),
            text_encoder=comps.get("text_encoder"),
            vae=comps["vae"],
            transformer=comps["transformer"],
            scheduler=UniPCMultistepScheduler.from_config(self.scheduler_config(mcfg)),
            image_processor=comps.get("image_processor"),
            image_encoder=comps.get("image_encoder"),
            expand_timesteps=_ti2v(comps["transformer"].config),
        )

    def cache_shapes(self, config_name: str, resolution=(480, 832), frames: int = 81):
        shapes = super().cache_shapes(config_name, resolution, frames)
        cfgdir = self.config_dir(config_name)
        if _ti2v(_read_json(cfgdir / "transformer" / "config.json")):
            return shapes  # conditions on its own first latent frame: nothing more cached
        shapes["latent"]["condition_latents"] = shapes["latent"]["latents"]
        if _has_clip(_read_json(cfgdir / "transformer" / "config.json")):
            width = _read_json(cfgdir / "image_encoder" / "config.json")["hidden_size"]
            shapes["latent"]["image_embeds"] = (CLIP_TOKENS, width)
        return shapes

    def build_tiny(self, folder: Path, seed: int = 0, config: str | None = None) -> Path:
        """A tiny seeded image-to-video Wan: "wan-tiny-i2v" (2.1, with a tiny CLIP), "wan-tiny-i2v-a14b" (2.2: two
        experts, no CLIP) or "wan-tiny-ti2v" (TI2V-5B's layout), saved as WanImageToVideoPipeline saves it."""
        import shutil

        import transformers
        from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        from ..tokenizers import tiny_t5_tokenizer

        folder = Path(folder)
        cfgdir = bundled_config_dir(config or self.tiny_config)
        torch.manual_seed(seed)
        comps: dict[str, Any] = {part: _new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS}
        if (cfgdir / "transformer_2").is_dir():
            comps["transformer_2"] = _new_module("transformer", _read_json(cfgdir / "transformer_2" / "config.json"))
            comps["boundary_ratio"] = _read_json(cfgdir / "model_index.json")["boundary_ratio"]
        if _read_json(cfgdir / "model_index.json").get("expand_timesteps"):  # TI2V-5B's
            comps["expand_timesteps"] = True
        if (cfgdir / "image_encoder").is_dir():
            cfg = _read_json(cfgdir / "image_encoder" / "config.json")
            comps["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(**common.hf_config(cfg)))
            comps["image_processor"] = CLIPImageProcessor(
                **_read_json(cfgdir / "image_processor" / "preprocessor_config.json")
            )
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            comps["tokenizer"] = transformers.T5TokenizerFast.from_pretrained(tiny_t5_tokenizer(tokdir))  # type: ignore[attr-defined]
            sched = UniPCMultistepScheduler.from_config(_read_json(cfgdir / "scheduler" / "scheduler_config.json"))
            WanImageToVideoPipeline(scheduler=sched, **comps).save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]
        finally:
            shutil.rmtree(tokdir, ignore_errors=True)
        return folder

    def single_file_parts(self, trained: Sequence[str]) -> tuple[str, ...]:
        return ("transformer",)
