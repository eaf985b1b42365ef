"""Qwen-Image 2.1 ("qwen-image-2.1"): a single-stream, block-causal DiT (32 blocks of 4 096, one modulation shared by
every block) on its own VAE's 64-channel latents (16x spatially, four input channels: RGBA), conditioned by
Qwen3-VL-8B's last hidden state. diffusers' QwenImage21Pipeline / QwenImage21Transformer2DModel /
AutoencoderKLQwenImage21; the text encoder Qwen3VLForConditionalGeneration with Qwen3VLProcessor. Text-to-image here;
the pipeline's image-conditioned mode is trained by family qwen-image-2.1-edit (v21_edit.py).

Loads offline from a diffusers folder (or a Hub id: Qwen/Qwen-Image-2.1; the processor/ folder holds the tokenizer),
or from a transformer file (diffusers' names, ``model.diffusion_model.`` or none; ComfyUI's fused SwiGLU ``gate_up``
split as diffusers' converter splits it) with the VAE as model.ae, Qwen3-VL's own file as model.text_encoder and its
tokenizer folder as model.tokenizer_path. Architectures are bundled in ``configs/`` (qwen-image-2.1; qwen-image-2.1-tiny
for tests).

Trained as QwenImage21Pipeline runs the model:

- the image: the VAE's posterior mean of the RGB image with an opaque alpha channel (1.0 after the [-1, 1]
  normalisation, what the pipeline's image processor makes of an opaque RGBA image), normalised per channel by
  latents_mean / latents_std; latents read unpatched (``_pack_latents``: one token per latent pixel, a 16x16-pixel
  tile), so an image's sides must be multiples of 32 pixels (the pipeline's ``multiple_of``: each text-side image slot
  stands for 2x2 latent tokens);
- the text: the caption in the pipeline's text-to-image template, Qwen3-VL's last decoder layer's output BEFORE its
  final norm (the pipeline hooks the norm away), the system prompt's tokens (``_drop_idx``) dropped, left padding:
  precompute runs the pipeline's own ``_get_qwen_prompt_embeds`` and caches each caption at its own length;
- the transformer's call: ``img_mask`` False over the text and one True slot per 2x2 group of target tokens appended
  (``append_target_slots``), ``img_shapes`` the target's latent grid, sigma as the timestep (t / 1000), the target's
  tokens of the output (the last ones). The target's rotary frame position is the text's length, padding included,
  so a batch of captions of different lengths is run as one call per length (each sample sees exactly its own
  caption's sequence, as the pipeline runs one prompt), never padded;
- the objective: x_s = (1 - s) x0 + s noise, target noise - x0 (FlowMatchEulerDiscreteScheduler.step adds
  (s_next - s) * prediction), the shift dynamic by the image's token count (its latent pixels: latent_patch 1) with
  the scheduler config's base / max shift and sequence lengths, as the pipeline's calculate_shift.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError, ModelLoadError
from .. import common
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..llm_image import PARTS, LLMImageFamily
from .family import vl_name

DEFAULT_CONFIG = "qwen-image-2.1"
#: the SwiGLU's gate and up projections (diffusers' names), one fused ``img_mlp.gate_up`` in ComfyUI's model
_SWIGLU_MEMBERS = ("gate_layer", "proj")
_SWIGLU = tuple(f".img_mlp.{m}" for m in _SWIGLU_MEMBERS)
#: the prefix ComfyUI's one-file checkpoints put before the transformer's tensors
PREFIX = "model.diffusion_model."
#: what tells a Qwen-Image 2.1 transformer file: the text projection's norm (diffusers' own detection key) and the
#: shared modulation
MARKERS = ("txt_in.text_norm.weight", "modulation.1.weight")
#: the chat template the tiny model's processor renders with: Qwen3-VL's for text messages (a system message's
#: content a list of text items, as the pipeline's ``_drop_idx`` asks it)
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for c in message.content %}{%- if c.type == 'text' %}{{- c.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def comfy_names(sd: Mapping[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """A diffusers transformer state dict in ComfyUI's names, as makers (common.LazyTensors): each SwiGLU's
    ``gate_layer`` and ``proj`` one ``gate_up`` (gate rows first), the inverse of ``transformer_tensors``' split."""

    def fused(base: str) -> torch.Tensor:
        return torch.cat([sd[f"{base}.{m}.weight"] for m in _SWIGLU_MEMBERS], dim=0)

    def same(key: str) -> torch.Tensor:
        return sd[key]

    out: dict[str, Callable[[], torch.Tensor]] = {}
    for k in sd:
        if k.endswith(".img_mlp.gate_layer.weight"):
            base = k.removesuffix(".gate_layer.weight")
            out[f"{base}.gate_up.weight"] = functools.partial(fused, base)
        elif not k.endswith(".img_mlp.proj.weight"):
            out[k] = functools.partial(same, k)
    return out


