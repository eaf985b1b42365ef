"""Qwen-Image (Qwen, 2025): a 20.4B MMDiT (60 double-stream blocks) on the Qwen-Image VAE's 16-channel latents,
conditioned by Qwen2.5-VL-7B's last hidden state.

Loads offline from a diffusers folder (or a Hub id: Qwen/Qwen-Image), or from the transformer file ComfyUI users have
(diffusers' module names, ``model.diffusion_model.`` or none, fp8-stored ones too) as model.path with the VAE as
model.ae (diffusers' names, or Wan's: the Qwen-Image VAE is Wan 2.1's layout); the text encoder from a diffusers
folder (precompute reads it once). Architectures are bundled in ``configs/`` (qwen-image; qwen-image-tiny for tests).

Trained with rectified flow as QwenImagePipeline runs the model: the latents packed into 2x2 patches as Flux's, the
image's patch grid given as ``img_shapes``, the noise level sigma as the timestep, a prediction of noise - x0; the
shift follows the image's patch count (mu from 0.5 at 256 patches to 0.9 at 8192, exponential: the scheduler's
use_dynamic_shifting). The text: the caption in the pipeline's template (a system prompt, the caption, the assistant
turn), Qwen2.5-VL's last hidden state of its real tokens with the 34 system-prefix tokens dropped, up to 1024 tokens:
cached per caption at its own length, as the pipeline hands them over; ``collate_text`` pads a batch and the mask
marks the real rows, as the pipeline's mask does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError, ModelLoadError, UnsafeCheckpoint
from .. import common, streaming
from ..base import CachedItem, ModelFamily
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json

PARTS = ("transformer", "vae", "text_encoder")
DEFAULT_CONFIG = "qwen-image"
#: QwenImagePipeline's prompt template, the system prefix's token count it drops, and the most caption tokens it keeps
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PREFIX_TOKENS = 34
TEXT_TOKENS = 1024
SAVE_AS: dict[str, str | tuple[str, str]] = {
    "transformer": "QwenImageTransformer2DModel",
    "vae": "AutoencoderKLQwenImage",
    "text_encoder": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
}
FILE_OPTION = {"vae": "ae"}
LABELS = {"transformer": "transformer", "vae": "VAE", "text_encoder": "Qwen2.5-VL text encoder"}
FILE_EXAMPLE = {"vae": "qwen_image_vae.safetensors"}
#: the prefix ComfyUI's one-file checkpoints put before the transformer's (diffusers-named) tensors
PREFIX = "model.diffusion_model."
#: what tells a Qwen-Image transformer file (diffusers' names): the text-input norm and the image modulation
MARKERS = ("txt_norm.weight", "transformer_blocks.0.img_mod.1.weight")
_WARNED: list[str] = []


def known_configs() -> list[str]:
    return common.config_names("qwen-image")


def bundled_config_dir(name: str | None) -> Path:
    return common.bundled_dir(name or DEFAULT_CONFIG, "Qwen-Image", known_configs, prefix="qwen-image")


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


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C]: 2x2 patches, as QwenImagePipeline._pack_latents (Flux's packing)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = packed.shape
    c = d // 4
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


class QwenImage(ModelFamily):
    name = "qwen-image"
    image_encoder = "vae"
    text_encoders = ("text_encoder",)
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"qwen25vl": ("text_encoder",)}
    denoiser = "transformer"
    parts = PARTS
    objective = "flow"
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
    text_encoder_lora_targets = ()
    trainable_text_encoders = ()  # Qwen2.5-VL only ever encodes for the cache
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("img_in", "txt_in", "txt_norm", "time_text_embed*", "norm_out*", "proj_out")
    }
    #: lora merge writes the merged transformer (diffusers' names, as ComfyUI's files have them)
    mergeable = True
    kohya_layout = True
    #: ComfyUI's and musubi-tuner's Qwen-Image LoRA names: lora_unet_ + diffusers' module path (diffusers converts them)
    kohya_prefixes: ClassVar[Mapping[str, str]] = {"transformer": "lora_unet"}
    kohya_base_version = "qwen_image"
    modelspec_lora_architecture = "qwen-image/lora"
    single_file_prefixes: ClassVar[Mapping[str, str]] = {"transformer": PREFIX}

    # ------------------------------------------------------------ sources
    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        return common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint="Set model.path to a diffusers Qwen-Image folder, a Hub id (--set model.path=Qwen/Qwen-Image) "
            "or the transformer file (with model.ae for the VAE; the text encoder from a diffusers folder).",
            missing_hint="Point model.path at a diffusers Qwen-Image folder (with transformer/, vae/, text_encoder/, "
            "tokenizer/) or a Qwen-Image .safetensors file.",
            check_folder=lambda p: common.require_subfolder(p, "transformer", "Qwen-Image"),
        )

    def architecture(self, mcfg: ModelConfig) -> str:
        return mcfg.config or DEFAULT_CONFIG

    def config_dir(self, name: str | None) -> Path:
        return bundled_config_dir(name)

    def _folder(self, mcfg: ModelConfig) -> Path | None:
        if mcfg.path is None:
            return None
        kind, p = self._source(mcfg)
        return p if kind == "diffusers" else None

    def part_config(self, mcfg: ModelConfig, part: str) -> dict:
        p = self._folder(mcfg)
        if p is not None and (p / part / "config.json").exists():
            return _read_json(p / part / "config.json")
        return _read_json(bundled_config_dir(self.architecture(mcfg)) / part / "config.json")

    def _own_file(self, mcfg: ModelConfig, part: str) -> Path | None:
        option = FILE_OPTION.get(part)
        own = getattr(mcfg, option) if option else None
        if own is None:
            return None
        f = Path(own).expanduser()
        if not f.is_file():
            raise ModelLoadError(
                f"model.{option} {f} does not exist.", hint=f"Give the {LABELS[part]} file ({FILE_EXAMPLE[part]})."
            )
        if f.suffix.lower() != ".safetensors":
            raise UnsafeCheckpoint(
                f"model.{option} {f.name} is not a .safetensors file; difftrain does not unpickle a checkpoint.",
                hint="Use the .safetensors file.",
            )
        return f

    def scheduler_config(self, mcfg: ModelConfig) -> dict:
        if mcfg.prediction_type is not None:
            raise ConfigError(
                f"model.prediction_type={mcfg.prediction_type} does not apply to Qwen-Image, which is trained by "
                "rectified flow.",
                hint="Remove model.prediction_type.",
            )
        p = self._folder(mcfg)
        base = p if p is not None and (p / "scheduler").is_dir() else bundled_config_dir(self.architecture(mcfg))
        return _read_json(base / "scheduler" / "scheduler_config.json")

    def training_scheduler(self, mcfg: ModelConfig):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config(mcfg))

    # ------------------------------------------------------------ loading
    def load(
        self,
        mcfg: ModelConfig,
        parts: Sequence[str],
        dtype: torch.dtype = torch.float32,
        device="cpu",
        precision: dict[str, str] | None = None,
        tokenizers: bool = True,
    ) -> dict[str, Any]:
        """Load the named parts on ``device`` (the tokenizer with the text encoder); ``precision`` may store
        Qwen2.5-VL in int8 | nf4 (bitsandbytes, CUDA) or another float type."""
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        parts = list(parts)
        common.check_parts("Qwen-Image", parts, PARTS)
        kind, p = self._source(mcfg)
        dtypes, quant = common.t5_precisions(
            parts,
            dtype,
            precision,
            device,
            t5="text_encoder",
            label="Qwen-Image",
            loaded_before="the VAE and the transformer",
            encoder="Qwen2.5-VL",
        )
        own = {part: f for part in parts if (f := self._own_file(mcfg, part)) is not None}
        rest = [part for part in parts if part not in own]
        if kind != "diffusers" and "text_encoder" in rest:
            raise ModelLoadError(
                f"{p.name} holds the Qwen-Image transformer only; Qwen2.5-VL is read from a diffusers folder.",
                hint="Precompute with model.path set to a diffusers Qwen-Image folder (Qwen/Qwen-Image: it holds "
                "text_encoder/ and tokenizer/), then train with model.path set to this file.",
            )
        if kind == "diffusers":
            classes = {
                "transformer": QwenImageTransformer2DModel,
                "vae": AutoencoderKLQwenImage,
                "text_encoder": Qwen2_5_VLForConditionalGeneration,
            }
            comps = common.load_diffusers_parts(
                p,
                rest,
                classes,
                dtypes,
                device,
                lambda _: "Is it a complete Qwen-Image folder?",
                quant,
                check_first=True,
            )
        else:
            if "vae" in rest:
                raise ModelLoadError(
                    f"{p.name} holds the Qwen-Image transformer only; it has no VAE weights.",
                    hint="Give the VAE's own file as model.ae (qwen_image_vae.safetensors), or model.path a diffusers "
                    "Qwen-Image folder.",
                )
            comps = (
                {"transformer": self._load_transformer_file(kind, p, mcfg, dtypes["transformer"], device)}
                if rest
                else {}
            )
        for part, f in own.items():
            comps[part] = self._load_vae_file(f, mcfg, dtypes[part], device)
        common.freeze(comps, parts, device, quant)
        if tokenizers and "text_encoder" in parts:
            comps["tokenizer"] = AutoTokenizer.from_pretrained(p / "tokenizer")
        return comps

    def _mismatch(self, f: Path, part: str, mcfg: ModelConfig):
        def mismatch(what: str) -> ModelLoadError:
            return ModelLoadError(
                f"{f.name} does not fit the bundled Qwen-Image architecture {self.architecture(mcfg)!r} for the "
                f"{LABELS[part]}: {what}",
                hint=f"Is it a Qwen-Image {LABELS[part]} file? (bundled: {', '.join(known_configs())})",
            )

        return mismatch

    def _load_transformer_file(self, kind: str, p: Path, mcfg: ModelConfig, dtype: torch.dtype, device):
        """The transformer from a file in diffusers' names (ComfyUI's prefix or none), streamed."""
        from accelerate import init_empty_weights

        keys, get, _, _ = common.open_checkpoint(kind, p)
        if not is_qwen_image_file(keys):
            raise ModelLoadError(
                f"{p.name} does not look like a Qwen-Image transformer (no txt_norm / transformer_blocks.0.img_mod).",
                hint="Give the Qwen-Image transformer file or a diffusers Qwen-Image folder; another model's file "
                "needs its own family.",
            )
        config = _read_json(bundled_config_dir(self.architecture(mcfg)) / "transformer" / "config.json")
        read = common.single_file_reader(get, dtype, device, False, False)
        with init_empty_weights(include_buffers=False):
            module = _new_module("transformer", config)
        tensors = ((k.removeprefix(PREFIX), read(k)) for k in keys)
        streaming.fill(module, "transformer", tensors, self._mismatch(p, "transformer", mcfg), common.assign_state_dict)
        return module

    def _load_vae_file(self, f: Path, mcfg: ModelConfig, dtype: torch.dtype, device):
        """The VAE from its own file: diffusers' names, or Wan's (ComfyUI's qwen_image_vae.safetensors)."""
        from accelerate import init_empty_weights

        keys, get, _, _ = common.open_checkpoint("single", f)
        read = common.single_file_reader(get, dtype, device, False, False)
        sd = {k.removeprefix("vae."): read(k) for k in keys}
        if "encoder.conv1.weight" in sd:
            from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

            sd = convert_wan_vae_to_diffusers(sd)
        with init_empty_weights(include_buffers=False):
            module = _new_module("vae", self.part_config(mcfg, "vae"))
        common.assign_state_dict(module, sd, self._mismatch(f, "vae", mcfg))
        return module

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        """A part built from its config; on the meta device (FSDP's build) the transformer's rotary tables are made
        for real: diffusers' QwenEmbedRope holds them as plain attributes, which no state dict fills."""
        module = _new_module(part, self.part_config(mcfg, part))
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

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        own = self._own_file(mcfg, part)
        if own is not None:
            return common.hash_files(self.name, part, [own], memo)
        kind, p = self._source(mcfg)
        if kind == "diffusers":
            return common.hash_files(
                self.name, part, common.weight_files(p / part) if (p / part).is_dir() else [], memo
            )
        if part != "transformer":
            raise ModelLoadError(f"{p.name} holds the Qwen-Image transformer only; give the {LABELS[part]}'s own file.")
        return common.hash_files(self.name, part, [p], memo)

    @staticmethod
    def module_configs(comps: dict[str, Any]) -> dict[str, dict]:
        return common.module_configs(comps, PARTS)

    # ------------------------------------------------------------ LoRA names
    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """The transformer's modules by their diffusers paths (ComfyUI's Qwen-Image model has the same names)."""
        if part != "transformer":
            raise ConfigError(f"Qwen-Image LoRAs adapt the transformer only, not {part}.")
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        return common.adaptable_paths(module)

    # ------------------------------------------------------------ memory hints
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
        bundled = bundled_config_dir(self.architecture(mcfg))
        p = Path(mcfg.path).expanduser() if mcfg.path is not None else None
        base = p if p is not None and p.is_dir() and (p / "transformer").is_dir() else bundled
        return common.image_memory_hints(
            self, _new_module, base, bundled, PARTS, loaded, trained, method, lora_targets, lora_rank, resolution
        )

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> normalised latents [B, 16, H/8, W/8] (float32): the Qwen-Image VAE's
        posterior mean of the one-frame video, ``(z - mean) / std`` per channel (the pipeline's inverse)."""
        vae = comps["vae"]
        z = vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist.mean.float()
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(shape)
        return ((z - mean) / std).squeeze(2)

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
        long = [c for c, n in zip(captions, tok(text).input_ids) if len(n) > room]
        if long:
            from ...console import warn

            warn(
                f"{len(long)} caption(s) longer than Qwen-Image's {TEXT_TOKENS} Qwen2.5-VL tokens are cut to it, "
                f"e.g. {long[0][:60]!r}..."
            )
        mask = enc.attention_mask.to(te.device)
        out = te(input_ids=enc.input_ids.to(te.device), attention_mask=mask, output_hidden_states=True)
        states = out.hidden_states[-1].float()
        return {"prompt_embeds": [states[i][mask[i].bool()][PREFIX_TOKENS:] for i in range(len(captions))]}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"qwen25vl:{options.llm.precision}:{TEXT_TOKENS}:qwen-image-template" if stage == "qwen25vl" else ""

    def stage_precision(self, stage: str, options: TextEncodersConfig) -> dict[str, str] | None:
        return {"text_encoder": options.llm.precision} if stage == "qwen25vl" else None

    def enabled_stages(self, options: TextEncodersConfig) -> list[str]:
        return ["qwen25vl"]

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}

    def collate_text(self, stage: str, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Captions of several lengths in one batch: padded with zeros to the longest, their lengths kept (the
        pipeline's padding and mask)."""
        states = [e["prompt_embeds"] for e in entries]
        n = max(s.shape[0] for s in states)
        padded = torch.zeros(len(states), n, states[0].shape[-1], dtype=states[0].dtype)
        for i, s in enumerate(states):
            padded[i, : s.shape[0]] = s
        return {"prompt_embeds": padded, "prompt_length": torch.tensor([s.shape[0] for s in states])}

    def combine_texts(
        self, stages: dict[str, dict[str, torch.Tensor]], options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        return dict(stages["qwen25vl"])

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction (noise - x0) for noisy latents [B, 16, h, w], packed, with the patch grid as
        ``img_shapes``, sigma as the timestep and the text mask, as QwenImagePipeline calls the transformer."""
        b, _, h, w = noisy.shape
        if h % 2 or w % 2:
            raise ConfigError(
                f"A Qwen-Image latent of {h}x{w} cannot be packed into 2x2 patches.",
                hint="Use buckets whose sides are multiples of 16 pixels (data.bucket_step: 64 does).",
            )
        text, lengths = batch["prompt_embeds"], batch["prompt_length"].to(noisy.device)
        mask = (torch.arange(text.shape[1], device=noisy.device)[None, :] < lengths[:, None]).long()
        out = transformer(
            hidden_states=pack(noisy),
            timestep=(timesteps / 1000).to(noisy.dtype),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    # ------------------------------------------------------------ pipelines and export
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        from diffusers import QwenImagePipeline

        return QwenImagePipeline(
            scheduler=self.training_scheduler(mcfg),
            vae=comps["vae"],
            text_encoder=comps["text_encoder"],
            tokenizer=comps["tokenizer"],
            transformer=comps["transformer"],
        )

    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """pytorch_lora_weights.safetensors as QwenImagePipeline.load_lora_weights reads it."""
        from diffusers import QwenImagePipeline

        extra = [part for part, sd in layers.items() if sd and part != "transformer"]
        if extra:
            raise CheckpointError(
                f"diffusers' Qwen-Image LoRA format has no place for {', '.join(extra)} LoRA layers.",
                hint="Train LoRA on the transformer only (Qwen2.5-VL is never trained).",
            )
        QwenImagePipeline.save_lora_weights(
            save_directory=str(folder),
            transformer_lora_layers=layers.get("transformer"),
            transformer_lora_adapter_metadata=(metadata or {}).get("transformer"),
            safe_serialization=True,
        )

    def single_file_parts(self, trained: Sequence[str]) -> tuple[str, ...]:
        return ("transformer",)

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

    def save_diffusers(
        self,
        sds: dict[str, Any],
        configs: dict[str, dict],
        folder: Path,
        mcfg: ModelConfig,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """A diffusers folder: the trained parts written, the others copied from the source folder with its
        tokenizer, scheduler and model_index.json, atomically."""
        import shutil

        from ...utils import atomic_dir

        kind, src = self._source(mcfg)
        if kind != "diffusers":
            raise CheckpointError(
                "A diffusers Qwen-Image folder is written from a diffusers source folder (its VAE, Qwen2.5-VL and "
                "tokenizer are copied from there).",
                hint="Train from the diffusers folder, or save.formats: [single_file].",
            )
        with atomic_dir(Path(folder)) as tmp:
            for part in PARTS:
                if part in sds:
                    common.write_part(tmp, part, sds[part], configs[part], dtype, SAVE_AS[part])
                elif (src / part).is_dir():
                    shutil.copytree(src / part, tmp / part)
            for extra in ("tokenizer", "scheduler"):
                if (src / extra).is_dir():
                    shutil.copytree(src / extra, tmp / extra)
            shutil.copy(src / "model_index.json", tmp / "model_index.json")
        return Path(folder)

    # ------------------------------------------------------------ tests and benchmarks
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded Qwen-Image of the real layout (Qwen2.5-VL with an offline byte-level tokenizer) saved as
        QwenImagePipeline saves it."""
        import shutil

        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
        from transformers import AutoTokenizer

        from ..tokenizers import tiny_qwen_tokenizer

        folder = Path(folder)
        cfgdir = bundled_config_dir(self.tiny_config)
        torch.manual_seed(seed)
        comps: dict[str, Any] = {part: _new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS}
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            comps["tokenizer"] = AutoTokenizer.from_pretrained(tiny_qwen_tokenizer(tokdir))
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                _read_json(cfgdir / "scheduler" / "scheduler_config.json")
            )
            QwenImagePipeline(scheduler=sched, **comps).save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]
        finally:
            shutil.rmtree(tokdir, ignore_errors=True)
        return folder

    def build_random(
        self,
        config_name: str,
        path: Path,
        device: str | torch.device = "cpu",
        seed: int = 0,
        parts: Sequence[str] = PARTS,
    ) -> Path:
        """Random bf16 weights of a bundled architecture as a diffusers folder (no tokenizer: benchmarks give
        stand-ins)."""
        import shutil

        from ...utils import atomic_dir

        cfgdir = bundled_config_dir(config_name)
        comps = common.random_parts(_new_module, cfgdir, parts, device, seed)
        configs = self.module_configs(comps)
        with atomic_dir(Path(path)) as tmp:
            for part, m in comps.items():
                common.write_part(tmp, part, m.state_dict(), configs[part], torch.bfloat16, SAVE_AS[part])
            shutil.copytree(cfgdir / "scheduler", tmp / "scheduler")
            shutil.copy(cfgdir / "model_index.json", tmp / "model_index.json")
        return Path(path)

    def cache_shapes(
        self, config_name: str, resolution: int, caption_tokens: int = 128
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item: the latents at a square ``resolution``, a caption of ``caption_tokens`` rows."""
        cfgdir = bundled_config_dir(config_name)
        tr = _read_json(cfgdir / "transformer" / "config.json")
        side = resolution // 8
        return {
            "latent": {"latents": (16, side, side), "crop": (2,)},
            "qwen25vl": {"prompt_embeds": (caption_tokens, tr["joint_attention_dim"])},
        }
