"""Qwen-Image 2.1 with reference images ("qwen-image-2.1-edit"): the same checkpoint as "qwen-image-2.1" (one model
does text-to-image and image-conditioned generation) trained as QwenImage21Pipeline runs it with ``image=``. The same
bundled configs (qwen-image-2.1, qwen-image-2.1-tiny), with Qwen3-VL's image processor (``processor/``).

As the pipeline runs it:

- the instruction is encoded by Qwen3-VL WITH the reference images: the image-conditioned template
  (``prompt_template_ti2i``: one ``<imageN><|vision_start|><|image_pad|><|vision_end|>`` slot per reference, before the
  instruction), Qwen2-VL's image processor at patch 16 / merge 2 (one vision token per 32x32 pixels: 2x2 latent
  tokens), the system prompt dropped; ``_get_qwen_prompt_embeds`` returns the rows and ``image_pad_mask``, True at the
  vision tokens. Precompute runs it and caches both per instruction (unpadded rows; the mask as 0/1);
- each reference's latents (RGBA: an opaque alpha, the VAE's posterior mean, normalised: ``_encode_vae_image``) are
  packed as the target's (one token per latent pixel) and put BEFORE the noisy target's tokens; ``img_shapes`` lists
  each reference's grid then the target's; ``img_mask`` is the cached ``image_pad_mask`` followed by one True slot per
  2x2 target tokens. The transformer writes the latents into the vision tokens' places (each slot widened to four
  tokens), so the references' vision-token rows of the encoder are never read, but the instruction's rows after them
  were encoded having seen them; the prediction is the last (target) tokens, so the loss is on the target alone;
- ``causal_condition`` (the checkpoint's config): the text and reference tokens are modulated at t = 0 and, the
  attention being block-causal, never see the target: the pipeline caches their keys and values after its first step.
  Training runs the whole sequence every step without the cache (what the pipeline's first step computes; its later
  steps give the same up to rounding).

A reference must fill exactly its vision slots: the transformer checks that the slots the encoder made number the
latent tokens / 4. The pipeline hands the same resized image to both; training fits each reference to its target's
bucket (cropped as the target, as the other edit families' latents) and encodes the instruction with the references
so fitted, so its text entry is keyed by the bucket too (``text_references_fitted``; with data.random_crop, by the
target). Qwen3-VL's image processor would resize an image below its minimum pixels (65 536 for Qwen3-VL: 256 x 256),
which is refused at precompute. A reference's size is not only its own grid: each image block moves the rotary frame
position of what follows by max(h, w) latent tokens (QwenImage21Rope), so the target's position depends on it; the
pipeline resizes references to about output_resolution^2 pixels (1024^2 by default), which training at
data.resolution 1024 matches, and a smaller bucket does not exactly.

The pairs (a target, its references, the instruction) come from data.control_dir or a pairs file (data/pairs.py).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CacheMismatch, ConfigError, DataError
from ..base import CachedItem
from ..common import read_json as _read_json
from ..llm_image import cached_references, encoded_references
from .edit import image_processor
from .v21 import QwenImage21, check_sides, pack, text_processor, unpack, vae_latents

#: pixels per vision token of Qwen3-VL at patch 16, merge 2: one image slot, 2x2 latent tokens of the 16x VAE
SLOT_PIXELS = 32
#: the caption's rows in bench's synthetic cache (cache_shapes' default, as the other language-model families')
SYNTHETIC_CAPTION_TOKENS = 128


class QwenImage21Edit(QwenImage21):
    """Qwen-Image 2.1 trained with reference images (see the module's doc)."""

    name = "qwen-image-2.1-edit"
    image_conditioned: ClassVar[bool] = True  # the references' latents are cached beside the target's
    references: ClassVar[bool] = True
    #: the instruction is encoded with the references as fitted to the target's bucket (see the module's doc)
    text_references_fitted: ClassVar[bool] = True
    tiny_recipe = "tiny-qwen-image-2.1-edit-lora"

    # ------------------------------------------------------------ loading: the processor with the text encoder
    def processor_config(self, mcfg: ModelConfig) -> dict:
        """Qwen3-VL's image processor settings: a diffusers folder's processor/preprocessor_config.json, or the
        "image_processor" of its processor_config.json (where transformers 5 saves a processor's parts), else the
        bundled architecture's."""
        p = self._folder(mcfg)
        if p is not None:
            own, joint = p / "processor" / "preprocessor_config.json", p / "processor" / "processor_config.json"
            if own.is_file():
                return _read_json(own)
            if joint.is_file() and isinstance(cfg := _read_json(joint).get("image_processor"), dict):
                return cfg
        return _read_json(self.bundled(self.architecture(mcfg)) / "processor" / "preprocessor_config.json")

    def new_processor(self, tokenizer, mcfg: ModelConfig) -> Any:
        """As Qwen-Image 2.1's, with Qwen3-VL's image processor (what hands the encoder the references)."""
        proc = image_processor(self.processor_config(mcfg))
        return text_processor(tokenizer, getattr(tokenizer, "difftrain_chat_template", None), proc)

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """The text encoder's covers the image processor's settings too (they decide its output here)."""
        own = super().fingerprint(mcfg, part, memo)
        if part != "text_encoder":
            return own
        from ...utils import sha256_text

        return sha256_text(own, json.dumps(self.processor_config(mcfg), sort_keys=True))

    # ------------------------------------------------------------ encoding
    def encode_prompts_with_images(
        self,
        comps: dict[str, Any],
        captions: list[str],
        images: list[list[Any]],
        stage: str,
        options: TextEncodersConfig,
        mcfg: ModelConfig,
    ) -> dict[str, Any]:
        """qwen3vl -> per instruction prompt_embeds [L_i, 4096] (float32) and image_pad_mask [L_i] (1 at the vision
        tokens): QwenImage21Pipeline._get_qwen_prompt_embeds on the instruction with its references (PIL images
        fitted to the target's bucket by precompute), one instruction at a time (the pipeline takes one set of
        images for all its prompts)."""
        if stage != "qwen3vl":
            raise ConfigError(f"Qwen-Image 2.1 has no text stage {stage!r}.", hint="Its one stage is qwen3vl.")
        pipe = self._text_pipeline(comps)
        device = comps["text_encoder"].device
        embeds_out, masks_out = [], []
        for caption, refs in zip(captions, images):
            for img in refs:  # whole slots: Qwen3-VL's processor would round another side to them
                if img.width % SLOT_PIXELS or img.height % SLOT_PIXELS:
                    raise ConfigError(
                        f"A Qwen-Image 2.1 reference of {img.width}x{img.height} does not fill whole image slots "
                        f"(each stands for {SLOT_PIXELS}x{SLOT_PIXELS} pixels).",
                        hint="Use buckets whose sides are multiples of 32 pixels (data.bucket_step: 32 or 64 does).",
                    )
            embeds, mask, pad = pipe._get_qwen_prompt_embeds([caption], image=list(refs), device=device)
            slots = sum((img.height // SLOT_PIXELS) * (img.width // SLOT_PIXELS) for img in refs)
            if int(pad[0].sum()) != slots:
                sizes = ", ".join(f"{img.width}x{img.height}" for img in refs)
                raise ConfigError(
                    f"Qwen3-VL's image processor made {int(pad[0].sum())} vision tokens of references of {sizes}, "
                    f"whose latents fill {slots} image slots: it resized them (its size limits).",
                    hint="Use buckets of at least its minimum pixels (processor/preprocessor_config.json's "
                    "size.shortest_edge: 256x256 for Qwen3-VL), e.g. data.resolution: 512 or more.",
                )
            keep = mask[0].bool()
            embeds_out.append(embeds[0][keep].float())
            masks_out.append(pad[0][keep])
        return {"prompt_embeds": embeds_out, "image_pad_mask": masks_out}

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, Any]:
        raise DataError(
            "Qwen-Image 2.1 edit training encodes each instruction with its reference images; a caption alone has "
            "no encoding here.",
            hint="Give the references: data.control_dir (a folder beside data.dir with the same file names) or "
            "data.pairs (a JSONL file of image, control and caption); or train family: qwen-image-2.1.",
        )

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        """Not text-to-image's: the template and the vision tokens differ (the cache is keyed by content)."""
        return f"qwen3vl:{options.llm.precision}:prenorm:qwen-image-2.1-ti2i-template" if stage == "qwen3vl" else ""

    def collate_text(
        self, stage: str, entries: list[dict[str, torch.Tensor]], pin: bool = False
    ) -> dict[str, torch.Tensor]:
        """As the other language-model families' (rows padded with zeros, lengths kept), the image_pad_mask padded
        with False alike (a small bool tensor: not pinned)."""
        out = super().collate_text(stage, entries, pin)
        masks = [e["image_pad_mask"].bool() for e in entries]
        padded = torch.zeros(len(masks), out["prompt_embeds"].shape[1], dtype=torch.bool)
        for i, m in enumerate(masks):
            padded[i, : m.shape[0]] = m
        out["image_pad_mask"] = padded
        return out

    def image_condition_entries(
        self,
        comps: dict[str, Any],
        pixels: torch.Tensor,
        generator: torch.Generator | None = None,
        references: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """references [B, N, 3, H, W] in [-1, 1] (each fitted to its target's bucket) -> "reference_latents" [B, N,
        64, H/16, W/16]: an opaque alpha channel, the VAE's posterior mean, normalised (the pipeline's
        _encode_vae_image of its RGBA condition image, argmax)."""
        return encoded_references(
            references, lambda x: vae_latents(comps["vae"], x), "Qwen-Image 2.1 edit training needs"
        )

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return cached_references(
            latent_entry,
            "Qwen-Image 2.1 edit training",
            "Run `difftrain precompute` with family: qwen-image-2.1-edit and data.control_dir (the cache is per "
            "family).",
        )

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction for noisy latents [B, 64, h, w] as QwenImage21Pipeline calls the transformer with
        ``image=``: each reference's packed latents (batch["reference_latents"] [B, N, 64, h', w']) then the noisy
        target's, the instruction's rows unpadded, ``img_mask`` its image_pad_mask then one slot per 2x2 target
        tokens, ``img_shapes`` the references' grids then the target's, sigma as the timestep; the last (target)
        tokens of the output. The transformer reads one layout for a call (row 0's mask), so instructions of
        different lengths or vision-token places run as one call each, never padded (the target's rotary frame
        position follows the text before it)."""
        refs = batch.get("reference_latents")
        if refs is None:
            raise CacheMismatch("Qwen-Image 2.1 edit training needs reference latents, and the batch has none.")
        h, w = noisy.shape[-2:]
        check_sides(h, w)
        rh, rw = refs.shape[-2:]
        check_sides(rh, rw)
        refs = refs.to(noisy.dtype)
        n_refs = refs.shape[1]
        text, lengths = batch["prompt_embeds"], batch["prompt_length"].to("cpu")
        pad = batch["image_pad_mask"].to("cpu").bool()
        groups: dict[tuple[int, bytes], list[int]] = {}
        for i, n in enumerate(lengths.tolist()):
            groups.setdefault((n, pad[i, :n].numpy().tobytes()), []).append(i)
        shapes = [(1, rh, rw)] * n_refs + [(1, h, w)]
        out = torch.empty_like(noisy)
        for (n, _), rows in groups.items():
            idx = torch.tensor(rows, device=noisy.device)
            k = len(rows)
            img_mask = torch.cat(
                [
                    pad[rows, :n].to(noisy.device),
                    torch.ones(k, h * w // 4, dtype=torch.bool, device=noisy.device),
                ],
                dim=1,
            )
            latents = torch.cat([pack(refs[idx, i]) for i in range(n_refs)] + [pack(noisy[idx])], dim=1)
            pred = transformer(
                hidden_states=latents,
                timestep=(timesteps[idx] / 1000).to(noisy.dtype),
                encoder_hidden_states=text[idx, :n],
                img_shapes=[shapes] * k,
                img_mask=img_mask,
                return_dict=False,
            )[0]
            out[idx] = unpack(pred[:, -h * w :], h, w).to(out.dtype)
        return out

    # ------------------------------------------------------------ pipeline, validation, shapes
    def pipeline_processor(self, comps: dict[str, Any], mcfg: ModelConfig) -> Any:
        """The loaded processor where it has the image processor, else one made as ``load`` makes it."""
        proc = comps.get("processor")
        if proc is None or getattr(proc, "image_processor", None) is None:
            proc = self.new_processor(comps["tokenizer"], mcfg)
        return proc

    def validation_image(self, images: list[Any], side: int, mcfg: ModelConfig) -> Any:
        """A validation prompt's references as the pipeline takes them: the list, as read (it resizes them)."""
        return list(images)

    def memory_hints(
        self,
        mcfg: ModelConfig,
        lora_targets: list[str],
        lora_rank: int,
        resolution: int,
        loaded: list[str],
        trained: list[str],
        method: str,
    ) -> dict:
        """As Qwen-Image 2.1's, with one reference fitted to the target's bucket: as many image tokens again, so the
        activations per latent pixel of the target count twice (estimated, as qwen-image-edit/memory.json doubles
        Qwen-Image's; the reference's vision tokens in the instruction, a quarter of its latent tokens, are left
        out). Several references: more than this plans."""
        hints = super().memory_hints(mcfg, lora_targets, lora_rank, resolution, loaded, trained, method)
        hints["activations"] = {k: 2 * v for k, v in hints["activations"].items()}
        return hints

    def cache_shapes(
        self, config_name: str, resolution: int, caption_tokens: int = SYNTHETIC_CAPTION_TOKENS
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """As Qwen-Image 2.1's, with one reference's latents at the target's size, and the instruction's rows with
        that reference's vision tokens (one per 2x2 latent pixels) besides the caption's ``caption_tokens``."""
        shapes = super().cache_shapes(config_name, resolution, caption_tokens)
        lat = shapes["latent"]["latents"]
        shapes["latent"]["reference_latents"] = (1, *lat)
        rows = caption_tokens + lat[-2] * lat[-1] // 4
        shapes["qwen3vl"]["prompt_embeds"] = (rows, *shapes["qwen3vl"]["prompt_embeds"][1:])
        shapes["qwen3vl"]["image_pad_mask"] = (rows,)
        return shapes

    def synthetic_text(
        self, stage: str, shapes: dict[str, tuple[int, ...]], latents: tuple[int, ...], generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """An instruction's entry for one reference fitted to latents of the shape ``latents``: its vision tokens
        after the template's first tokens, as many as the reference's 2x2 latent pixels (what ``denoise`` checks the
        transformer's slots against), then the caption's SYNTHETIC_CAPTION_TOKENS rows."""
        slots = latents[-2] * latents[-1] // 4
        rows = SYNTHETIC_CAPTION_TOKENS + slots
        mask = torch.zeros(rows)
        mask[4 : 4 + slots] = 1  # "<image1><|vision_start|>" and the like come first
        return {
            "prompt_embeds": torch.randn(rows, shapes["prompt_embeds"][-1], generator=generator),
            "image_pad_mask": mask,
        }
