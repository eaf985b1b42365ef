"""Krea 2 (Krea, June 2026): a 12.8B single-stream DiT on the Qwen-Image VAE's 16-channel latents, conditioned by
twelve hidden layers of Qwen3-VL-4B that the model fuses itself (its text-fusion blocks).

Loads offline from a diffusers folder (or a Hub id: krea/Krea-2-Raw), or from the files ComfyUI users have: the
transformer alone in Krea's original names (fp8-stored ones too) as model.path, with the VAE (diffusers' names) as
model.ae, Qwen3-VL-4B (transformers' names) as model.text_encoder and its tokenizer folder as model.tokenizer_path.
Architectures are bundled in ``configs/`` (krea2; krea2-tiny for tests).

Trained with rectified flow as Krea2Pipeline runs the model: the latents packed into 2x2 patches as Flux's, position
ids (0, row, column) for the image and zeros for the text, the noise level sigma as the timestep (the model scales it
by 1000 itself), a prediction of noise - x0; the shift follows the image's patch count (mu from 0.5 at 256 to 1.15 at
6400, exponential: the scheduler's use_dynamic_shifting). The text: the caption in the pipeline's fixed-length
template (a system prompt, the caption padded, then the assistant suffix; positions counting real tokens only), the
hidden states of the layers the pipeline taps (its ``text_encoder_select_layers``) stacked per token, the system
prefix dropped. Cached per caption without the padding rows (exact: every text token has position 0 and padding is
masked as keys everywhere); ``collate_text`` pads a batch again and ``denoise`` masks the padding.

Krea-2-Turbo is the distilled checkpoint people generate with (8 steps, no CFG; its model_index.json says
``is_distilled``): training on it is warned about, naming Krea-2-Raw, the checkpoint Krea says to train on.
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
from ..llm_image import LLMImageFamily, check_2x2, pack_2x2, qwen_vae_latents, unpack_2x2
from . import single_file

DEFAULT_CONFIG = "krea2"
#: the caption's tokens after the system prefix (the pipeline's max_sequence_length), the prefix's token count and
#: the assistant suffix's (Krea2Pipeline's prompt_template_encode_start_idx / _num_suffix_tokens)
TEXT_TOKENS = 512
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5
TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
TEMPLATE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
#: the hidden states Krea2Pipeline taps by default (0 is the embeddings); a model's model_index.json may name others
TEXT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLModel

    if part == "transformer":
        return Krea2Transformer2DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKLQwenImage.from_config(cfg)
    return Qwen3VLModel(Qwen3VLConfig(**_hf_config(cfg)))


def position_ids(text_len: int, h: int, w: int, device) -> torch.Tensor:
    """[text_len + h * w, 3]: zeros for the text, (0, row, column) for the image's patches (prepare_position_ids)."""
    image = torch.zeros(h, w, 3, device=device)
    image[..., 1] = torch.arange(h, device=device)[:, None]
    image[..., 2] = torch.arange(w, device=device)[None, :]
    return torch.cat([torch.zeros(text_len, 3, device=device), image.reshape(h * w, 3)], dim=0)


