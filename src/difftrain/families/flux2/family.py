"""FLUX.2 (Black Forest Labs, 2025-26): an MMDiT (double-stream blocks, then single-stream blocks with fused
projections) on the 32-channel FLUX.2 VAE's latents, conditioned by three hidden layers of a language model.

Three bundled architectures (``model.config``), checked on the meta device against diffusers' and transformers'
classes (tests/unit/test_flux2_family.py):

- flux2-klein-4b: a 3.88B transformer (5 double, 20 single blocks of 3 072), Qwen3-4B's layers 9, 18, 27;
- flux2-klein-9b: a 9.08B transformer (8 double, 24 single blocks of 4 096), Qwen3-8B's layers 9, 18, 27;
- flux2-dev: a 32.2B guidance-distilled transformer (8 double, 48 single blocks of 6 144), Mistral-Small-3's (24.0B,
  Mistral3ForConditionalGeneration) layers 10, 20, 30.

Loads offline from a diffusers folder (or a Hub id: black-forest-labs/FLUX.2-klein-base-4B, ...), or from the files
ComfyUI users have: the transformer alone in Black Forest Labs' names (``single_file``; fp8-stored ones too) as
model.path, the VAE as model.ae (diffusers' names, or BFL's flux2-vae.safetensors), klein's Qwen3 as
model.text_encoder (qwen_3_4b.safetensors / qwen_3_8b.safetensors, transformers' names) with its tokenizer folder as
model.tokenizer_path; [dev]'s Mistral 3 from a diffusers folder or ComfyUI's mistral_3_small_flux2_bf16.safetensors
(mistral_file.py; with the tokenizer folder of the diffusers repository as model.tokenizer_path).

Trained with rectified flow as Flux2Pipeline / Flux2KleinPipeline run the transformer and the diffusers Flux.2 LoRA
scripts train it: the VAE's posterior mean cut into 2x2 patches (128 channels), normalised by the VAE's batch-norm
statistics ((z - running_mean) / sqrt(running_var + eps)), cached as 32 channels at 1/8 (the patching undone, so the
buckets and the shift are counted as for the other 2x2 families) and patched again by ``denoise``; the patches packed
one token each with the pipeline's 4-axis position ids (0, row, column, 0) and the text's (0, 0, 0, index); sigma as
the timestep (the model scales it by 1000); a prediction of noise - x0. The noise level's shift follows the image's
token count (the scheduler's use_dynamic_shifting: mu from 0.5 at 256 tokens to 1.15 at 4096, musubi-tuner's
flux2_shift); the pipeline's own inference mu (compute_empirical_mu) depends on its step count and is not a training
quantity. [dev] takes a guidance value (flow.guidance_scale, 1.0 by default as for FLUX.1 [dev]); klein has no
guidance embedding.

The text: the caption in the pipeline's chat template (klein: one user turn, the generation prompt, thinking off;
[dev]: BFL's system message and the user turn), padded to 512 tokens, the tapped layers' states stacked per token
(the pipelines' ``_get_qwen3_prompt_embeds`` / ``_get_mistral_3_small_prompt_embeds``, called as they are). The
transformer sees all 512 rows unmasked, padding included, so they are cached whole: [512, 3 x width] a caption (15.7
MB for klein 4B in float32, as precompute stores every text entry; 25 MB for 9B, 31 MB for [dev]).

FLUX.2 [klein] 4B / 9B without ``-base`` are step-distilled (4 steps, no CFG; their model_index.json says
``is_distilled``): training on them is warned about, naming the base checkpoints BFL says to train on.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError, ModelLoadError
from .. import common
from ..base import host_stack
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..llm_image import PARTS, LLMImageFamily, check_2x2
from . import mistral_file, single_file

DEFAULT_CONFIG = "flux2-klein-4b"
#: build_random stores a random transformer larger than this (in bf16) in fp8: FLUX.2 dev's 64 GB of bf16 filled the
#: 64 GiB disk of the one-GPU machine it was to be measured on (2026-11-28); in fp8 it is 32 GB. Training loads it as
#: it loads the fp8 files people download (cast up, then stored as the config says), so the memory measured is the same
RANDOM_FP8_ABOVE_BYTES = 48 * 2**30
#: the tokens a caption is encoded with, template included (the pipelines' max_sequence_length)
TEXT_TOKENS = 512
#: the hidden states each pipeline stacks (its text_encoder_out_layers default; 0 is the embeddings)
KLEIN_LAYERS = (9, 18, 27)
DEV_LAYERS = (10, 20, 30)
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
#: a chat template for the tiny [dev] test model (a byte-level tokenizer): Mistral 3's turns for a system and a user
#: message whose contents are lists of text parts, as Flux2Pipeline's format_input builds them
TINY_DEV_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' }}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{{ '[/SYSTEM_PROMPT]' }}{% else %}"
    "{{ '[INST]' }}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{{ '[/INST]' }}{% endif %}"
    "{% endfor %}"
)


def is_dev_config(cfg: Mapping[str, Any]) -> bool:
    """A text encoder config is [dev]'s Mistral 3 (else klein's Qwen3)."""
    return cfg.get("model_type") == "mistral3"


def _language_model(cfg: Mapping[str, Any]) -> Any:
    """The language model's part of a text encoder config: [dev]'s text_config, klein's whole config."""
    return cfg.get("text_config", cfg) if is_dev_config(cfg) else cfg


