"""Stable Diffusion 3 / 3.5: an MMDiT on 16-channel VAE latents, conditioned by CLIP-L, CLIP-G and T5-XXL.

Loads offline from a diffusers folder, or from a single-file checkpoint in the
layout SD3 checkpoints are distributed in (see ``single_file``), using the
architecture configs bundled in ``configs/`` (sd3-medium, sd3.5-medium,
sd3.5-large; sd3-tiny for tests). Trained with rectified flow
(``objective = "flow"``): the denoiser sees ``x_t = (1 - s) x0 + s noise`` and
``timestep = s * 1000``.

The three text encoders are three precompute stages (``text_stages``), each
cached on its own: the T5-XXL encoder (4.7B parameters) is loaded alone, in
int8/nf4 through bitsandbytes on CUDA or in a float type, and never while the
CLIPs or the transformer are loaded. ``combine_texts`` joins the stages (cached,
or encoded on the fly when a CLIP trains) into the denoiser inputs exactly as
``StableDiffusion3Pipeline.encode_prompt`` does:

    prompt_embeds        = cat([pad(cat([clip_l, clip_g], -1), to T5's width), t5], dim=seq)
                           [B, 77 + t5 tokens, joint_attention_dim]
    pooled_prompt_embeds = cat([clip_l_pooled, clip_g_pooled], -1)   [B, 2048]

With T5 disabled (``text_encoders.t5.enabled: false``) the T5 stage is never
run and its part is zeros of [B, text_encoders.t5.max_length, joint_attention_dim],
as the pipeline does with ``text_encoder_3=None``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError, ModelLoadError
from ...utils import atomic_dir, stream_save_safetensors
from .. import common, streaming
from ..base import CachedItem, ModelFamily
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..tokenizers import tiny_clip_vocab, tiny_t5_tokenizer
from . import single_file

PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
DEFAULT_CONFIG = "sd3-medium"
#: the tokenizer each text encoder needs
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
CLIP_TOKENS = 77
#: T5 tokens SD3 was trained with (StableDiffusion3Pipeline's default max_sequence_length)
DEFAULT_T5_TOKENS = 256
#: the width of SD3's joint text sequence (T5-XXL's d_model) in every released SD3/SD3.5 model
DEFAULT_JOINT_DIM = 4096
#: how save_diffusers writes each part: a diffusers class, or a transformers (architecture, model_type)
SAVE_AS: dict[str, str | tuple[str, str]] = {
    "transformer": "SD3Transformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": ("CLIPTextModelWithProjection", "clip_text_model"),
    "text_encoder_2": ("CLIPTextModelWithProjection", "clip_text_model"),
    "text_encoder_3": ("T5EncoderModel", "t5"),
}


def known_configs() -> list[str]:
    return common.config_names("sd3")


def bundled_config_dir(name: str | None) -> Path:
    return common.bundled_dir(name or DEFAULT_CONFIG, "SD3", known_configs, prefix="sd3")


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    if part == "transformer":
        return SD3Transformer2DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKL.from_config(cfg)
    if part == "text_encoder_3":
        return T5EncoderModel(T5Config(**_hf_config(cfg)))
    return CLIPTextModelWithProjection(CLIPTextConfig(**_hf_config(cfg)))


def _identity_projection(clip_l) -> None:
    """SD3 uses CLIP-L's pooled output unprojected: an identity text_projection (as diffusers' SD3 loader sets)."""
    w = clip_l.text_projection.weight
    if w.shape[0] != w.shape[1]:
        raise ModelLoadError(f"SD3's CLIP-L needs projection_dim == hidden_size, got {tuple(w.shape)}.")
    with torch.no_grad():
        w.copy_(torch.eye(w.shape[0], dtype=w.dtype, device=w.device))


class SD3(ModelFamily):
    name = "sd3"
    image_encoder = "vae"
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "clip_l": ("text_encoder",),
        "clip_g": ("text_encoder_2",),
        "t5": ("text_encoder_3",),
    }
    denoiser = "transformer"
    parts = PARTS
    kohya_layout = True  # LoRAs also written as sd-scripts names them (lora.kohya)
    kohya_base_version = "sd3"
    modelspec_lora_architecture = "stable-diffusion-3-medium/lora"
    mergeable = True
    single_file_prefixes: ClassVar[Mapping[str, str]] = single_file.PREFIXES
    objective = "flow"
    repeated_blocks = ("JointTransformerBlock",)  # speed.compile: the blocks compiled one by one
    # SD3-medium 1024 b1 (docs/benchmarks.md "Speed"): first step 19-24 s cold; eager 0.300 s/step, compiled
    # 0.150, compiled + CUDA graphs 0.063
    # six buckets on the H100 ("Fast by default", second pass): a 40 s dynamic recompile at the second shape,
    # nothing much at later ones, ~1.9 s recording each shape's graphs; compiled + CUDA graphs 0.093-0.106 s/step
    tiny_recipe = "tiny-sd3-lora"  # quickstart --family
    compile_cost: ClassVar[Mapping[str, float]] = {
        "cold_s": 24.0,
        "warm_s": 10.0,
        "saved_s": 0.237,
        "saved_s_no_graphs": 0.15,
        "dynamic_s": 40.0,
        "shape_s": 0.0,
        "record_s": 1.9,
    }
    # joint attention: the image stream (to_*) and the text stream (add_*_proj, to_add_out)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    text_encoder_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj")
    trainable_text_encoders = ("text_encoder", "text_encoder_2")  # CLIP-L, CLIP-G; T5 only ever encodes for the cache
    #: the width of the joint text sequence; T5's zeros take it when T5 is disabled. Every released SD3/SD3.5
    #: has 4096; ``load`` sets it from the transformer it loads (the tiny model's is smaller).
    joint_attention_dim = DEFAULT_JOINT_DIM
    #: memory hint: layers that stay in high precision when the frozen weights go to fp8
    #: (patch embedding, timestep/pooled-text embeddings, the text projection in, the final norm and projection out)
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("pos_embed*", "time_text_embed*", "context_embedder", "norm_out*", "proj_out")
    }

    # ------------------------------------------------------------ loading
    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        return common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint="Set model.path to a diffusers SD3 folder or an SD3 .safetensors file "
            "(--set model.path=/path/to/sd3_medium_incl_clips_t5xxlfp8.safetensors).",
            missing_hint="Point model.path at a diffusers folder (with transformer/, vae/, text_encoder/ ...) or a .safetensors checkpoint.",
            check_folder=lambda p: common.require_subfolder(p, "transformer", "SD3"),
        )

    def scheduler_config(self, mcfg: ModelConfig) -> dict:
        if mcfg.prediction_type:
            raise ConfigError(
                f"model.prediction_type={mcfg.prediction_type!r} does not apply to SD3, which is trained with rectified flow.",
                hint="Remove model.prediction_type; the flow section (flow.shift, flow.timestep_sampling) tunes SD3's training.",
            )
        kind, p = self._source(mcfg)
        base = p if kind == "diffusers" and (p / "scheduler").is_dir() else bundled_config_dir(mcfg.config)
        return _read_json(base / "scheduler" / "scheduler_config.json")

    def training_scheduler(self, mcfg: ModelConfig):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config(mcfg))

    def _tokenizers(self, kind: str, p: Path, mcfg: ModelConfig, names: Sequence[str]) -> dict[str, Any]:
        from transformers import CLIPTokenizer, T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        if kind == "diffusers":
            base = p
        elif mcfg.tokenizer_path is not None:
            base = Path(mcfg.tokenizer_path).expanduser()
        else:
            base = None
        out: dict[str, Any] = {}
        for name in names:
            folder = base / name if base is not None else None
            if name == "tokenizer_3":
                if folder is None:
                    raise ModelLoadError(
                        "A single-file checkpoint carries no T5 tokenizer, and T5's vocabulary cannot be built offline.",
                        hint="Set model.tokenizer_path to a folder with tokenizer_3/ (the tokenizer folders of a diffusers "
                        "SD3 download), or set text_encoders.t5.enabled: false to train without T5.",
                    )
                if not folder.is_dir():
                    raise ModelLoadError(
                        f"No tokenizer_3/ folder in {base}.",
                        hint="model.tokenizer_path (or the diffusers folder) must hold tokenizer_3/ with T5's tokenizer; "
                        "or set text_encoders.t5.enabled: false.",
                    )
                out[name] = T5TokenizerFast.from_pretrained(folder)
                continue
            if folder is None or (kind != "diffusers" and not folder.is_dir()):
                # derive CLIP's real vocabulary offline (cached, shared with SDXL: the same two tokenizers)
                folder = common.offline_clip_tokenizers() / name
            if not folder.is_dir():
                raise ModelLoadError(
                    f"No {name}/ folder in {folder.parent}.", hint="Is it a complete diffusers SD3 folder?"
                )
            out[name] = CLIPTokenizer.from_pretrained(folder)
        return out

    def load(
        self,
        mcfg: ModelConfig,
        parts: Sequence[str],
        dtype: torch.dtype = torch.float32,
        device="cpu",
        precision: dict[str, str] | None = None,
        tokenizers: bool = True,
    ) -> dict[str, Any]:
        """Load the named parts on ``device`` (plus the tokenizers their text encoders need).

        ``precision`` maps a part to a storage precision other than ``dtype``:
        for ``text_encoder_3`` "int8" | "nf4" (bitsandbytes through transformers,
        CUDA only) or a float type ("bf16" | "fp16" | "fp32").
        """
        kind, p = self._source(mcfg)
        parts = list(parts)
        common.check_parts("SD3", parts, PARTS)
        # quantization is checked to be possible before reading a byte
        dtypes, quant = common.t5_precisions(
            parts, dtype, precision, device, t5="text_encoder_3", label="SD3", loaded_before="the other encoders"
        )
        # what can be wrong is reported before gigabytes are read: the file's parts, then the tokenizers
        opened = self._open_checked(kind, p, parts) if kind != "diffusers" else None
        tok_names = [TOKENIZER_OF[part] for part in parts if part in TOKENIZER_OF] if tokenizers else []
        toks = self._tokenizers(kind, p, mcfg, tok_names) if tok_names else {}
        if opened is None:
            comps = self._load_diffusers(p, parts, dtypes, quant, device)
        else:
            keys, get, shape = opened
            comps = self._load_single(keys, get, shape, p, mcfg, parts, dtypes, quant, device)
        if "transformer" in comps:
            self.joint_attention_dim = int(comps["transformer"].config.joint_attention_dim)
        common.freeze(comps, parts, device, quant)
        comps.update(toks)
        return comps

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        kind, p = self._source(mcfg) if mcfg.path is not None else ("bundled", None)
        base = p if kind == "diffusers" and p is not None else bundled_config_dir(mcfg.config or DEFAULT_CONFIG)
        module = _new_module(part, _read_json(base / part / "config.json"))
        if part == "transformer":  # as load() records it
            self.joint_attention_dim = int(module.config.joint_attention_dim)
        return module

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        return single_file.detect_sd3_single_file(keys)

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return "StableDiffusion3" in class_name

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        return single_file.guess_architecture(keys)

    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """The MMDiT and the encoders are named by their diffusers/transformers paths (``lora_transformer_...``,
        OneTrainer's layout, which ComfyUI reads)."""
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        return common.adaptable_paths(module, common.clip_kohya_path if part != "transformer" else None)

    def _load_diffusers(self, p: Path, parts: list[str], dtypes: dict, quant: dict, device) -> dict[str, Any]:
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        classes = {
            "transformer": SD3Transformer2DModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModelWithProjection,
            "text_encoder_2": CLIPTextModelWithProjection,
            "text_encoder_3": T5EncoderModel,
        }

        def missing_hint(part: str) -> str:
            if part == "text_encoder_3":
                return "This folder has no T5 encoder: set text_encoders.t5.enabled: false to train without T5."
            return "Is it an SD3 model folder?"

        return common.load_diffusers_parts(p, parts, classes, dtypes, device, missing_hint, quant)

    def _open_checked(
        self, kind: str, p: Path, parts: list[str]
    ) -> tuple[list[str], Callable[[str], torch.Tensor], Callable[[str], tuple[int, ...]]]:
        """The file's keys, a reader and a shape reader, once its layout is SD3's and it holds every requested part."""
        keys, get, shape, _ = common.open_checkpoint(kind, p)
        if not single_file.detect_sd3_single_file(keys):
            sdxl = any(k.startswith("model.diffusion_model.input_blocks.") for k in keys)
            raise ModelLoadError(
                f"{p.name} does not look like an SD3 checkpoint (no model.diffusion_model.joint_blocks / text_encoders keys).",
                hint="It looks like an SDXL or SD 1.x/2.x file: set family: sdxl."
                if sdxl
                else "Give an SD3 file or a diffusers SD3 folder.",
            )
        present = single_file.parts_in_file(keys)
        missing = [part for part in parts if part not in present]
        if missing:
            names = ", ".join(single_file.LABELS[m] for m in missing)
            has = ", ".join(single_file.LABELS[m] for m in PARTS if m in present) or "nothing SD3 knows"
            hint = (
                "Set model.path to a diffusers SD3 folder (it has every part), or use a checkpoint that includes the "
                "text encoders (e.g. sd3_medium_incl_clips_t5xxlfp8.safetensors)."
            )
            if "text_encoder_3" in missing:
                hint += " To train without T5, set text_encoders.t5.enabled: false."
            raise ModelLoadError(f"{p.name} has no {names} weights (it holds {has}).", hint=hint)
        return keys, get, shape

    def _load_single(
        self,
        keys: list[str],
        get,
        shape,
        p: Path,
        mcfg: ModelConfig,
        parts: list[str],
        dtypes: dict,
        quant: dict,
        device,
    ) -> dict[str, Any]:
        from accelerate import init_empty_weights

        arch = mcfg.config or DEFAULT_CONFIG
        cfgdir = bundled_config_dir(arch)
        guess = single_file.guess_architecture(keys)

        def mismatch(part: str, what: str) -> ModelLoadError:
            hint = f"Set model.config to this checkpoint's architecture (bundled: {', '.join(known_configs())})."
            if guess and guess != arch:
                hint = f"The file's MMDiT looks like {guess}: set model.config: {guess}."
            return ModelLoadError(
                f"{p.name} does not fit the bundled architecture {arch!r} for {part}: {what}", hint=hint
            )

        out = {}
        for part in parts:
            config = _read_json(cfgdir / part / "config.json")
            prefix = single_file.PREFIXES[part]
            part_keys = [k for k in keys if k.startswith(prefix)]
            dt = dtypes[part]
            # T5 in fp16 overflows in its feed-forward output: transformers keeps `wo` in fp32 then (so do we)
            read = common.single_file_reader(
                get, dt, device, part in quant, part == "text_encoder_3" and dt == torch.float16
            )

            if part == "transformer" and streaming.takes(part):
                # streamed: each file tensor read once, split as diffusers' converter splits it, and sent where the
                # trainer's placement says before the next is read
                with init_empty_weights(include_buffers=True):
                    module = _new_module(part, config)
                tensors = single_file.transformer_tensors(part_keys, shape, read, config)
                streaming.fill(module, part, tensors, functools.partial(mismatch, part), common.assign_state_dict)
                out[part] = module
                continue
            # each tensor goes from the memory-mapped file to the device on its own; diffusers' converters
            # then rename (and split the fused qkv) on the device
            ckpt = {k: read(k) for k in part_keys}
            try:
                sd = single_file.original_to_diffusers(part, ckpt, config)
            except (KeyError, ValueError, IndexError) as e:
                raise mismatch(part, f"the converter found no {e}") from None
            del ckpt
            if part in quant:
                out[part] = common.quantized_t5_from_state_dict(sd, config, quant[part], dt, device)
                continue
            # the MMDiT's one buffer (pos_embed, seconds of CPU work to compute) is in the file: build it
            # on the meta device too; the text encoders' non-persistent buffers (position ids) are built
            with init_empty_weights(include_buffers=part == "transformer"):
                module = _new_module(part, config)
            common.assign_state_dict(module, sd, functools.partial(mismatch, part))
            if part == "text_encoder_3":  # assign=True replaced shared.weight: re-tie the encoder's embedding
                module.encoder.embed_tokens.weight = module.shared.weight
            out[part] = module
        return out

    @staticmethod
    def module_configs(comps: dict[str, Any]) -> dict[str, dict]:
        return common.module_configs(comps, PARTS)

    @staticmethod
    def _modelspec(configs: dict[str, dict]) -> str:
        tr = configs.get("transformer") or {}
        if tr.get("num_layers") == 38:
            return "stable-diffusion-v3.5-large"
        if tr.get("dual_attention_layers"):
            return "stable-diffusion-v3.5-medium"
        return "stable-diffusion-v3-medium"

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """Write the given parts as one .safetensors in the distributed SD3 layout (loadable by ``load``).

        Parts absent from ``sds`` are left out (a file without T5 is what
        ``sd3_medium_incl_clips.safetensors`` is). Tensors are written one at a
        time, atomically; the fused qkv projections are concatenated as each is
        written, so no second copy of the model is ever held.
        """
        original = single_file.diffusers_to_original(sds, configs)
        meta = {"format": "pt", "modelspec.architecture": self._modelspec(configs)}
        return stream_save_safetensors(path, original, metadata=meta, dtype=dtype)

    def save_diffusers(
        self,
        sds: dict[str, Any],
        configs: dict[str, dict],
        folder: Path,
        mcfg: ModelConfig,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """Write a diffusers folder (model_index, configs, weights, tokenizers, scheduler), atomically.

        T5 may be absent from ``sds`` (it never trains): it is then copied from a
        diffusers source folder, or, from a single file, left out with
        ``text_encoder_3``/``tokenizer_3`` null in model_index.json, as diffusers
        itself saves a pipeline without T5 (load it with
        ``StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)``).
        """
        import shutil

        folder = Path(folder)
        src_kind, src = self._source(mcfg)
        base = src if src_kind == "diffusers" else bundled_config_dir(mcfg.config)
        missing = [part for part in PARTS if part not in sds and part != "text_encoder_3"]
        if missing:
            raise CheckpointError(f"save_diffusers needs every SD3 part but T5; missing {missing}.")
        copy_t5 = "text_encoder_3" not in sds and src_kind == "diffusers" and (src / "text_encoder_3").is_dir()
        with_t5 = "text_encoder_3" in sds or copy_t5
        # tokenizers before writing anything: a missing one fails fast
        toks = self._tokenizers(
            src_kind, src, mcfg, ["tokenizer", "tokenizer_2"] + (["tokenizer_3"] if with_t5 else [])
        )
        index_src = (
            src / "model_index.json"
            if src_kind == "diffusers" and (src / "model_index.json").exists()
            else (bundled_config_dir(mcfg.config) / "model_index.json")
        )
        index = _read_json(index_src)
        with atomic_dir(folder) as tmp:
            for part in PARTS:
                if part not in sds:
                    continue
                common.write_part(tmp, part, sds[part], configs[part], dtype, SAVE_AS[part])
            if copy_t5:
                shutil.copytree(src / "text_encoder_3", tmp / "text_encoder_3")
            if not with_t5:
                index["text_encoder_3"] = [None, None]
                index["tokenizer_3"] = [None, None]
            shutil.copytree(base / "scheduler", tmp / "scheduler")
            for name, tok in toks.items():
                tok.save_pretrained(tmp / name)
            (tmp / "model_index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
        return folder

    # ------------------------------------------------------------ memory hints (plain numbers)
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
        """Parameter counts of the real architecture (built on the meta device) and measured activation data.
        The MMDiT patchifies the latent 2x2, so it attends over latent_pixels / 4 image tokens plus 77 + 256 text
        tokens; the activation data per latent pixel (memory.json) is measured on that real shape."""
        bundled = bundled_config_dir(mcfg.config)
        p = Path(mcfg.path) if mcfg.path is not None else None
        base = p if p is not None and p.is_dir() and (p / "transformer").is_dir() else bundled
        return common.image_memory_hints(
            self, _new_module, base, bundled, PARTS, loaded, trained, method, lora_targets, lora_rank, resolution
        )

    # ------------------------------------------------------------ random stand-ins (benchmarks)
    def build_random(
        self,
        config_name: str,
        path: Path,
        device: str | torch.device = "cpu",
        seed: int = 0,
        parts: Sequence[str] = PARTS,
    ) -> Path:
        """A random-weight model of a bundled architecture as a single file: its memory and speed are a real one's.

        ``parts`` may leave out T5 (4.7B parameters) for a file like sd3_medium_incl_clips.safetensors.
        """
        comps = common.random_parts(_new_module, bundled_config_dir(config_name), parts, device, seed)
        if "text_encoder" in comps:
            _identity_projection(comps["text_encoder"])
        return self.save_single_file(
            {p: m.state_dict() for p, m in comps.items()}, self.module_configs(comps), path, dtype=torch.float16
        )

    def cache_shapes(
        self, config_name: str, resolution: int, t5_max_length: int = DEFAULT_T5_TOKENS
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item at the largest (square) bucket: what precompute would store per stage."""
        cfgdir = bundled_config_dir(config_name)
        te1, te2, te3 = (
            _read_json(cfgdir / p / "config.json") for p in ("text_encoder", "text_encoder_2", "text_encoder_3")
        )
        latent_channels = _read_json(cfgdir / "vae" / "config.json")["latent_channels"]
        side = resolution // 8
        return {
            "latent": {"latents": (latent_channels, side, side), "crop": (2,)},  # precompute keeps every latent's crop
            "clip_l": {"clip_l_embeds": (CLIP_TOKENS, te1["hidden_size"]), "clip_l_pooled": (te1["projection_dim"],)},
            "clip_g": {"clip_g_embeds": (CLIP_TOKENS, te2["hidden_size"]), "clip_g_pooled": (te2["projection_dim"],)},
            "t5": {"t5_embeds": (t5_max_length, te3["d_model"])},
        }

    # ------------------------------------------------------------ fingerprints
    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights, memoised by file path, size and mtime.

        Of a single file only this part's tensors are hashed, so a changed transformer keeps the T5 cache valid.
        """
        kind, p = self._source(mcfg)
        if kind == "diffusers":
            files = common.weight_files(p / part) if (p / part).is_dir() else []
        else:
            files = [p]
        return common.split_fingerprint(self.name, part, kind, files, memo, single_file.PREFIXES)

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        return common.vae_latents(comps["vae"], pixels)

    @staticmethod
    def _clip(comps: dict[str, Any], which: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate hidden states, projected pooled output), as StableDiffusion3Pipeline._get_clip_prompt_embeds."""
        te = comps[which]
        out = te(ids.to(te.device), output_hidden_states=True)
        return out.hidden_states[-2], out.text_embeds

    @staticmethod
    def _clip_ids(tok, captions: list[str]) -> torch.Tensor:
        return tok(
            captions, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt"
        ).input_ids

    @staticmethod
    def _t5_ids(tok, captions: list[str], max_length: int) -> torch.Tensor:
        return tok(
            captions,
            padding="max_length",
            max_length=max_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).input_ids

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """One stage's per-caption tensors (float32, batch first).

        clip_l -> clip_l_embeds [B, 77, 768], clip_l_pooled [B, 768];
        clip_g -> clip_g_embeds [B, 77, 1280], clip_g_pooled [B, 1280];
        t5 -> t5_embeds [B, options.t5.max_length, 4096], or {} with T5 disabled
        (nothing to cache: ``combine_texts`` puts zeros in its place).
        """
        if stage == "clip_l":
            e, pooled = self._clip(comps, "text_encoder", self._clip_ids(comps["tokenizer"], captions))
            return {"clip_l_embeds": e.float(), "clip_l_pooled": pooled.float()}
        if stage == "clip_g":
            e, pooled = self._clip(comps, "text_encoder_2", self._clip_ids(comps["tokenizer_2"], captions))
            return {"clip_g_embeds": e.float(), "clip_g_pooled": pooled.float()}
        if stage == "t5":
            if not options.t5.enabled:
                return {}
            te = comps["text_encoder_3"]
            n = options.t5.max_length
            lengths = [len(x) for x in comps["tokenizer_3"](captions, add_special_tokens=True).input_ids]
            long = [c for c, k in zip(captions, lengths) if k > n]
            if long:
                from ...console import warn

                warn(
                    f"{len(long)} caption(s) longer than text_encoders.t5.max_length ({n} tokens) are cut to it, "
                    f"e.g. {long[0][:60]!r}...; raise max_length (up to 512) to keep them whole"
                )
            ids = self._t5_ids(comps["tokenizer_3"], captions, n)
            return {"t5_embeds": te(ids.to(te.device))[0].float()}
        raise ConfigError(f"SD3 has no text stage {stage!r}.", hint=f"Stages: {', '.join(self.text_stages)}.")

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return common.t5_stage_tag(stage, options)

    def stage_precision(self, stage: str, options: TextEncodersConfig) -> dict[str, str] | None:
        return {"text_encoder_3": options.t5.precision} if stage == "t5" else None

    def enabled_stages(self, options: TextEncodersConfig) -> list[str]:
        """CLIP-L and CLIP-G always; T5 unless text_encoders.t5.enabled is false (then it never loads)."""
        return ["clip_l", "clip_g"] + (["t5"] if options.t5.enabled else [])

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """SD3 has no per-sample conditioning besides the text (no size/crop micro-conditioning): {}."""
        return {}

    def combine_texts(
        self, stages: dict[str, dict[str, torch.Tensor]], options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """Batched stage outputs -> prompt_embeds [B, 77 + T5 tokens, width], pooled_prompt_embeds [B, 2048].

        Exactly StableDiffusion3Pipeline.encode_prompt's joining: the CLIP-L and
        CLIP-G hidden states side by side, zero-padded to T5's width, then the T5
        tokens after them; the pooled outputs side by side. Without a T5 stage
        (disabled) its part is zeros of [B, options.t5.max_length,
        joint_attention_dim], as the pipeline does with ``text_encoder_3=None``.
        """
        return self._combine(stages, options.t5.max_length)

    def _combine(self, stages: dict[str, dict[str, torch.Tensor]], t5_tokens: int) -> dict[str, torch.Tensor]:
        cl, cg = stages["clip_l"], stages["clip_g"]
        clip = torch.cat([cl["clip_l_embeds"], cg["clip_g_embeds"]], dim=-1)
        t5 = (stages.get("t5") or {}).get("t5_embeds")
        if t5 is None:
            t5 = clip.new_zeros(clip.shape[0], t5_tokens, self.joint_attention_dim)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip, t5.to(clip.device, clip.dtype)], dim=-2),
            "pooled_prompt_embeds": torch.cat([cl["clip_l_pooled"], cg["clip_g_pooled"]], dim=-1),
        }

    def tokenize(self, comps: dict[str, Any], captions: list[str], t5_max_length: int = DEFAULT_T5_TOKENS) -> tuple:
        """(CLIP-L ids [B, 77], CLIP-G ids [B, 77], T5 ids [B, t5_max_length] or None without tokenizer_3)."""
        ids_t5 = self._t5_ids(comps["tokenizer_3"], captions, t5_max_length) if "tokenizer_3" in comps else None
        return self._clip_ids(comps["tokenizer"], captions), self._clip_ids(comps["tokenizer_2"], captions), ids_t5

    def encode_tokens(
        self,
        comps: dict[str, Any],
        ids_l: torch.Tensor,
        ids_g: torch.Tensor,
        ids_t5: torch.Tensor | None = None,
        t5_embeds: torch.Tensor | None = None,
        t5_max_length: int = DEFAULT_T5_TOKENS,
    ) -> dict[str, torch.Tensor]:
        """Token ids -> {"prompt_embeds", "pooled_prompt_embeds"}, batched and differentiable through the CLIPs.

        The T5 part is ``t5_embeds`` (cached) if given, else T5 run on ``ids_t5``
        when ``text_encoder_3`` is loaded, else zeros (T5 disabled).
        """
        e_l, p_l = self._clip(comps, "text_encoder", ids_l)
        e_g, p_g = self._clip(comps, "text_encoder_2", ids_g)
        if t5_embeds is None and ids_t5 is not None and "text_encoder_3" in comps:
            te = comps["text_encoder_3"]
            t5_embeds = te(ids_t5.to(te.device))[0]
        stages = {
            "clip_l": {"clip_l_embeds": e_l, "clip_l_pooled": p_l},
            "clip_g": {"clip_g_embeds": e_g, "clip_g_pooled": p_g},
        }
        if t5_embeds is not None:
            stages["t5"] = {"t5_embeds": t5_embeds}
        return self._combine(stages, ids_t5.shape[1] if ids_t5 is not None else t5_max_length)

    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The MMDiT's velocity prediction; ``timesteps`` are sigma * 1000 as floats."""
        return transformer(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=batch["prompt_embeds"],
            pooled_projections=batch["pooled_prompt_embeds"],
            return_dict=False,
        )[0]

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    # ------------------------------------------------------------ pipelines and export
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        """StableDiffusion3Pipeline over the loaded parts (without text_encoder_3 it runs with zero T5 embeddings)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config(mcfg))
        return StableDiffusion3Pipeline(
            transformer=comps["transformer"],
            scheduler=sched,
            vae=comps["vae"],
            text_encoder=comps["text_encoder"],
            tokenizer=comps["tokenizer"],
            text_encoder_2=comps["text_encoder_2"],
            tokenizer_2=comps["tokenizer_2"],
            text_encoder_3=comps.get("text_encoder_3"),
            tokenizer_3=comps.get("tokenizer_3"),
        )

    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """Write pytorch_lora_weights.safetensors as StableDiffusion3Pipeline.load_lora_weights expects.

        ``metadata`` (per part: the peft LoRA config) goes into the file header, so
        the loader uses the trained alpha rather than assuming alpha = rank.
        SD3's LoRA loader takes the transformer and the two CLIPs (not T5).
        """
        from diffusers import StableDiffusion3Pipeline

        if layers.get("text_encoder_3"):
            raise CheckpointError(
                "diffusers' SD3 LoRA format has no place for T5 LoRA layers.",
                hint="Train LoRA on the transformer and the CLIP encoders only.",
            )
        metadata = metadata or {}
        StableDiffusion3Pipeline.save_lora_weights(
            save_directory=str(folder),
            transformer_lora_layers=layers.get("transformer"),
            text_encoder_lora_layers=layers.get("text_encoder"),
            text_encoder_2_lora_layers=layers.get("text_encoder_2"),
            transformer_lora_adapter_metadata=metadata.get("transformer"),
            text_encoder_lora_adapter_metadata=metadata.get("text_encoder"),
            text_encoder_2_lora_adapter_metadata=metadata.get("text_encoder_2"),
            safe_serialization=True,
        )

    # ------------------------------------------------------------ tiny model
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded SD3 (MMDiT, 16-channel VAE, CLIP-L, CLIP-G, T5, offline tokenizers) saved as a diffusers folder."""
        import shutil

        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
        from transformers import CLIPTokenizer, T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        folder = Path(folder)
        cfgdir = bundled_config_dir("sd3-tiny")
        torch.manual_seed(seed)
        comps: dict[str, Any] = {part: _new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS}
        _identity_projection(comps["text_encoder"])
        tokdir = folder.parent / f".{folder.name}-tokenizers"
        try:
            comps["tokenizer"] = CLIPTokenizer.from_pretrained(tiny_clip_vocab(tokdir / "tokenizer"))
            comps["tokenizer_2"] = CLIPTokenizer.from_pretrained(tiny_clip_vocab(tokdir / "tokenizer_2", pad_token="!"))
            comps["tokenizer_3"] = T5TokenizerFast.from_pretrained(tiny_t5_tokenizer(tokdir / "tokenizer_3"))
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                _read_json(cfgdir / "scheduler" / "scheduler_config.json")
            )
            pipe = StableDiffusion3Pipeline(scheduler=sched, **comps)
            pipe.save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]  # untyped in diffusers
        finally:
            shutil.rmtree(tokdir, ignore_errors=True)
        return folder
