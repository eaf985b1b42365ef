"""Qwen-Image-Edit ("qwen-image-edit"): Qwen-Image's MMDiT trained to edit reference images. Qwen-Image-Edit takes one
reference (QwenImageEditPipeline); Edit-2509 and Edit-2511 take several (QwenImageEditPlusPipeline; 2511's transformer
has ``zero_cond_t``: the reference tokens get the modulation of timestep 0). The same weights' layout as Qwen-Image:
bundled configs qwen-image-edit, qwen-image-edit-2509, qwen-image-edit-2511 (and two tiny ones for tests).

As the pipelines run it:

- the instruction is encoded by Qwen2.5-VL WITH the reference images, through Qwen2VLProcessor: Edit's template has
  one image slot before the instruction and the reference goes to the processor at about 1024 x 1024 pixels (its
  aspect kept, sides multiples of 32); Edit Plus writes "Picture i: <image>" for each reference before the
  instruction and hands each reference over at about 384 x 384. The first 64 tokens (the system prompt) are dropped.
  Precompute runs the pipeline's own ``_get_qwen_prompt_embeds`` on each item's references (its original images) and
  instruction; the text entry's key holds the references' hashes.
- the references' latents (the VAE's posterior mean, normalised as the latents) are packed into 2x2 patches as the
  target and appended after the noisy target's tokens along the sequence; ``img_shapes`` lists the target's patch
  grid then each reference's; the prediction is the target's tokens only, so the loss is on the target alone.
  Training resizes each reference to its target's bucket (musubi-tuner's default), cropped as the target; the
  pipeline at inference resizes it to about 1024 x 1024 (the RoPE positions of a reference are its own grid, so the
  two sizes are the same kind of input). Precompute caches them beside the target's latents ("reference_latents",
  ``image_condition_entries``), the latent key holding the references' hashes.

The pairs (a target, its references, the instruction) come from data.control_dir or a pairs file (data/pairs.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CacheMismatch, ConfigError, DataError
from ..base import CachedItem
from ..common import read_json as _read_json
from ..llm_image import (
    PARTS,
    cached_references,
    check_2x2,
    encoded_references,
    pack_2x2,
    qwen_vae_latents,
    unpack_2x2,
)
from .family import QwenImage

EDIT = "QwenImageEditPipeline"
EDIT_PLUS = "QwenImageEditPlusPipeline"
#: the 2509 / 2511 checkpoints' names tell them apart from the first Edit (their transformer files are alike)
NAMED_VERSIONS = (("2511", "qwen-image-edit-2511"), ("2509", "qwen-image-edit-2509"))


def image_processor(cfg: dict):
    """Qwen2-VL's image processor from its preprocessor_config.json (torchvision's backend where installed, else the
    PIL one: transformers picks the same without torchvision, here without its warning)."""
    import importlib.util

    import transformers

    name = "Qwen2VLImageProcessor" if importlib.util.find_spec("torchvision") else "Qwen2VLImageProcessorPil"
    return getattr(transformers, name)(**{k: v for k, v in cfg.items() if k not in ("processor_class",)})


def vl_processor(image_proc, tokenizer):
    """Qwen2VLProcessor over the tokenizer and the image processor, without a video processor (never used here).
    Our subclass only because transformers checks a missing video processor's class through a table that needs
    torchvision; the processing is Qwen2VLProcessor's own."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyQwen2VLProcessor(image_processor=image_proc, tokenizer=tokenizer)