class Krea2(LLMImageFamily):
    name = "krea2"
    label = "Krea 2"
    config_prefix = "krea2"
    default_config = DEFAULT_CONFIG
    hub_example = "krea/Krea-2-Raw"
    text_stage = "qwen3vl"
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"qwen3vl": ("text_encoder",)}
    pipeline_class = "Krea2Pipeline"
    save_as: ClassVar[Mapping[str, str | tuple[str, str]]] = {
        "transformer": "Krea2Transformer2DModel",
        "vae": "AutoencoderKLQwenImage",
        "text_encoder": ("Qwen3VLModel", "qwen3_vl"),
    }
    file_option: ClassVar[Mapping[str, str]] = {"vae": "ae", "text_encoder": "text_encoder"}
    part_labels: ClassVar[Mapping[str, str]] = {
        "transformer": "transformer",
        "vae": "VAE",
        "text_encoder": "Qwen3-VL text encoder",
    }
    file_examples: ClassVar[Mapping[str, str]] = {
        "vae": "qwen_image_vae.safetensors",
        "text_encoder": "the Qwen3-VL-4B .safetensors",
    }
    encoder_name = "Qwen3-VL"
    distilled_warning = (
        "this is Krea-2-Turbo, the distilled checkpoint (8 steps, no CFG); training on it wears its distillation "
        "away. Krea's guidance: train on Krea-2-Raw (krea/Krea-2-Raw) and use the LoRA on Turbo."
    )
    file_markers = "txtfusion.projector / blocks.0.attn.wq"
    single_file_hint = (
        "Give the parts' own files (model.ae, model.text_encoder, model.tokenizer_path), or set model.path to a "
        "diffusers Krea 2 folder."
    )
    repeated_blocks = ("Krea2TransformerBlock",)
    tiny_recipe = "tiny-krea2-lora"
    tiny_config = "krea2-tiny"
    # not measured on Krea 2: Flux's figures (a transformer of the same size)
    compile_cost: ClassVar[Mapping[str, float]] = common.FLUX_COMPILE_COST
    #: every Linear of the attention (with its output gate) and the SwiGLU, in the main blocks and the text-fusion
    #: blocks (the same names)
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_gate",
        "attn.to_out.0",
        "ff.gate",
        "ff.up",
        "ff.down",
    )
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("img_in", "time_embed*", "time_mod_proj", "txt_in*", "final_layer*", "text_fusion.projector")
    }
    #: the second LoRA file in Krea's original module names under ComfyUI's prefix, lora_A / lora_B with the alpha
    #: folded in: what ComfyUI loads and diffusers' Krea 2 converter takes (it has no alpha and no lora_down)
    lora_native_prefix: ClassVar[str | None] = "diffusion_model."
    kohya_base_version = "krea2"
    modelspec_lora_architecture = "krea-2/lora"
    single_file_prefixes: ClassVar[Mapping[str, str]] = {"transformer": single_file.PREFIX}

    def new_module(self, part: str, cfg: dict) -> torch.nn.Module:
        return _new_module(part, cfg)

    # ------------------------------------------------------------ sources
    def pipeline_config(self, mcfg: ModelConfig) -> dict:
        """The model's model_index.json (a diffusers folder's, else the bundled architecture's): the text layers the
        pipeline taps and whether the checkpoint is the distilled one."""
        p = self._folder(mcfg)
        if p is not None and (p / "model_index.json").exists():
            return _read_json(p / "model_index.json")
        return _read_json(self.bundled(self.architecture(mcfg)) / "model_index.json")

    def select_layers(self, mcfg: ModelConfig) -> tuple[int, ...]:
        return tuple(self.pipeline_config(mcfg).get("text_encoder_select_layers") or TEXT_LAYERS)

    def distilled(self, mcfg: ModelConfig) -> bool:
        """model_index.json says is_distilled (Krea2Pipeline's flag), or the names say Turbo."""
        return bool(self.pipeline_config(mcfg).get("is_distilled")) or super().distilled(mcfg)

    def diffusers_classes(self) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel
        from transformers import Qwen3VLModel

        return {"transformer": Krea2Transformer2DModel, "vae": AutoencoderKLQwenImage, "text_encoder": Qwen3VLModel}

    def text_encoder_classes(self) -> tuple[Any, Any]:
        from transformers import Qwen3VLConfig, Qwen3VLModel

        return Qwen3VLConfig, Qwen3VLModel

    def after_load(self, comps: dict[str, Any], mcfg: ModelConfig) -> None:
        if "text_encoder" in comps:  # the layers encode_prompts taps, as this model's pipeline config names them
            comps["text_encoder"].difftrain_text_layers = self.select_layers(mcfg)

    def transformer_tensors(self, keys: Sequence[str], read) -> Any:
        return single_file.transformer_tensors(keys, read)

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name.startswith("Krea2")

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        return single_file.is_krea2_file(keys)

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        return DEFAULT_CONFIG if single_file.is_krea2_file(keys) else None

    def parts_in_single_file(self, keys: Sequence[str]) -> list[str]:
        return ["transformer"] if single_file.is_krea2_file(keys) else []

    # ------------------------------------------------------------ LoRA names
    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """The transformer's modules by Krea's original paths (``blocks.0.attn.wq``): what ComfyUI names them."""
        if part != "transformer":
            raise ConfigError(f"Krea 2 LoRAs adapt the transformer only, not {part}.")
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        return common.adaptable_paths(module, single_file.module_to_original)

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        return qwen_vae_latents(comps["vae"], pixels)

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, Any]:
        """qwen3vl -> prompt_embeds: per caption [L_i, layers, width] (float32), Krea2Pipeline.get_text_hidden_states
        with its padding rows dropped."""
        if stage != "qwen3vl":
            raise ConfigError(f"Krea 2 has no text stage {stage!r}.", hint="Its one stage is qwen3vl.")
        tok, te = comps["tokenizer"], comps["text_encoder"]
        layers = getattr(te, "difftrain_text_layers", None) or TEXT_LAYERS
        text = [TEMPLATE_PREFIX + c for c in captions]
        room = TEXT_TOKENS + PREFIX_TOKENS - SUFFIX_TOKENS
        enc = tok(text, truncation=True, padding="max_length", max_length=room, return_tensors="pt")
        self.warn_long(captions, [len(n) for n in tok(text).input_ids], room, room - PREFIX_TOKENS, "Qwen3-VL")
        suffix = tok([TEMPLATE_SUFFIX] * len(text), return_tensors="pt")
        ids = torch.cat([enc.input_ids, suffix.input_ids], dim=1).to(te.device)
        mask = torch.cat([enc.attention_mask, suffix.attention_mask], dim=1).bool().to(te.device)
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = te(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        states = torch.stack([out.hidden_states[i] for i in layers], dim=2)[:, PREFIX_TOKENS:].float()
        mask = mask[:, PREFIX_TOKENS:]
        return {"prompt_embeds": [states[i][mask[i]] for i in range(len(captions))]}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"qwen3vl:{options.llm.precision}:{TEXT_TOKENS}:krea2-template" if stage == "qwen3vl" else ""

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction (noise - x0) for noisy latents [B, 16, h, w], packed, with the position ids, sigma as
        the timestep and the text's padding masked (none when every caption of the batch is as long)."""
        h, w = noisy.shape[-2:]
        check_2x2("Krea 2", h, w)
        text, lengths = batch["prompt_embeds"], batch["prompt_length"].to(noisy.device)
        mask = None
        if bool((lengths != text.shape[1]).any()):
            mask = torch.arange(text.shape[1], device=noisy.device)[None, :] < lengths[:, None]
        out = transformer(
            hidden_states=pack_2x2(noisy),
            encoder_hidden_states=text,
            timestep=(timesteps / 1000).to(noisy.dtype),
            position_ids=position_ids(text.shape[1], h // 2, w // 2, noisy.device),
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    # ------------------------------------------------------------ pipelines and export
    def pipeline_kwargs(self, mcfg: ModelConfig) -> dict[str, Any]:
        """The layers the pipeline taps and whether the checkpoint is the distilled one (its model_index.json)."""
        return {
            "text_encoder_select_layers": self.select_layers(mcfg),
            "is_distilled": bool(self.pipeline_config(mcfg).get("is_distilled", False)),
        }

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """The transformer in Krea's original names (what ComfyUI's diffusion-model loader reads, and ``load`` reads
        back); one tensor at a time, atomically."""
        from ...utils import stream_save_safetensors
        from ..common import LazyTensors

        if "transformer" not in sds:
            raise CheckpointError("A Krea 2 single file holds the transformer, and none was given.")
        tensors = LazyTensors(single_file.to_single_file(sds["transformer"]))
        return stream_save_safetensors(
            path, tensors, metadata={"format": "pt", "modelspec.architecture": "krea-2"}, dtype=dtype
        )

    # ------------------------------------------------------------ tests and benchmarks
    def cache_shapes(
        self, config_name: str, resolution: int, caption_tokens: int = 128
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item: the latents at a square ``resolution``, a caption of ``caption_tokens`` rows."""
        cfgdir = self.bundled(config_name)
        tr = _read_json(cfgdir / "transformer" / "config.json")
        side = resolution // 8
        return {
            "latent": {"latents": (16, side, side), "crop": (2,)},
            "qwen3vl": {"prompt_embeds": (caption_tokens, tr["num_text_layers"], tr["text_hidden_dim"])},
        }