def precompute_layers(cfg: Mapping[str, Any]) -> int:
    """The decoder layers of the text encoder precompute runs: up to the deepest hidden state the pipeline stacks
    (hidden state k is the input of layer k + 1: the last one a model returns is after its final norm, so one layer
    more than the tap), and no further: 31 of [dev]'s 40, 28 of klein's 36."""
    taps = DEV_LAYERS if is_dev_config(cfg) else KLEIN_LAYERS
    return min(int(_language_model(cfg)["num_hidden_layers"]), max(taps) + 1)


def cut_text_config(cfg: Mapping[str, Any]) -> dict:
    """The text encoder's config with only the layers precompute runs (``precompute_layers``).

    Why: the pipelines stack three intermediate hidden states, so the layers after the deepest one (and [dev]'s
    final norm) compute nothing they take; each layer sees only those before it, so the stacked states are bit for bit
    the whole model's (tests/unit/test_flux2_family.py). [dev]'s Mistral 3 is 5 B parameters lighter (2.5 GiB in
    nf4: its precompute fits a 16 GB card), klein's Qwen3 22 %. transformers loads such a config from the whole
    checkpoint, leaving the rest of the layers unread."""
    import copy

    out = copy.deepcopy(dict(cfg))
    keep = precompute_layers(cfg)
    text = _language_model(out)
    text["num_hidden_layers"] = keep
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:keep]
    return out


def _layer(key: str) -> int | None:
    """The decoder layer a klein Qwen3 file's tensor belongs to (``model.layers.7.mlp...``: 7), else None."""
    m = _LAYER.match(key)
    return int(m.group(1)) if m else None


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    if part == "transformer":
        return Flux2Transformer2DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKLFlux2.from_config(cfg)
    if is_dev_config(cfg):
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        return Mistral3ForConditionalGeneration(Mistral3Config(**_hf_config(cfg)))
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(**_hf_config(cfg)))


class _TextEncoder:
    """The text encoder's class as its folder's config names it: klein's Qwen3 (read as Qwen3Model: the hidden states
    are all the pipeline takes, and a file without the head loads alike) or [dev]'s Mistral3ForConditionalGeneration
    (the pipeline's class)."""

    @staticmethod
    def from_pretrained(p, subfolder: str = "text_encoder", **kwargs):
        """The folder's text encoder with the layers precompute runs (``cut_text_config``)."""
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3Model

        cfg = _read_json(Path(p) / subfolder / "config.json")
        dev = is_dev_config(cfg)
        config = (Mistral3Config if dev else Qwen3Config)(**_hf_config(cut_text_config(cfg)))
        cls: Any = Mistral3ForConditionalGeneration if dev else Qwen3Model
        left = range(precompute_layers(cfg), int(_language_model(cfg)["num_hidden_layers"]))
        if not left:
            return cls.from_pretrained(p, subfolder=subfolder, config=config, **kwargs)
        # the layers left out are not read, and not listed in transformers' load report as unexpected: its ignore list
        # set on the class for this load (a subclass would lose transformers' renaming of older checkpoints' keys)
        own = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
        cls._keys_to_ignore_on_load_unexpected = [*(own or []), rf"layers\.({'|'.join(map(str, left))})\."]
        try:
            return cls.from_pretrained(p, subfolder=subfolder, config=config, **kwargs)
        finally:
            if own is None and "_keys_to_ignore_on_load_unexpected" in cls.__dict__:
                del cls._keys_to_ignore_on_load_unexpected
            else:
                cls._keys_to_ignore_on_load_unexpected = own


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, 4C, h/2, w/2] (the pipelines' _patchify_latents)."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._patchify_latents(latents)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`patchify` (the pipelines' _unpatchify_latents)."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._unpatchify_latents(latents)


