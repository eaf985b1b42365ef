"""Z-Image (Tongyi-MAI, 2025-26): a 6B single-stream DiT on the Flux.1 VAE's 16-channel latents, conditioned by
Qwen3-4B's hidden states.

Loads offline from a diffusers folder (or a Hub id: Tongyi-MAI/Z-Image, Tongyi-MAI/Z-Image-Turbo), or from the files
ComfyUI users have: the transformer alone in the original names (``z_image_*.safetensors``, fp8-stored ones too) as
model.path, with the VAE (Flux's ``ae.safetensors``) as model.ae, Qwen3-4B (``qwen_3_4b.safetensors``) as
model.text_encoder and its tokenizer folder as model.tokenizer_path. Architectures are bundled in ``configs/``
(z-image; z-image-tiny for tests).

Trained with rectified flow as ZImagePipeline runs the model (``objective = "flow"``, the model's static shift 3):
the transformer takes each sample's latents [16, 1, h, w] and its caption's Qwen3 states with the padding dropped
(lists: samples of several lengths in one call), a timestep *reversed* against the other flow models (1 - sigma:
1 is clean) and predicts x0 - noise, which ``denoise`` turns into the objective's noise - x0. The text: the caption
in Qwen3's chat template (one user turn, generation prompt), 512 tokens at most, the second-to-last hidden state of
its tokens; cached per caption without the padding (``collate_text`` pads a batch and keeps the lengths).

Z-Image-Turbo is the distilled checkpoint people generate with (8 steps, no CFG); nothing in its files tells it from
the base model, so a path naming Turbo is warned about: train on Z-Image (base) and use the LoRA on Turbo.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError
from .. import common
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..llm_image import LLMImageFamily, check_2x2, vae_state_dict
from . import attention, single_file

DEFAULT_CONFIG = "z-image"
#: Qwen3 tokens a caption is encoded with, chat template included (ZImagePipeline's max_sequence_length)
TEXT_TOKENS = 512


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    if part == "transformer":
        return ZImageTransformer2DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKL.from_config(cfg)
    return Qwen3Model(Qwen3Config(**_hf_config(cfg)))


class ZImage(LLMImageFamily):
    name = "zimage"
    label = "Z-Image"
    config_prefix = "z-image"
    default_config = DEFAULT_CONFIG
    hub_example = "Tongyi-MAI/Z-Image"
    text_stage = "qwen3"
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"qwen3": ("text_encoder",)}
    pipeline_class = "ZImagePipeline"
    save_as: ClassVar[Mapping[str, str | tuple[str, str]]] = {
        "transformer": "ZImageTransformer2DModel",
        "vae": "AutoencoderKL",
        "text_encoder": ("Qwen3Model", "qwen3"),
    }
    file_option: ClassVar[Mapping[str, str]] = {"vae": "ae", "text_encoder": "text_encoder"}
    part_labels: ClassVar[Mapping[str, str]] = {
        "transformer": "transformer",
        "vae": "VAE",
        "text_encoder": "Qwen3 text encoder",
    }
    file_examples: ClassVar[Mapping[str, str]] = {
        "vae": "ae.safetensors, Flux.1's VAE",
        "text_encoder": "qwen_3_4b.safetensors",
    }
    encoder_name = "Qwen3"
    distilled_warning = (
        "Z-Image-Turbo is the distilled checkpoint (8 steps, no CFG); training on it wears its distillation away. "
        "Train on Z-Image (the base model, Tongyi-MAI/Z-Image) and use the LoRA on Turbo."
    )
    file_markers = "layers.0.adaLN_modulation / cap_embedder / pad tokens"
    single_file_hint = (
        "Give the parts' own files as ComfyUI users have them (model.ae=ae.safetensors, "
        "model.text_encoder=qwen_3_4b.safetensors, model.tokenizer_path=a folder with Qwen3's tokenizer), or set "
        "model.path to a diffusers Z-Image folder."
    )
    repeated_blocks = ("ZImageTransformerBlock",)
    tiny_recipe = "tiny-zimage-lora"
    tiny_config = "z-image-tiny"
    # cold_s and saved_s_no_graphs measured (zimage-lora-12gb, 1024x1024, H200, 2026-11-27: 60 s of warm-up over the
    # eager first step, 0.874 -> 0.517 s/step compiled without graphs, fp8 weights); the rest Flux's figures scaled
    # by the transformer's size (6.2 / 11.9 B). cold_s was measured while every block compiled a graph of its own (a
    # processor class per attention, fixed 2026-11-28: zimage/attention.py): an upper bound until measured again
    compile_cost: ClassVar[Mapping[str, float]] = {
        "cold_s": 60.0,
        "warm_s": 12.0,
        "saved_s": 0.4,
        "saved_s_no_graphs": 0.36,
        "dynamic_s": 40.0,
        "shape_s": 0.0,
        "record_s": 2.0,
    }
    #: the attention and the SwiGLU feed-forward of every block (the main layers and both refiners), as ai-toolkit
    #: and musubi-tuner train it
    default_lora_targets = (
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("all_x_embedder*", "t_embedder*", "cap_embedder*", "all_final_layer*")
    }
    #: the names ComfyUI loads (its Z-Image model: lora_unet_ + the original module path; the fused qkv)
    kohya_base_version = "z_image"
    modelspec_lora_architecture = "z-image/lora"
    single_file_prefixes: ClassVar[Mapping[str, str]] = {"transformer": single_file.PREFIX}

    def new_module(self, part: str, cfg: dict) -> torch.nn.Module:
        return _new_module(part, cfg)

    def diffusers_classes(self) -> dict[str, Any]:
        from diffusers import AutoencoderKL, ZImageTransformer2DModel
        from transformers import Qwen3Model

        return {"transformer": ZImageTransformer2DModel, "vae": AutoencoderKL, "text_encoder": Qwen3Model}

    def text_encoder_classes(self) -> tuple[Any, Any]:
        from transformers import Qwen3Config, Qwen3Model

        return Qwen3Config, Qwen3Model

    def transformer_tensors(self, keys: Sequence[str], read) -> Any:
        """The original names, a fused qkv split as it is read; a stray norm_final dropped."""
        names = [k for k in keys if k.removeprefix(single_file.PREFIX) not in single_file.DROPPED]
        return single_file.transformer_tensors(names, read)

    def vae_tensors(self, sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
        """Flux.1's ae.safetensors (LDM names) or diffusers' names."""
        sd = vae_state_dict(sd)
        if "encoder.conv_in.weight" in sd and "encoder.down.0.block.0.conv1.weight" in sd:
            from diffusers.loaders import single_file_utils as sfu

            return sfu.convert_ldm_vae_checkpoint(sd, config)
        return sd

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name.startswith("ZImage")

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        return single_file.is_zimage_file(keys)

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        return DEFAULT_CONFIG if single_file.is_zimage_file(keys) else None

    def parts_in_single_file(self, keys: Sequence[str]) -> list[str]:
        return ["transformer"] if single_file.is_zimage_file(keys) else []

    # ------------------------------------------------------------ LoRA names
    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """The transformer's modules by their original paths (``layers.0.attention.out``), as ComfyUI names
        them; q, k and v are one fused ``qkv`` there (``kohya_fused``)."""
        if part != "transformer":
            raise ConfigError(f"Z-Image LoRAs adapt the transformer only, not {part}.")
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        return common.adaptable_paths(module, single_file.module_to_original)

    def kohya_fused_groups(self, paths: Sequence[str]) -> Mapping[str, Sequence[str]]:
        """Original ``...attention.qkv`` -> (to_q, to_k, to_v), stacked in that order."""
        return single_file.fused_qkv(paths)

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """The posterior mean, shifted and scaled as ZImagePipeline decodes it back (Flux.1's VAE: 0.1159, 0.3611)."""
        return common.vae_latents(comps["vae"], pixels)

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, Any]:
        """qwen3 -> prompt_embeds: per caption [L_i, 2560] (float32), Qwen3's second-to-last hidden state of the
        caption's tokens in the chat template, the padding dropped (ZImagePipeline._encode_prompt)."""
        if stage != "qwen3":
            raise ConfigError(f"Z-Image has no text stage {stage!r}.", hint="Its one stage is qwen3.")
        tok, te = comps["tokenizer"], comps["text_encoder"]
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for c in captions
        ]
        enc = tok(texts, padding="max_length", max_length=TEXT_TOKENS, truncation=True, return_tensors="pt")
        self.warn_long(captions, [len(n) for n in tok(texts).input_ids], TEXT_TOKENS, TEXT_TOKENS, "Qwen3")
        mask = enc.attention_mask.to(te.device).bool()
        hidden = te(input_ids=enc.input_ids.to(te.device), attention_mask=mask, output_hidden_states=True)
        states = hidden.hidden_states[-2].float()
        return {"prompt_embeds": [states[i][mask[i]] for i in range(len(captions))]}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"qwen3:{options.llm.precision}:{TEXT_TOKENS}:chat:hidden-2" if stage == "qwen3" else ""

    def after_load(self, comps: dict[str, Any], mcfg: ModelConfig) -> None:
        """The transformer's attentions rotate q and k in real arithmetic (the same numbers as diffusers' complex
        multiply, which torch.compile leaves to eager kernels: zimage/attention.py)."""
        if "transformer" in comps:
            attention.use_real_rope(comps["transformer"])

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction (noise - x0) for noisy latents [B, 16, h, w]: the transformer takes the samples and
        their captions' states (padding dropped) as lists and the reversed timestep 1 - sigma, and predicts
        x0 - noise (ZImagePipeline negates it too)."""
        b, _, h, w = noisy.shape
        check_2x2("Z-Image", h, w)
        text, lengths = batch["prompt_embeds"], batch["prompt_length"].tolist()
        out = transformer(
            list(noisy.unsqueeze(2).unbind(0)),
            1 - timesteps / 1000,
            [text[i, : int(lengths[i])] for i in range(b)],
            return_dict=False,
        )[0]
        return -torch.stack(out).squeeze(2)

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.layers)

    # ------------------------------------------------------------ export
    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """The transformer in the original names (what ComfyUI's diffusion-model loader reads, and ``load`` reads
        back), a fused qkv concatenated only while it is written; one tensor at a time, atomically."""
        from ...utils import stream_save_safetensors
        from ..common import LazyTensors

        if "transformer" not in sds:
            raise CheckpointError("A Z-Image single file holds the transformer, and none was given.")
        tensors = LazyTensors(single_file.to_single_file(sds["transformer"]))
        return stream_save_safetensors(
            path, tensors, metadata={"format": "pt", "modelspec.architecture": "z-image"}, dtype=dtype
        )

    def cache_shapes(
        self, config_name: str, resolution: int, caption_tokens: int = 128
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item: the latents at a square ``resolution`` and a caption of ``caption_tokens``
        Qwen3 tokens (the template's included)."""
        cfgdir = self.bundled(config_name)
        te = _read_json(cfgdir / "text_encoder" / "config.json")
        vae = _read_json(cfgdir / "vae" / "config.json")
        side = resolution // 8
        return {
            "latent": {"latents": (vae["latent_channels"], side, side), "crop": (2,)},
            "qwen3": {"prompt_embeds": (caption_tokens, te["hidden_size"])},
        }
