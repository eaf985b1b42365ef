"""Qwen-Image (Qwen, 2025): a 20.4B MMDiT (60 double-stream blocks) on the Qwen-Image VAE's 16-channel latents,
conditioned by Qwen2.5-VL-7B's last hidden state.

Loads offline from a diffusers folder (or a Hub id: Qwen/Qwen-Image), or from the transformer file ComfyUI users have
(diffusers' module names, ``model.diffusion_model.`` or none, fp8-stored ones too) as model.path with the VAE as
model.ae (diffusers' names, or Wan's: the Qwen-Image VAE is Wan 2.1's layout) and Qwen2.5-VL's own file as
model.text_encoder (the Hub checkpoint's names, ComfyUI's qwen_2.5_vl_7b.safetensors, fp8_scaled too) with
model.tokenizer_path. Architectures are bundled in ``configs/`` (qwen-image; qwen-image-tiny for tests).

Trained with rectified flow as QwenImagePipeline runs the model: the latents packed into 2x2 patches as Flux's, the
image's patch grid given as ``img_shapes``, the noise level sigma as the timestep, a prediction of noise - x0; the
shift follows the image's patch count (mu from 0.5 at 256 patches to 0.9 at 8192, exponential: the scheduler's
use_dynamic_shifting). The text: the caption in the pipeline's template (a system prompt, the caption, the assistant
turn), Qwen2.5-VL's last hidden state of its real tokens with the 34 system-prefix tokens dropped, up to 1024 tokens:
cached per caption at its own length, as the pipeline hands them over; ``collate_text`` pads a batch and the mask
marks the real rows, as the pipeline's mask does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError
from .. import common
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..llm_image import LLMImageFamily, check_2x2, pack_2x2, qwen_vae_latents, unpack_2x2
from . import attention

DEFAULT_CONFIG = "qwen-image"
#: QwenImagePipeline's prompt template, the system prefix's token count it drops, and the most caption tokens it keeps
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PREFIX_TOKENS = 34
TEXT_TOKENS = 1024
#: the prefix ComfyUI's one-file checkpoints put before the transformer's (diffusers-named) tensors
PREFIX = "model.diffusion_model."
#: what tells a Qwen-Image transformer file (diffusers' names): the text-input norm and the image modulation
MARKERS = ("txt_norm.weight", "transformer_blocks.0.img_mod.1.weight")


def is_qwen_image_file(keys: Sequence[str]) -> bool:
    names = {k.removeprefix(PREFIX) for k in keys}
    return all(m in names for m in MARKERS)


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if part == "transformer":
        return QwenImageTransformer2DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKLQwenImage.from_config(cfg)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**_hf_config(cfg)))


def vl_name(key: str) -> str:
    """A Qwen2.5-VL checkpoint key in transformers' names for Qwen2_5_VLForConditionalGeneration (what its
    conversion mapping does on load): ``visual.*`` -> ``model.visual.*``, ``model.*`` -> ``model.language_model.*``;
    keys already in those names and ``lm_head`` as they are."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key.removeprefix("model.")
    return key