class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit, Edit-2509 and Edit-2511 (see the module's doc)."""

    name = "qwen-image-edit"
    label = "Qwen-Image-Edit"
    config_prefix = "qwen-image-edit"
    default_config = "qwen-image-edit"
    hub_example = "Qwen/Qwen-Image-Edit"
    pipeline_class = EDIT  # save_lora_weights: the same LoRA mixin as the Plus pipeline's
    image_conditioned = True
    references = True
    tiny_recipe = "tiny-qwen-image-edit-lora"
    tiny_config = "qwen-image-edit-plus-tiny"
    modelspec_lora_architecture = "qwen-image-edit/lora"
    single_file_hint = (
        "Give the parts' own files as ComfyUI users have them (model.ae=qwen_image_vae.safetensors, "
        "model.text_encoder=qwen_2.5_vl_7b.safetensors, model.tokenizer_path=a folder with Qwen2.5-VL's tokenizer) "
        "and model.config (qwen-image-edit, qwen-image-edit-2509 or qwen-image-edit-2511: its image processor is "
        "bundled), or set model.path to a diffusers Qwen-Image-Edit folder."
    )

    # ------------------------------------------------------------ which Edit
    def architecture(self, mcfg: ModelConfig) -> str:
        """model.config; else, for a transformer file, the version its name says (2509, 2511), else the first Edit."""
        if mcfg.config:
            return mcfg.config
        name = Path(str(mcfg.path)).name.lower() if mcfg.path is not None else ""
        for tag, config in NAMED_VERSIONS:
            if tag in name and not (mcfg.path is not None and Path(mcfg.path).expanduser().is_dir()):
                return config
        return self.default_config

    def pipeline_name(self, mcfg: ModelConfig) -> str:
        """QwenImageEditPipeline or QwenImageEditPlusPipeline: the folder's model_index.json, else the bundled one."""
        p = self._folder(mcfg)
        index = p / "model_index.json" if p is not None else None
        if index is None or not index.is_file():
            index = self.bundled(self.architecture(mcfg)) / "model_index.json"
        return str(_read_json(index).get("_class_name", EDIT))

    def plus(self, mcfg: ModelConfig) -> bool:
        """Several references (Edit-2509 / 2511)."""
        return self.pipeline_name(mcfg) == EDIT_PLUS

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name in (EDIT, EDIT_PLUS)

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        """Not from the keys (Qwen-Image's layout, whichever Edit): model.config or the file's name says it."""
        return None

    # ------------------------------------------------------------ loading: the processor with the text encoder
    def processor_config(self, mcfg: ModelConfig) -> dict:
        p = self._folder(mcfg)
        f = p / "processor" / "preprocessor_config.json" if p is not None else None
        if f is None or not f.is_file():
            f = self.bundled(self.architecture(mcfg)) / "processor" / "preprocessor_config.json"
        return _read_json(f)

    def load(
        self,
        mcfg: ModelConfig,
        parts: Sequence[str],
        dtype: torch.dtype = torch.float32,
        device="cpu",
        precision: dict[str, str] | None = None,
        tokenizers: bool = True,
    ) -> dict[str, Any]:
        """As Qwen-Image's; with the text encoder, Qwen2VLProcessor too (what hands it the reference images)."""
        comps = super().load(mcfg, parts, dtype, device, precision, tokenizers)
        if "tokenizer" in comps:
            comps["processor"] = vl_processor(image_processor(self.processor_config(mcfg)), comps["tokenizer"])
        return comps

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """The text encoder's covers what else decides its output here: the pipeline's template and reference sizes
        (Edit or Edit Plus) and the image processor's settings."""
        own = super().fingerprint(mcfg, part, memo)
        if part != "text_encoder":
            return own
        from ...utils import sha256_text

        proc = json.dumps(self.processor_config(mcfg), sort_keys=True)
        return sha256_text(own, self.pipeline_name(mcfg), proc)

    # ------------------------------------------------------------ encoding
    def _text_pipeline(self, comps: dict[str, Any], plus: bool):
        """The Edit pipeline over the text encoder and processor alone: its own prompt encoding is what runs."""
        import diffusers

        cls = getattr(diffusers, EDIT_PLUS if plus else EDIT)
        return cls(
            scheduler=None,
            vae=None,
            text_encoder=comps["text_encoder"],
            tokenizer=comps["tokenizer"],
            processor=comps["processor"],
            transformer=None,
        )

    def vl_images(self, images: Sequence[Any], plus: bool) -> list[Any]:
        """The references as the pipeline hands them to Qwen2.5-VL: Edit, the one reference at ~1024^2 pixels; Edit
        Plus, each at ~384^2 (the pipelines' own calculate_dimensions and VaeImageProcessor.resize)."""
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_mod
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_mod

        resize = VaeImageProcessor(vae_scale_factor=16).resize
        out = []
        for img in images:
            ratio = img.size[0] / img.size[1]
            if plus:
                w, h = plus_mod.calculate_dimensions(plus_mod.CONDITION_IMAGE_SIZE, ratio)
            else:  # QwenImageEditPipeline.__call__: calculate_dimensions(1024 * 1024, ratio), the VAE's size too
                w, h, _ = edit_mod.calculate_dimensions(1024 * 1024, ratio)
            out.append(resize(img, h, w))
        return out

    def encode_prompts_with_images(
        self,
        comps: dict[str, Any],
        captions: list[str],
        images: list[list[Any]],
        stage: str,
        options: TextEncodersConfig,
        mcfg: ModelConfig,
    ) -> dict[str, Any]:
        """qwen25vl -> prompt_embeds per caption [L_i, 3584] (float32): the Edit pipeline's ``_get_qwen_prompt_embeds``
        on each instruction with its references (PIL images, as read), one at a time (the Plus pipeline numbers the
        pictures of one prompt)."""
        if stage != "qwen25vl":
            raise ConfigError(f"Qwen-Image-Edit has no text stage {stage!r}.", hint="Its one stage is qwen25vl.")
        plus = self.plus(mcfg)
        pipe = self._text_pipeline(comps, plus)
        device = comps["text_encoder"].device
        out = []
        for caption, refs in zip(captions, images):
            if not plus and len(refs) != 1:
                raise DataError(
                    f"Qwen-Image-Edit takes one reference image; {caption[:40]!r} has {len(refs)}.",
                    hint="Give one reference per target, or train Qwen-Image-Edit-2509 / 2511 (several references).",
                )
            vl = self.vl_images(refs, plus)
            embeds, _ = pipe._get_qwen_prompt_embeds(
                [caption], image=vl if plus else vl[0], device=device, dtype=torch.float32
            )
            out.append(embeds[0].float())
        return {"prompt_embeds": out}

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, Any]:
        raise DataError(
            "Qwen-Image-Edit encodes each instruction with its reference images; a caption alone has no encoding.",
            hint="Give the references: data.control_dir (a folder beside data.dir with the same file names) or "
            "data.pairs (a JSONL file of image, control and caption).",
        )

    def image_condition_entries(
        self,
        comps: dict[str, Any],
        pixels: torch.Tensor,
        generator: torch.Generator | None = None,
        references: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """references [B, N, 3, H, W] in [-1, 1] (each fitted to its target's bucket) -> "reference_latents" [B, N,
        16, H/8, W/8]: the VAE's posterior mean, normalised (the pipeline's _encode_vae_image, argmax)."""
        return encoded_references(references, lambda x: qwen_vae_latents(comps["vae"], x), "Qwen-Image-Edit needs")

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return cached_references(
            latent_entry,
            "Qwen-Image-Edit",
            "Run `difftrain precompute` with family: qwen-image-edit (the cache is per family).",
        )

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction for noisy latents [B, 16, h, w]: the noisy target's 2x2 patches, then each
        reference's (batch["reference_latents"] [B, N, 16, h', w']) along the sequence, ``img_shapes`` the target's
        grid then the references', sigma as the timestep; the target's tokens of the output, unpacked (as
        QwenImageEditPipeline / QwenImageEditPlusPipeline call the transformer)."""
        b, _, h, w = noisy.shape
        check_2x2("Qwen-Image-Edit", h, w)
        refs = batch.get("reference_latents")
        if refs is None:
            raise CacheMismatch("Qwen-Image-Edit needs reference latents, and the batch has none.")
        refs = refs.to(noisy.dtype)
        rh, rw = refs.shape[-2:]
        check_2x2("Qwen-Image-Edit", rh, rw)
        packed = [pack_2x2(noisy)] + [pack_2x2(refs[:, i]) for i in range(refs.shape[1])]
        text, lengths = batch["prompt_embeds"], batch["prompt_length"].to(noisy.device)
        mask = (torch.arange(text.shape[1], device=noisy.device)[None, :] < lengths[:, None]).long()
        shapes = [(1, h // 2, w // 2)] + [(1, rh // 2, rw // 2)] * refs.shape[1]
        out = transformer(
            hidden_states=torch.cat(packed, dim=1),
            timestep=(timesteps / 1000).to(noisy.dtype),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0]
        return unpack_2x2(out[:, : packed[0].shape[1]], h, w)

    # ------------------------------------------------------------ pipeline, validation, shapes, tiny model
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        """QwenImageEditPipeline or QwenImageEditPlusPipeline over the loaded parts, with the model's scheduler."""
        import diffusers

        if "processor" not in comps:
            comps["processor"] = vl_processor(image_processor(self.processor_config(mcfg)), comps["tokenizer"])
        return getattr(diffusers, self.pipeline_name(mcfg))(
            scheduler=self.training_scheduler(mcfg),
            vae=comps["vae"],
            text_encoder=comps["text_encoder"],
            tokenizer=comps["tokenizer"],
            processor=comps["processor"],
            transformer=comps["transformer"],
        )

    def validation_image(self, images: list[Any], side: int, mcfg: ModelConfig) -> Any:
        """A validation prompt's references as the Edit pipeline takes them: as read (it resizes them itself); a list
        for Edit Plus."""
        return images if self.plus(mcfg) else images[0]

    def cache_shapes(
        self, config_name: str, resolution: int, caption_tokens: int = 128
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """As Qwen-Image's, with one reference's latents at the target's size (Edit Plus: one per reference)."""
        shapes = super().cache_shapes(config_name, resolution, caption_tokens)
        shapes["latent"]["reference_latents"] = (1, *shapes["latent"]["latents"])
        return shapes

    def build_tiny(self, folder: Path, seed: int = 0, config: str | None = None) -> Path:
        """A tiny seeded Qwen-Image-Edit of the real layout: "qwen-image-edit-plus-tiny" (Edit Plus, zero_cond_t as
        2511) or "qwen-image-edit-tiny" (the first Edit), with an offline byte-level tokenizer that has Qwen2.5-VL's
        vision tokens and a small image processor; saved as its pipeline saves it."""
        import shutil

        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer

        from ..tokenizers import tiny_qwen_tokenizer

        folder = Path(folder)
        name = config or self.tiny_config
        cfgdir = self.bundled(name)
        torch.manual_seed(seed)
        comps: dict[str, Any] = {
            part: self.new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS
        }
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            comps["tokenizer"] = AutoTokenizer.from_pretrained(tiny_qwen_tokenizer(tokdir, vision=True))
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                _read_json(cfgdir / "scheduler" / "scheduler_config.json")
            )
            cls = _read_json(cfgdir / "model_index.json")["_class_name"]
            pipe = getattr(diffusers, cls)(scheduler=sched, processor=None, **comps)
            pipe.save_pretrained(folder, safe_serialization=True)
            # the processor as Qwen2VLProcessor's folder holds it (its image processor's config and the tokenizer);
            # written here: transformers' save_pretrained of a processor without a video processor fails
            image_processor(_read_json(cfgdir / "processor" / "preprocessor_config.json")).save_pretrained(
                folder / "processor"
            )
            comps["tokenizer"].save_pretrained(folder / "processor")
        finally:
            shutil.rmtree(tokdir, ignore_errors=True)
        index = _read_json(folder / "model_index.json")
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        return folder

    def build_random(
        self,
        config_name: str,
        path: Path,
        device: str | torch.device = "cpu",
        seed: int = 0,
        parts: Sequence[str] = PARTS,
    ) -> Path:
        """As Qwen-Image's, with the bundled processor config (its tokenizer is the benchmark's stand-in)."""
        import shutil

        out = super().build_random(config_name, path, device, seed, parts)
        shutil.copytree(self.bundled(config_name) / "processor", Path(out) / "processor", dirs_exist_ok=True)
        return out