def is_qwen_image21_file(keys: Sequence[str]) -> bool:
    names = {k.removeprefix(PREFIX) for k in keys}
    return all(m in names for m in MARKERS)


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if part == "transformer":
        return QwenImage21Transformer2DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKLQwenImage21.from_config(cfg)
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(**_hf_config(cfg)))


def text_processor(tokenizer, chat_template: str | None = None, image_processor=None):
    """Qwen3VLProcessor over the tokenizer, without a video processor (never used here; transformers' needs
    torchvision), and without an image processor unless given one (text-to-image never hands it an image;
    qwen-image-2.1-edit gives Qwen3-VL's). Our subclass only lets the two be absent; the processing is
    Qwen3VLProcessor's own."""
    from transformers import Qwen3VLProcessor

    class Qwen3VLProcessorWithoutVideo(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name in ("image_processor", "video_processor"):
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    template = chat_template or getattr(tokenizer, "chat_template", None)
    return Qwen3VLProcessorWithoutVideo(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template
    )


def read_chat_template(folder: Path) -> str | None:
    """A processor folder's chat template (chat_template.jinja, or chat_template.json's "chat_template")."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


def check_sides(h: int, w: int) -> None:
    if h % 2 or w % 2:
        raise ConfigError(
            f"A Qwen-Image 2.1 latent of {h}x{w} does not fill whole image slots (each stands for 2x2 latent pixels).",
            hint="Use buckets whose sides are multiples of 32 pixels (data.bucket_step: 32 or 64 does).",
        )


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h * w, C]: QwenImage21Pipeline._pack_latents (2.1 reads latents unpatched)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(1, 2)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack` for a latent of ``h`` x ``w``."""
    b, _, c = tokens.shape
    return tokens.transpose(1, 2).reshape(b, c, h, w)


def vae_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] -> normalised latents [B, 64, H/16, W/16] (float32): an opaque alpha channel
    (1.0) appended, the VAE's posterior mean of the one-frame video, ``(z - mean) / std`` per channel (the pipeline's
    ``_encode_vae_image``, argmax)."""
    if pixels.shape[1] == 3 and vae.config.in_channels == 4:
        pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    z = vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist.mode().float()
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(shape)
    return ((z - mean) / std).squeeze(2)


class QwenImage21(LLMImageFamily):
    name = "qwen-image-2.1"
    label = "Qwen-Image 2.1"
    config_prefix = "qwen-image-2.1"
    default_config = DEFAULT_CONFIG
    hub_example = "Qwen/Qwen-Image-2.1"
    text_stage = "qwen3vl"
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"qwen3vl": ("text_encoder",)}
    pipeline_class = "QwenImage21Pipeline"
    save_as: ClassVar[Mapping[str, str | tuple[str, str]]] = {
        "transformer": "QwenImage21Transformer2DModel",
        "vae": "AutoencoderKLQwenImage21",
        "text_encoder": ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
    }
    file_option: ClassVar[Mapping[str, str]] = {"vae": "ae", "text_encoder": "text_encoder"}
    part_labels: ClassVar[Mapping[str, str]] = {
        "transformer": "transformer",
        "vae": "VAE",
        "text_encoder": "Qwen3-VL text encoder",
    }
    file_examples: ClassVar[Mapping[str, str]] = {
        "vae": "the Qwen-Image 2.1 VAE's .safetensors (diffusers' names)",
        "text_encoder": "the Qwen3-VL-8B .safetensors",
    }
    encoder_name = "Qwen3-VL"
    file_markers = "txt_in.text_norm / modulation.1"
    single_file_hint = (
        "Give the parts' own files (model.ae, model.text_encoder, model.tokenizer_path: a folder with Qwen3-VL's "
        "tokenizer), or set model.path to a diffusers Qwen-Image 2.1 folder (Qwen/Qwen-Image-2.1)."
    )
    copied_folders: ClassVar[tuple[str, ...]] = ("tokenizer", "processor", "scheduler")
    repeated_blocks = ("QwenImage21TransformerBlock",)
    tiny_recipe = "tiny-qwen-image-2.1-lora"
    tiny_config = "qwen-image-2.1-tiny"
    #: latents read unpatched: one token per latent pixel (the dynamic shift counts them so)
    latent_patch = 1
    # not measured on Qwen-Image 2.1: FLUX.1's figures (a transformer of similar size)
    compile_cost: ClassVar[Mapping[str, float]] = common.FLUX_COMPILE_COST
    #: every Linear of the blocks: the attention's q, k, v and output, the SwiGLU's gate, up and down
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "img_mlp.gate_layer",
        "img_mlp.proj",
        "img_mlp.out",
    )
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("img_in", "txt_in*", "time_text_embed*", "modulation*", "norm_out*", "proj_out")
    }
    #: the kohya layout (lora_kohya.safetensors) is ComfyUI's: lora_unet_ + the module paths of ComfyUI's model, which
    #: are diffusers' but for the SwiGLU's gate and up, one ``img_mlp.gate_up`` there (gate rows first: diffusers'
    #: convert_qwen_image21_transformer_checkpoint_to_diffusers, "ComfyUI fuses the SwiGLU gate and up projections
    #: into a single GEMM"); ComfyUI maps lora_unet_ + a weight's module path for every model it loads
    modelspec_lora_architecture = "qwen-image-2.1/lora"
    single_file_prefixes: ClassVar[Mapping[str, str]] = {"transformer": PREFIX}

    def new_module(self, part: str, cfg: dict) -> torch.nn.Module:
        return _new_module(part, cfg)

    def diffusers_classes(self) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
        from transformers import Qwen3VLForConditionalGeneration

        return {
            "transformer": QwenImage21Transformer2DModel,
            "vae": AutoencoderKLQwenImage21,
            "text_encoder": Qwen3VLForConditionalGeneration,
        }

    def text_encoder_classes(self) -> tuple[Any, Any]:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        return Qwen3VLConfig, Qwen3VLForConditionalGeneration

    def text_encoder_tensors(
        self, keys: Sequence[str], get: Callable[[str], torch.Tensor], dtype: torch.dtype, device, quantized: bool
    ) -> dict[str, torch.Tensor]:
        """Qwen3-VL from a file of its own (the Hub checkpoint's names, or ``model.layers.*`` / ``visual.*``; fp8_scaled
        files too), in transformers' names for Qwen3VLForConditionalGeneration; a file without the head gets the
        embeddings as its (never used) head."""
        weights, real = common.scaled_fp8(keys, get)
        read = common.single_file_reader(real, dtype, device, quantized, False)
        sd = {vl_name(k): read(k) for k in weights}
        embed = "model.language_model.embed_tokens.weight"
        if "lm_head.weight" not in sd and embed in sd:
            sd["lm_head.weight"] = sd[embed]
        return sd

    def transformer_tensors(self, keys: Sequence[str], read) -> Any:
        """diffusers' names, ComfyUI's prefix or none; ComfyUI's fused ``img_mlp.gate_up`` split into ``gate_layer``
        and ``proj`` (gate rows first: diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers)."""
        for k in keys:
            name = k.removeprefix(PREFIX)
            if name.endswith("img_mlp.gate_up.weight"):
                gate, up = read(k).chunk(2, dim=0)
                yield name.replace("gate_up", "gate_layer"), gate
                yield name.replace("gate_up", "proj"), up
            else:
                yield name, read(k)

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name == "QwenImage21Pipeline"

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        return is_qwen_image21_file(keys)

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        return DEFAULT_CONFIG if is_qwen_image21_file(keys) else None

    def parts_in_single_file(self, keys: Sequence[str]) -> list[str]:
        return ["transformer"] if is_qwen_image21_file(keys) else []

    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """The transformer's modules by ComfyUI's paths: diffusers' own, but for ``img_mlp.gate_layer`` and
        ``img_mlp.proj``, which are one fused ``img_mlp.gate_up`` there (``kohya_fused``)."""
        if part != "transformer":
            raise ConfigError(f"Qwen-Image 2.1 LoRAs adapt the transformer only, not {part}.")
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        return common.adaptable_paths(module, lambda p: None if p.endswith(_SWIGLU) else p)

    def kohya_fused_groups(self, paths: Sequence[str]) -> Mapping[str, Sequence[str]]:
        """ComfyUI's ``...img_mlp.gate_up`` -> (gate_layer, proj), gate rows first."""
        mlps = [n.removesuffix(".gate_layer") for n in paths if n.endswith(".img_mlp.gate_layer")]
        return {f"{mlp}.gate_up": tuple(f"{mlp}.{m}" for m in _SWIGLU_MEMBERS) for mlp in mlps}

    # ------------------------------------------------------------ loading: the processor with the text encoder
    def tokenizer(self, kind: str, p: Path, mcfg: ModelConfig):
        """Qwen3-VL's tokenizer: a diffusers folder's processor/ (or tokenizer/), else model.tokenizer_path (its
        processor/ or tokenizer/, or itself)."""
        from transformers import AutoTokenizer

        base = p if kind == "diffusers" else (Path(mcfg.tokenizer_path).expanduser() if mcfg.tokenizer_path else None)
        if base is None:
            raise ModelLoadError(
                "Qwen3-VL's tokenizer is in no model file.",
                hint="Set model.tokenizer_path to a folder with Qwen3-VL's tokenizer (tokenizer.json, "
                "tokenizer_config.json: the processor/ folder of a diffusers Qwen-Image 2.1 download).",
            )
        folder = next((base / s for s in ("processor", "tokenizer") if (base / s).is_dir()), base)
        if not (folder / "tokenizer_config.json").is_file():
            raise ModelLoadError(
                f"No Qwen3-VL tokenizer in {folder} (no tokenizer_config.json).",
                hint="Point model.tokenizer_path at the processor/ folder of a diffusers Qwen-Image 2.1 download.",
            )
        tok = AutoTokenizer.from_pretrained(folder)
        tok.difftrain_chat_template = read_chat_template(folder)
        return tok

    def load(
        self,
        mcfg: ModelConfig,
        parts: Sequence[str],
        dtype: torch.dtype = torch.float32,
        device="cpu",
        precision: dict[str, str] | None = None,
        tokenizers: bool = True,
    ) -> dict[str, Any]:
        """As the other language-model families'; with the text encoder, a text-only Qwen3VLProcessor too (what the
        pipeline's prompt encoding tokenizes with)."""
        comps = super().load(mcfg, parts, dtype, device, precision, tokenizers)
        if "tokenizer" in comps:
            comps["processor"] = self.new_processor(comps["tokenizer"], mcfg)
        return comps

    def new_processor(self, tokenizer, mcfg: ModelConfig) -> Any:
        """The processor ``load`` gives beside the text encoder: text-only, with the folder's chat template."""
        return text_processor(tokenizer, getattr(tokenizer, "difftrain_chat_template", None))

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        return vae_latents(comps["vae"], pixels)

    def _text_pipeline(self, comps: dict[str, Any]):
        """QwenImage21Pipeline over the text encoder and processor alone: its own prompt encoding is what runs."""
        from diffusers import QwenImage21Pipeline

        processor = comps.get("processor") or text_processor(comps["tokenizer"])
        return QwenImage21Pipeline(
            scheduler=None, vae=None, text_encoder=comps["text_encoder"], processor=processor, transformer=None
        )

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, Any]:
        """qwen3vl -> prompt_embeds: per caption [L_i, 4096] (float32), QwenImage21Pipeline._get_qwen_prompt_embeds
        (the pre-norm last hidden state of the real tokens, the system prompt dropped) at each caption's own length.
        The pipeline does not cut long prompts, nor does this."""
        if stage != "qwen3vl":
            raise ConfigError(f"Qwen-Image 2.1 has no text stage {stage!r}.", hint="Its one stage is qwen3vl.")
        pipe = self._text_pipeline(comps)
        device = comps["text_encoder"].device
        embeds, mask, _ = pipe._get_qwen_prompt_embeds(captions, None, device)
        return {"prompt_embeds": [embeds[i][mask[i].bool()].float() for i in range(len(captions))]}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"qwen3vl:{options.llm.precision}:prenorm:qwen-image-2.1-t2i-template" if stage == "qwen3vl" else ""

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction (noise - x0) for noisy latents [B, 64, h, w] as QwenImage21Pipeline calls the
        transformer for a prompt: the latents unpatched, the caption's rows unpadded, ``img_mask`` False over them
        and one slot per 2x2 target tokens after, the latent grid as ``img_shapes``, sigma as the timestep; the
        target's tokens of the output. Captions of different lengths run as one call each (see the module's doc)."""
        h, w = noisy.shape[-2:]
        check_sides(h, w)
        text, lengths = batch["prompt_embeds"], batch["prompt_length"].to("cpu")
        out = torch.empty_like(noisy)
        for n in sorted({int(x) for x in lengths}):
            rows = (lengths == n).nonzero(as_tuple=True)[0]
            idx = rows.to(noisy.device)
            k = len(rows)
            img_mask = torch.cat(
                [
                    torch.zeros(k, n, dtype=torch.bool, device=noisy.device),
                    torch.ones(k, h * w // 4, dtype=torch.bool, device=noisy.device),
                ],
                dim=1,
            )
            pred = transformer(
                hidden_states=pack(noisy[idx]),
                timestep=(timesteps[idx] / 1000).to(noisy.dtype),
                encoder_hidden_states=text[idx, :n],
                img_shapes=[[(1, h, w)]] * k,
                img_mask=img_mask,
                return_dict=False,
            )[0]
            out[idx] = unpack(pred[:, -h * w :], h, w).to(out.dtype)
        return out

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    # ------------------------------------------------------------ pipelines and export
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        """QwenImage21Pipeline over the loaded parts (``pipeline_processor``'s), with the model's scheduler."""
        from diffusers import QwenImage21Pipeline

        return QwenImage21Pipeline(
            scheduler=self.training_scheduler(mcfg),
            vae=comps["vae"],
            text_encoder=comps["text_encoder"],
            processor=self.pipeline_processor(comps, mcfg),
            transformer=comps["transformer"],
        )

    def pipeline_processor(self, comps: dict[str, Any], mcfg: ModelConfig) -> Any:
        """The pipeline's processor: the loaded one, else a text-only one over the tokenizer."""
        return comps.get("processor") or text_processor(comps["tokenizer"])

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """The transformer in ComfyUI's names (diffusers' with each SwiGLU's gate and up as one ``img_mlp.gate_up``,
        gate rows first, concatenated only as it is written), which ComfyUI, diffusers' from_single_file and ``load``
        all read; one tensor at a time, atomically."""
        from ...utils import stream_save_safetensors

        if "transformer" not in sds:
            raise CheckpointError("A Qwen-Image 2.1 single file holds the transformer, and none was given.")
        return stream_save_safetensors(
            path,
            common.LazyTensors(comfy_names(sds["transformer"])),
            metadata={"format": "pt", "modelspec.architecture": "qwen-image-2.1"},
            dtype=dtype,
        )

    # ------------------------------------------------------------ tests and benchmarks
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded Qwen-Image 2.1 of the real layout, with an offline byte-level tokenizer that has Qwen's vision
        tokens; the processor folder written as Qwen3VLProcessor's tokenizer and chat template (transformers cannot
        save a processor without its image and video processors)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
        from transformers import AutoTokenizer

        from ..tokenizers import tiny_qwen_tokenizer

        folder = Path(folder)
        cfgdir = self.bundled(self.tiny_config)
        torch.manual_seed(seed)
        comps: dict[str, Any] = {
            part: self.new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS
        }
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            tok = AutoTokenizer.from_pretrained(tiny_qwen_tokenizer(tokdir, vision=True))
            tok.chat_template = TINY_CHAT_TEMPLATE
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                _read_json(cfgdir / "scheduler" / "scheduler_config.json")
            )
            pipe: Any = QwenImage21Pipeline(scheduler=sched, processor=text_processor(tok), **comps)
            pipe.processor = None
            pipe.register_to_config(processor=(None, None))
            pipe.save_pretrained(folder, safe_serialization=True)
            tok.save_pretrained(folder / "processor")
            (folder / "processor" / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
            # Qwen3-VL's image processor settings, as a Qwen3VLProcessor folder holds them (qwen-image-2.1-edit
            # hands the references to it; text-to-image never reads them)
            shutil.copy(cfgdir / "processor" / "preprocessor_config.json", folder / "processor")
        finally:
            shutil.rmtree(tokdir, ignore_errors=True)
        index = _read_json(folder / "model_index.json")
        index["processor"] = ["transformers", "Qwen3VLProcessor"]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        return folder

    def cache_shapes(
        self, config_name: str, resolution: int, caption_tokens: int = 128
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item: the latents at a square ``resolution``, a caption of ``caption_tokens`` rows."""
        cfgdir = self.bundled(config_name)
        tr = _read_json(cfgdir / "transformer" / "config.json")
        vae = _read_json(cfgdir / "vae" / "config.json")
        side = resolution // common.spatial_factor(vae)
        return {
            "latent": {"latents": (vae["z_dim"], side, side), "crop": (2,)},
            "qwen3vl": {"prompt_embeds": (caption_tokens, tr["context_in_dim"])},
        }