class Flux2(LLMImageFamily):
    name = "flux2"
    label = "FLUX.2"
    config_prefix = "flux2"
    default_config = DEFAULT_CONFIG
    hub_example = "black-forest-labs/FLUX.2-klein-base-4B"
    text_stage = "llm"
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"llm": ("text_encoder",)}
    #: the LoRA files' pipeline (Flux2Pipeline's loader is the same mixin: either reads them)
    pipeline_class = "Flux2KleinPipeline"
    save_as: ClassVar[Mapping[str, str | tuple[str, str]]] = {
        "transformer": "Flux2Transformer2DModel",
        "vae": "AutoencoderKLFlux2",
        "text_encoder": ("Qwen3Model", "qwen3"),
    }
    file_option: ClassVar[Mapping[str, str]] = {"vae": "ae", "text_encoder": "text_encoder"}
    part_labels: ClassVar[Mapping[str, str]] = {
        "transformer": "transformer",
        "vae": "VAE",
        "text_encoder": "text encoder",
    }
    file_examples: ClassVar[Mapping[str, str]] = {
        "vae": "flux2-vae.safetensors",
        "text_encoder": "qwen_3_4b.safetensors for klein 4B, qwen_3_8b.safetensors for 9B, "
        "mistral_3_small_flux2_bf16.safetensors for [dev]",
    }
    encoder_name = "the language model"
    file_markers = "single_stream_modulation.lin / double_blocks / single_blocks"
    single_file_hint = (
        "Give the parts' own files as ComfyUI users have them (model.ae=flux2-vae.safetensors; klein: "
        "model.text_encoder=qwen_3_4b.safetensors and model.tokenizer_path=a folder with Qwen3's tokenizer), or set "
        "model.path to a diffusers FLUX.2 folder."
    )
    distilled_warning = (
        "this is a step-distilled FLUX.2 [klein] checkpoint (4 steps, no CFG); training on it wears its distillation "
        "away. BFL's guidance: train on the base model (black-forest-labs/FLUX.2-klein-base-4B or -base-9B, "
        "flux-2-klein-base-*.safetensors) and use the LoRA on the distilled one."
    )
    repeated_blocks = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")
    tiny_recipe = "tiny-flux2-lora"
    tiny_config = "flux2-tiny"
    avoid_cudnn_attention = True  # FLUX.1's cuDNN attention backward failed at 1024 px: not tried on FLUX.2
    # not measured on FLUX.2: FLUX.1's figures (klein 9B is about its size; [dev] is 2.7x, 4B a third)
    compile_cost: ClassVar[Mapping[str, float]] = common.FLUX_COMPILE_COST
    #: both streams' attention and MLPs of the double blocks, the single blocks' fused projections (attention and
    #: MLP in and out), as the diffusers FLUX.2 LoRA scripts and ai-toolkit train them. The single blocks' output
    #: projection is named by its path: a bare "attn.to_out" is the double blocks' ModuleList too
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
        *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)),
    )
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": (
            "x_embedder",
            "context_embedder",
            "time_guidance_embed*",
            "double_stream_modulation_*",
            "single_stream_modulation*",
            "norm_out*",
            "proj_out",
        )
    }
    #: ComfyUI's FLUX.2 LoRA names: lora_unet_ + BFL's module path, a double block's q/k/v as its fused qkv
    #: (diffusers' kohya FLUX.2 converter reads the same)
    kohya_base_version = "flux2"
    modelspec_lora_architecture = "flux-2/lora"
    single_file_prefixes: ClassVar[Mapping[str, str]] = {"transformer": single_file.PREFIX}

    def new_module(self, part: str, cfg: dict) -> torch.nn.Module:
        return _new_module(part, cfg)

    # ------------------------------------------------------------ sources and variants
    def architecture(self, mcfg: ModelConfig) -> str:
        """model.config, else the bundled architecture a transformer file's blocks or a folder's transformer config
        match, else klein 4B."""
        if mcfg.config or mcfg.path is None:
            return mcfg.config or DEFAULT_CONFIG
        kind, p = self._source(mcfg)
        if kind == "diffusers":
            cfg = p / "transformer" / "config.json"
            found = self._matching(_read_json(cfg)) if cfg.is_file() else None
        else:
            found = self.single_file_architecture(common.open_checkpoint(kind, p)[0])
        return found or DEFAULT_CONFIG

    def _matching(
        self, tr: Mapping[str, Any], keys: Sequence[str] = ("num_layers", "num_single_layers", "num_attention_heads")
    ) -> str | None:
        """The bundled real architecture whose transformer has ``tr``'s block counts and width (``keys``)."""
        for name in self.known_configs():
            if "tiny" in name:
                continue
            bundled = _read_json(self.bundled(name) / "transformer" / "config.json")
            if all(bundled.get(k) == tr.get(k) for k in keys):
                return name
        return None

    def is_dev(self, mcfg: ModelConfig) -> bool:
        """[dev] (Mistral 3, guidance-distilled), else klein (Qwen3)."""
        return is_dev_config(self.part_config(mcfg, "text_encoder"))

    def pipeline_config(self, mcfg: ModelConfig) -> dict:
        p = self._folder(mcfg)
        if p is not None and (p / "model_index.json").exists():
            return _read_json(p / "model_index.json")
        return _read_json(self.bundled(self.architecture(mcfg)) / "model_index.json")

    def distilled(self, mcfg: ModelConfig) -> bool:
        """A folder's model_index.json says is_distilled (Flux2KleinPipeline's flag); a file's name is klein's
        without -base (flux-2-klein-4b.safetensors, not flux-2-klein-base-4b)."""
        if self._folder(mcfg) is not None:
            return bool(self.pipeline_config(mcfg).get("is_distilled"))
        name = Path(str(mcfg.path or "")).name.lower()
        return "klein" in name and "base" not in name

    def diffusers_classes(self) -> dict[str, Any]:
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

        return {"transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2, "text_encoder": _TextEncoder}

    def text_encoder_classes(self) -> tuple[Any, Any]:
        """klein's Qwen3 (an own text-encoder file of [dev] is read through mistral_file.py's folder)."""
        from transformers import Qwen3Config, Qwen3Model

        return Qwen3Config, Qwen3Model

    def tokenizer(self, kind: str, p: Path, mcfg: ModelConfig):
        """klein: Qwen3's tokenizer. [dev]: the folder's Mistral 3 processor where it has one (what Flux2Pipeline
        takes), else its tokenizer."""
        tok = super().tokenizer(kind, p, mcfg)
        if self.is_dev(mcfg):
            from transformers import AutoProcessor

            base = p if kind == "diffusers" else Path(mcfg.tokenizer_path or p).expanduser()
            folder = base / "tokenizer" if (base / "tokenizer").is_dir() else base
            if any((folder / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
                return AutoProcessor.from_pretrained(folder)
        return tok

    def part_config(self, mcfg: ModelConfig, part: str) -> dict:
        """A part's config; the text encoder's with the layers precompute runs (``cut_text_config``), which is the
        model loaded, built and planned."""
        cfg = super().part_config(mcfg, part)
        return cut_text_config(cfg) if part == "text_encoder" else cfg

    def text_encoder_tensors(
        self, keys: Sequence[str], get: Callable[[str], torch.Tensor], dtype: torch.dtype, device, quantized: bool
    ) -> dict[str, torch.Tensor]:
        """klein's Qwen3 file, its layers after the ones precompute runs left unread (``cut_text_config``)."""
        keep = max(KLEIN_LAYERS) + 1
        kept = [k for k in keys if (n := _layer(k)) is None or n < keep]
        return super().text_encoder_tensors(kept, get, dtype, device, quantized)

    def load_part_file(self, part: str, f: Path, mcfg: ModelConfig, dtype: torch.dtype, device, quant: str | None):
        if part == "text_encoder" and self.is_dev(mcfg):
            # ComfyUI's Mistral 3 file, rewritten as a folder transformers reads shard by shard (mistral_file.py:
            # as a state dict it would hold 38 GB in host memory before quantizing)
            cfg = self.part_config(mcfg, part)
            with mistral_file.as_folder(f, cfg, precompute_layers(cfg), dtype) as folder:
                return common.load_diffusers_parts(
                    folder,
                    [part],
                    {part: _TextEncoder},
                    {part: dtype},
                    device,
                    lambda _: "",
                    {part: quant} if quant is not None else None,
                )[part]
        return super().load_part_file(part, f, mcfg, dtype, device, quant)

    def vae_tensors(self, sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
        """diffusers' names, or BFL's flux2-vae.safetensors: the LDM autoencoder's names with the quant convs inside
        the encoder and decoder and the batch norm's statistics (diffusers' LDM converter, those moved around it)."""
        sd = {k.removeprefix("vae."): v for k, v in sd.items()}
        if "encoder.down.0.block.0.conv1.weight" not in sd:
            return sd
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

        moved = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
        ldm = {}
        for k, v in sd.items():
            for a, b in moved.items():
                if k.startswith(a):
                    k = b + k[len(a) :]
            ldm[k] = v
        out = convert_ldm_vae_checkpoint({k: v for k, v in ldm.items() if not k.startswith("bn.")}, config)
        out.update({k: v for k, v in ldm.items() if k.startswith("bn.")})
        return out

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """As the base's, after checking that a file given as model.path is a FLUX.2 transformer: the cache's keys
        are made before anything loads, and a FLUX.1 file (the same block names) would otherwise be asked for parts
        it was never meant to have."""
        kind, p = self._source(mcfg)
        if kind != "diffusers" and not self.recognises_single_file(common.open_checkpoint(kind, p)[0]):
            raise ModelLoadError(
                f"{p.name} does not look like a FLUX.2 transformer (no {self.file_markers}).",
                hint="Give the FLUX.2 transformer file (flux-2-klein-base-4b.safetensors, flux2-dev.safetensors, fp8 "
                "copies too) or a diffusers FLUX.2 folder; a FLUX.1 file needs family: flux.",
            )
        return super().fingerprint(mcfg, part, memo)

    def transformer_tensors(self, keys: Sequence[str], read) -> Any:
        return single_file.transformer_tensors(keys, read)

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name.startswith("Flux2")

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        return single_file.is_flux2_file(keys)

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        """The bundled architecture with a transformer file's double and single block counts."""
        if not single_file.is_flux2_file(keys):
            return None
        doubles, singles = single_file.block_counts(keys)
        return self._matching(
            {"num_layers": doubles, "num_single_layers": singles}, ("num_layers", "num_single_layers")
        )

    def parts_in_single_file(self, keys: Sequence[str]) -> list[str]:
        return ["transformer"] if single_file.is_flux2_file(keys) else []

    # ------------------------------------------------------------ LoRA names
    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """The transformer's modules by BFL's paths (``double_blocks.0.img_attn.proj``), as ComfyUI names them; a
        double block's q, k and v are one fused ``qkv`` there (``kohya_fused``)."""
        if part != "transformer":
            raise ConfigError(f"FLUX.2 LoRAs adapt the transformer only, not {part}.")
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        # the final modulation's output halves are in the other order in BFL's layout: a LoRA on it has no kohya name
        return common.adaptable_paths(
            module, lambda path: None if path == "norm_out.linear" else single_file.module_to_original(path)
        )

    def kohya_fused_groups(self, paths: Sequence[str]) -> Mapping[str, Sequence[str]]:
        """BFL's ``double_blocks.N.{img,txt}_attn.qkv`` -> its q, k and v modules."""
        return single_file.fused_qkv(paths)

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> [B, 32, H/8, W/8] float32: the posterior mean (the pipelines' argmax),
        cut into 2x2 patches, normalised by the VAE's batch-norm statistics as the pipelines' _encode_vae_image does,
        the patching undone."""
        vae = comps["vae"]
        z = patchify(vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode().float())
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, torch.float32)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).to(z.device, torch.float32) + vae.config.batch_norm_eps)
        return unpatchify((z - mean) / std)

    def _caption_lengths(self, tok, captions: list[str], dev: bool) -> list[int]:
        """Each caption's tokens in the pipeline's template, untruncated (for the warning about long ones)."""
        if dev:
            from diffusers.pipelines.flux2.pipeline_flux2 import format_input
            from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

            texts = tok.apply_chat_template(
                format_input(prompts=captions, system_message=SYSTEM_MESSAGE),
                add_generation_prompt=False,
                tokenize=False,
            )
        else:
            texts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True, enable_thinking=False
                )
                for c in captions
            ]
        inner = getattr(tok, "tokenizer", tok)  # a processor's tokenizer
        return [len(ids) for ids in inner(list(texts), add_special_tokens=False).input_ids]

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, Any]:
        """llm -> prompt_embeds [B, 512, 3 x width] (float32): the pipeline's own text encoding (klein:
        Flux2KleinPipeline._get_qwen3_prompt_embeds, layers 9, 18, 27; [dev]:
        Flux2Pipeline._get_mistral_3_small_prompt_embeds with BFL's system message, layers 10, 20, 30)."""
        if stage != "llm":
            raise ConfigError(f"FLUX.2 has no text stage {stage!r}.", hint="Its one stage is llm.")
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        tok, te = comps["tokenizer"], comps["text_encoder"]
        dev = is_dev_config(te.config.to_dict())
        self.warn_long(captions, self._caption_lengths(tok, captions, dev), TEXT_TOKENS, TEXT_TOKENS, "text")
        with torch.no_grad():
            if dev:
                from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

                states = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
                    te,
                    tok,
                    captions,
                    max_sequence_length=TEXT_TOKENS,
                    system_message=SYSTEM_MESSAGE,
                    hidden_states_layers=DEV_LAYERS,
                )
            else:
                states = Flux2KleinPipeline._get_qwen3_prompt_embeds(
                    te, tok, captions, max_sequence_length=TEXT_TOKENS, hidden_states_layers=KLEIN_LAYERS
                )
        return {"prompt_embeds": states.float()}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"llm:{options.llm.precision}:{TEXT_TOKENS}:flux2-taps" if stage == "llm" else ""

    def collate_text(
        self, stage: str, entries: list[dict[str, torch.Tensor]], pin: bool = False
    ) -> dict[str, torch.Tensor]:
        """Every caption is 512 rows (the padding is part of what the transformer sees): stacked."""
        return {k: host_stack([e[k] for e in entries], pin) for k in entries[0]}

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The flow prediction (noise - x0) for noisy latents [B, 32, h, w]: patched to [B, 128, h/2, w/2], packed
        one token a patch with the pipeline's position ids, sigma as the timestep, [dev]'s guidance value, and
        unpacked and unpatched back."""
        from diffusers import Flux2Pipeline

        b, _, h, w = noisy.shape
        check_2x2("FLUX.2", h, w)
        x = patchify(noisy)
        text = batch["prompt_embeds"]
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=noisy.device, dtype=torch.float32)
        out = transformer(
            hidden_states=Flux2Pipeline._pack_latents(x),
            timestep=(timesteps / 1000).to(noisy.dtype),
            guidance=guidance,
            encoder_hidden_states=text,
            txt_ids=Flux2Pipeline._prepare_text_ids(text).to(noisy.device),
            img_ids=Flux2Pipeline._prepare_latent_ids(x).to(noisy.device),
            return_dict=False,
        )[0]
        # the pipeline scatters the tokens back by their ids; in order, that is the packing's inverse
        return unpatchify(out.transpose(1, 2).reshape(x.shape))

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    # ------------------------------------------------------------ pipelines and export
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        """Flux2Pipeline for [dev], Flux2KleinPipeline (with the checkpoint's is_distilled) for klein."""
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        parts = {k: comps[k] for k in ("vae", "text_encoder", "tokenizer", "transformer")}
        if self.is_dev(mcfg):
            return Flux2Pipeline(scheduler=self.training_scheduler(mcfg), **parts)
        distilled = bool(self.pipeline_config(mcfg).get("is_distilled", False))
        return Flux2KleinPipeline(scheduler=self.training_scheduler(mcfg), is_distilled=distilled, **parts)

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """The transformer in BFL's names (what ComfyUI's diffusion-model loader reads, and ``load`` reads back),
        a fused qkv concatenated only while it is written; one tensor at a time, atomically."""
        from ...utils import stream_save_safetensors
        from ..common import LazyTensors

        if "transformer" not in sds:
            raise CheckpointError("A FLUX.2 single file holds the transformer, and none was given.")
        tensors = LazyTensors(single_file.to_single_file(sds["transformer"]))
        guided = (configs.get("transformer") or {}).get("guidance_embeds", False)
        arch = "flux-2-dev" if guided else "flux-2-klein"
        return stream_save_safetensors(
            path, tensors, metadata={"format": "pt", "modelspec.architecture": arch}, dtype=dtype
        )

    # ------------------------------------------------------------ tests and benchmarks
    def build_tiny(self, folder: Path, seed: int = 0, config: str | None = None) -> Path:
        """A tiny seeded FLUX.2 of the real layout saved as its pipeline saves it: klein-like (flux2-tiny: Qwen3 as
        Qwen3ForCausalLM) or [dev]-like (flux2-tiny-dev: Mistral 3, guidance), a byte-level tokenizer, and the VAE's
        batch-norm statistics drawn (a fresh one's are 0 and 1, which would hide the normalisation)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline
        from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

        from ..tokenizers import tiny_qwen_tokenizer

        folder = Path(folder)
        cfgdir = self.bundled(config or self.tiny_config)
        torch.manual_seed(seed)
        cfgs = {part: _read_json(cfgdir / part / "config.json") for part in PARTS}
        dev = is_dev_config(cfgs["text_encoder"])
        comps: dict[str, Any] = {part: _new_module(part, cfgs[part]) for part in ("transformer", "vae")}
        if dev:
            comps["text_encoder"] = _new_module("text_encoder", cfgs["text_encoder"])
        else:
            comps["text_encoder"] = Qwen3ForCausalLM(Qwen3Config(**_hf_config(cfgs["text_encoder"])))
        bn = comps["vae"].bn
        bn.running_mean.copy_(0.3 * torch.randn_like(bn.running_mean))
        bn.running_var.copy_(0.5 + torch.rand_like(bn.running_var))
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            tok = AutoTokenizer.from_pretrained(tiny_qwen_tokenizer(tokdir))
            if dev:
                tok.chat_template = TINY_DEV_CHAT_TEMPLATE
            comps["tokenizer"] = tok
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                _read_json(cfgdir / "scheduler" / "scheduler_config.json")
            )
            if dev:
                pipe: Any = Flux2Pipeline(scheduler=sched, **comps)
            else:
                pipe = Flux2KleinPipeline(scheduler=sched, is_distilled=False, **comps)
            pipe.save_pretrained(folder, safe_serialization=True)
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
        """Random bf16 weights of a bundled architecture as a diffusers folder (configs, scheduler and
        model_index.json; no tokenizer: benchmarks give stand-ins), the text encoder saved as its class. A transformer
        over RANDOM_FP8_ABOVE_BYTES in bf16 (FLUX.2 dev's 32 B: 64 GB) is stored in fp8, as the fp8 files people
        download are: loaded, it is cast up as theirs is."""
        from ...utils import atomic_dir

        cfgdir = self.bundled(config_name)
        comps = common.random_parts(self.new_module, cfgdir, parts, device, seed)
        configs = self.module_configs(comps)
        dev = is_dev_config(_read_json(cfgdir / "text_encoder" / "config.json"))
        save_as = (
            {**self.save_as, "text_encoder": ("Mistral3ForConditionalGeneration", "mistral3")} if dev else self.save_as
        )
        with atomic_dir(Path(path)) as tmp:
            for part, m in comps.items():
                big = sum(p.numel() for p in m.parameters()) * 2 > RANDOM_FP8_ABOVE_BYTES
                dtype = torch.float8_e4m3fn if part == "transformer" and big else torch.bfloat16
                common.write_part(tmp, part, m.state_dict(), configs[part], dtype, save_as[part])
            shutil.copytree(cfgdir / "scheduler", tmp / "scheduler")
            shutil.copy(cfgdir / "model_index.json", tmp / "model_index.json")
        return Path(path)

    def cache_shapes(self, config_name: str, resolution: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item: the latents at a square ``resolution`` and a caption's 512 rows."""
        cfgdir = self.bundled(config_name)
        tr = _read_json(cfgdir / "transformer" / "config.json")
        vae = _read_json(cfgdir / "vae" / "config.json")
        side = resolution // 8
        return {
            "latent": {"latents": (vae["latent_channels"], side, side), "crop": (2,)},
            "llm": {"prompt_embeds": (TEXT_TOKENS, tr["joint_attention_dim"])},
        }