class QwenImage(LLMImageFamily):
    name = "qwen-image"
    label = "Qwen-Image"
    config_prefix = "qwen-image"
    #: Qwen-Image 2.1's architectures have diffusers classes of their own: config prefix -> the family that trains them
    foreign_configs: ClassVar[Mapping[str, str]] = {"qwen-image-2.1": "qwen-image-2.1"}
    default_config = DEFAULT_CONFIG
    hub_example = "Qwen/Qwen-Image"
    text_stage = "qwen25vl"
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"qwen25vl": ("text_encoder",)}
    pipeline_class = "QwenImagePipeline"
    save_as: ClassVar[Mapping[str, str | tuple[str, str]]] = {
        "transformer": "QwenImageTransformer2DModel",
        "vae": "AutoencoderKLQwenImage",
        "text_encoder": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
    }
    file_option: ClassVar[Mapping[str, str]] = {"vae": "ae", "text_encoder": "text_encoder"}
    part_labels: ClassVar[Mapping[str, str]] = {
        "transformer": "transformer",
        "vae": "VAE",
        "text_encoder": "Qwen2.5-VL text encoder",
    }
    file_examples: ClassVar[Mapping[str, str]] = {
        "vae": "qwen_image_vae.safetensors",
        "text_encoder": "qwen_2.5_vl_7b.safetensors (or its fp8_scaled file)",
    }
    encoder_name = "Qwen2.5-VL"
    file_markers = "txt_norm / transformer_blocks.0.img_mod"
    single_file_hint = (
        "Give the parts' own files as ComfyUI users have them (model.ae=qwen_image_vae.safetensors, "
        "model.text_encoder=qwen_2.5_vl_7b.safetensors, model.tokenizer_path=a folder with Qwen2.5-VL's tokenizer), "
        "or set model.path to a diffusers Qwen-Image folder (Qwen/Qwen-Image)."
    )
    repeated_blocks = ("QwenImageTransformerBlock",)
    tiny_recipe = "tiny-qwen-image-lora"
    tiny_config = "qwen-image-tiny"
    # not measured on Qwen-Image: Flux's figures scaled by the transformer's size (20.4 / 11.9 B)
    compile_cost: ClassVar[Mapping[str, float]] = {
        "cold_s": 80.0,
        "warm_s": 30.0,
        "saved_s": 1.4,
        "saved_s_no_graphs": 0.8,
        "dynamic_s": 100.0,
        "shape_s": 0.0,
        "record_s": 7.0,
    }
    #: both streams' attention and MLPs of every block (as the diffusers Qwen-Image LoRA script and musubi-tuner)
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("img_in", "txt_in", "txt_norm", "time_text_embed*", "norm_out*", "proj_out")
    }
    #: ComfyUI's and musubi-tuner's Qwen-Image LoRA names: lora_unet_ + diffusers' module path (diffusers converts them)
    kohya_base_version = "qwen_image"
    modelspec_lora_architecture = "qwen-image/lora"
    single_file_prefixes: ClassVar[Mapping[str, str]] = {"transformer": PREFIX}

    def new_module(self, part: str, cfg: dict) -> torch.nn.Module:
        return _new_module(part, cfg)

    def diffusers_classes(self) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration

        return {
            "transformer": QwenImageTransformer2DModel,
            "vae": AutoencoderKLQwenImage,
            "text_encoder": Qwen2_5_VLForConditionalGeneration,
        }

    def text_encoder_tensors(
        self, keys: Sequence[str], get: Callable[[str], torch.Tensor], dtype: torch.dtype, device, quantized: bool
    ) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL from a file of its own (ComfyUI's qwen_2.5_vl_7b.safetensors: the Hub checkpoint's names,
        ``model.layers.*``, ``visual.*``, ``lm_head``; fp8_scaled files too, each weight times its scale_weight), in
        transformers' names for Qwen2_5_VLForConditionalGeneration."""
        weights, real = common.scaled_fp8(keys, get)
        read = common.single_file_reader(real, dtype, device, quantized, False)
        sd = {vl_name(k): read(k) for k in weights}
        embed = "model.language_model.embed_tokens.weight"
        if "lm_head.weight" not in sd and embed in sd:  # a file without the head: never used to encode, tied
            sd["lm_head.weight"] = sd[embed]
        return sd

    def text_encoder_classes(self) -> tuple[Any, Any]:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    def transformer_tensors(self, keys: Sequence[str], read) -> Any:
        """diffusers' names, ComfyUI's prefix or none."""
        return ((k.removeprefix(PREFIX), read(k)) for k in keys)

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        """A part built from its config; on the meta device (FSDP's build) the transformer's rotary tables are made
        for real: diffusers' QwenEmbedRope holds them as plain attributes, which no state dict fills."""
        module = self.new_module(part, self.part_config(mcfg, part))
        rope = getattr(module, "pos_embed", None) if part == "transformer" else None
        if rope is not None and getattr(rope, "pos_freqs", None) is not None and rope.pos_freqs.is_meta:
            with torch.device("cpu"):
                module.pos_embed = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim, scale_rope=rope.scale_rope)
        return module

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name == "QwenImagePipeline"

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        return is_qwen_image_file(keys)

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        return DEFAULT_CONFIG if is_qwen_image_file(keys) else None

    def parts_in_single_file(self, keys: Sequence[str]) -> list[str]:
        return ["transformer"] if is_qwen_image_file(keys) else []

    # ------------------------------------------------------------ LoRA names
    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """The transformer's modules by their diffusers paths (ComfyUI's Qwen-Image model has the same names)."""
        if part != "transformer":
            raise ConfigError(f"Qwen-Image LoRAs adapt the transformer only, not {part}.")
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        return common.adaptable_paths(module)

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        return qwen_vae_latents(comps["vae"], pixels)

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, Any]:
        """qwen25vl -> prompt_embeds: per caption [L_i, 3584] (float32), QwenImagePipeline._get_qwen_prompt_embeds
        (the last hidden state of the real tokens, the system prefix dropped) at each caption's own length."""
        if stage != "qwen25vl":
            raise ConfigError(f"Qwen-Image has no text stage {stage!r}.", hint="Its one stage is qwen25vl.")
        tok, te = comps["tokenizer"], comps["text_encoder"]
        text = [TEMPLATE.format(c) for c in captions]
        room = TEXT_TOKENS + PREFIX_TOKENS
        enc = tok(text, max_length=room, padding=True, truncation=True, return_tensors="pt")
        self.warn_long(captions, [len(n) for n in tok(text).input_ids], room, TEXT_TOKENS, "Qwen2.5-VL")
        mask = enc.attention_mask.to(te.device)
        out = te(input_ids=enc.input_ids.to(te.device), attention_mask=mask, output_hidden_states=True)
        states = out.hidden_states[-1].float()
        return {"prompt_embeds": [states[i][mask[i].bool()][PREFIX_TOKENS:] for i in range(len(captions))]}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"qwen25vl:{options.llm.precision}:{TEXT_TOKENS}:qwen-image-template" if stage == "qwen25vl" else ""

    def after_load(self, comps: dict[str, Any], mcfg: ModelConfig) -> None:
        """The transformer's attentions rotate q and k in real arithmetic (the same numbers as diffusers' complex
        multiply, which torch.compile leaves to eager kernels: qwenimage/attention.py)."""
        if "transformer" in comps:
            attention.use_real_rope(comps["transformer"])

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction (noise - x0) for noisy latents [B, 16, h, w], packed, with the patch grid as
        ``img_shapes``, sigma as the timestep and the text mask, as QwenImagePipeline calls the transformer."""
        b, _, h, w = noisy.shape
        check_2x2("Qwen-Image", h, w)
        text, lengths = batch["prompt_embeds"], batch["prompt_length"].to(noisy.device)
        mask = (torch.arange(text.shape[1], device=noisy.device)[None, :] < lengths[:, None]).long()
        out = transformer(
            hidden_states=pack_2x2(noisy),
            timestep=(timesteps / 1000).to(noisy.dtype),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    def unused_parameters(self, transformer) -> list[str]:
        """The last block's text stream after its attention: diffusers' QwenImageTransformerBlock computes it in
        every block, and the model reads only the image stream after the last (its attention's text output
        projection and its text MLP; the text query, key and value do feed the image tokens)."""
        last = len(transformer.transformer_blocks) - 1
        unused = (f"transformer_blocks.{last}.attn.to_add_out.", f"transformer_blocks.{last}.txt_mlp.")
        return [n for n, _ in transformer.named_parameters() if n.startswith(unused)]

    # ------------------------------------------------------------ export
    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """The transformer in diffusers' names (what ComfyUI's diffusion-model loader reads, and ``load`` reads
        back); one tensor at a time, atomically."""
        from ...utils import stream_save_safetensors

        if "transformer" not in sds:
            raise CheckpointError("A Qwen-Image single file holds the transformer, and none was given.")
        return stream_save_safetensors(
            path,
            dict(sds["transformer"]),
            metadata={"format": "pt", "modelspec.architecture": "qwen-image"},
            dtype=dtype,
        )

    def cache_shapes(
        self, config_name: str, resolution: int, caption_tokens: int = 128
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item: the latents at a square ``resolution``, a caption of ``caption_tokens`` rows."""
        cfgdir = self.bundled(config_name)
        tr = _read_json(cfgdir / "transformer" / "config.json")
        side = resolution // 8
        return {
            "latent": {"latents": (16, side, side), "crop": (2,)},
            "qwen25vl": {"prompt_embeds": (caption_tokens, tr["joint_attention_dim"])},
        }
