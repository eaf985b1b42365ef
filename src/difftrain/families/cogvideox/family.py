"""CogVideoX: a 3D full-attention expert transformer on 16-channel video latents, conditioned by T5-XXL.

Two families share this module:

* ``CogVideoX`` ("cogvideox", text to video): CogVideoX-2b (30 layers of width
  1920, 3D sincos positional embeddings), CogVideoX-5b (42 layers of width
  3072, 3D rotary embeddings) and CogVideoX1.5-5b (5b with a 2x2x2 patch: the
  transformer also pairs latent frames, ``patch_size_t = 2``).
* ``CogVideoXI2V`` ("cogvideox-i2v", image to video): CogVideoX-5b-I2V (the
  5b transformer with ``in_channels = 32``: noisy video latents and the
  first-frame image latents concatenated on channels, plus a learned positional
  table for 49 frames of 480x720, resampled for other buckets: see
  ``fit_positional_table``) and CogVideoX1.5-5b-I2V (1.5 with an ``ofs`` embedding).

Architectures are bundled in ``configs/`` (cogvideox-2b, cogvideox-5b,
cogvideox-5b-i2v, cogvideox1.5-5b, cogvideox1.5-5b-i2v; cogvideox-tiny and
cogvideox-tiny-i2v for tests), so everything loads offline. CogVideoX is
distributed as diffusers folders (transformer/, vae/, text_encoder/,
tokenizer/, scheduler/); a single file here is what a full fine-tune exports:
the transformer alone, in diffusers key layout, with its config in the header.

Layouts. Pixels are videos ``[B, 3, F, H, W]`` in [-1, 1] with F = 4k + 1
frames (an image is F = 1); the 3D VAE compresses 4x in time and 8x in space,
so the cached latents are ``[16, (F - 1) / 4 + 1, H / 8, W / 8]`` per item,
channels first like image latents. The transformer takes ``[B, F, C, h, w]``:
``denoise`` permutes in and out, so the trainer's noise, targets and loss all
live in the cache layout.

Objective. v-prediction on the scheduler's zero-terminal-SNR schedule
(``objective = "ddpm"``; ``CogVideoXDPMScheduler``: ``add_noise`` and
``get_velocity`` with integer timesteps). diffusers' and cogvideox-factory's
training scripts write the loss as ``1 / (1 - alphas_cumprod[t]) *
|get_velocity(pred, noisy, t) - x0|^2``; with ``x0_pred = sqrt(a) x_t -
sqrt(1 - a) v_pred`` that is exactly ``|v_pred - v|^2``, the plain
v-prediction MSE the trainer computes: no extra weight belongs on top.

Text. T5-XXL's last hidden state over exactly 226 tokens (CogVideoX was trained
with 226; the 2b transformer's positional table even hard-codes the length), so
``text_encoders.t5.max_length`` (SD3's knob) is ignored. T5 is never trained;
it loads alone at precompute time, in int8/nf4 through bitsandbytes on CUDA or
in a float type, exactly as SD3's T5 does.
"""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import (
    CacheMismatch,
    CheckpointError,
    ConfigError,
    DataError,
    ModelLoadError,
)
from ...utils import stream_save_safetensors
from .. import common, streaming
from ..base import CachedItem, ModelFamily
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..tokenizers import tiny_t5_tokenizer
from .positions import _fit_table, _resize_crop_region, _restore_table, latent_frames

PARTS = ("transformer", "vae", "text_encoder")
LABELS = {"transformer": "transformer", "vae": "VAE", "text_encoder": "T5-XXL text encoder"}
DEFAULT_CONFIG = "cogvideox-5b"
DEFAULT_I2V_CONFIG = "cogvideox-5b-i2v"
#: T5 tokens per caption: what CogVideoX was trained with (every pipeline's max_sequence_length)
T5_TOKENS = 226
#: the frame count the planner and ``cache_shapes`` assume unless told: 49 frames -> 13 latent frames
DEFAULT_FRAMES = 49
#: the resolution CogVideoX 1.0 was trained at (height, width): 60 x 90 latents
DEFAULT_SIZE = (480, 720)
#: I2V first-frame noise augmentation: sigma = exp(N(mean, std)) per sample (diffusers' and CogVideo's I2V training)
IMAGE_NOISE_MEAN, IMAGE_NOISE_STD = -3.0, 0.5
#: probability of zeroing the image latents in I2V training (``--noised_image_dropout`` of those scripts)
IMAGE_DROPOUT = 0.05
#: the ``ofs`` value CogVideoX1.5-5b-I2V is run with (its pipeline and its fine-tuning code)
OFS = 2.0
#: single-file header keys
META_FAMILY, META_CONFIG, META_TRANSFORMER = "difftrain.family", "difftrain.config", "difftrain.transformer_config"
#: how save_diffusers writes each part: a diffusers class, or a transformers (architecture, model_type)
SAVE_AS: dict[str, str | tuple[str, str]] = {
    "transformer": "CogVideoXTransformer3DModel",
    "vae": "AutoencoderKLCogVideoX",
    "text_encoder": ("T5EncoderModel", "t5"),
}


# ------------------------------------------------------------------ bundled configs
def is_i2v_config(transformer_cfg: dict) -> bool:
    """An image-to-video transformer takes the video and the image latents side by side: in = 2 x out channels."""
    out = transformer_cfg.get("out_channels") or transformer_cfg.get("in_channels", 16)
    return int(transformer_cfg.get("in_channels", 16)) == 2 * int(out)


def known_configs(i2v: bool | None = None) -> list[str]:
    """Bundled CogVideoX architectures (only the text-to-video or image-to-video ones when ``i2v`` is given)."""
    names = []
    for p in sorted(common.configs_root().iterdir()):
        cfg = p / "transformer" / "config.json"
        if p.name.startswith("cogvideox") and cfg.exists() and (i2v is None or is_i2v_config(_read_json(cfg)) == i2v):
            names.append(p.name)
    return names


def bundled_config_dir(name: str | None) -> Path:
    return common.bundled_dir(name or DEFAULT_CONFIG, "CogVideoX", known_configs, prefix="cogvideox")


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    if part == "transformer":
        return CogVideoXTransformer3DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKLCogVideoX.from_config(cfg)
    if part == "text_encoder":
        return T5EncoderModel(T5Config(**_hf_config(cfg)))
    raise ModelLoadError(f"CogVideoX has no part named {part!r}.", hint=f"Parts: {', '.join(PARTS)}.")


def _architecture(transformer_cfg: dict) -> dict:
    """A transformer config with every constructor default filled in and bookkeeping keys dropped (comparable)."""
    from diffusers import CogVideoXTransformer3DModel

    params = inspect.signature(CogVideoXTransformer3DModel.__init__).parameters
    full = {k: p.default for k, p in params.items() if k != "self" and p.default is not inspect.Parameter.empty}
    full.update({k: v for k, v in transformer_cfg.items() if k in full})
    return {k: list(v) if isinstance(v, tuple) else v for k, v in full.items()}


def config_name_of(transformer_cfg: dict) -> str | None:
    """The bundled architecture whose transformer config this is, if any."""
    arch = _architecture(transformer_cfg)
    for name in known_configs():
        if _architecture(_read_json(common.configs_root() / name / "transformer" / "config.json")) == arch:
            return name
    return None


class CogVideoX(ModelFamily):
    """Text-to-video CogVideoX (2b, 5b, 1.5-5b)."""

    name = "cogvideox"
    video = True  # memory_hints and cache_shapes take a frame count
    #: whether the denoiser also takes first-frame image latents (precompute then calls ``encode_first_frame``)
    image_conditioned = False
    default_config = DEFAULT_CONFIG
    tiny_config = "cogvideox-tiny"
    tiny_recipe = "tiny-cogvideox-lora"  # quickstart --family (image-to-video too, with its tiny_config)
    image_encoder = "vae"
    text_encoders = ("text_encoder",)
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"t5": ("text_encoder",)}
    denoiser = "transformer"
    parts = PARTS
    objective = "ddpm"  # v-prediction (the scheduler config's prediction_type)
    repeated_blocks = ("CogVideoXBlock",)  # speed.compile: the blocks compiled one by one
    # CogVideoX-2b 49x480x720 b1 (docs/benchmarks.md "Speed"): first step 16-22 s cold; eager 1.03-1.07 s/step,
    # compiled 0.83-0.85 (attention-bound: CUDA graphs not measured to add anything)
    # further frame buckets and graph recordings not measured on this family: a dynamic recompile as long as the
    # cold compile (SD3's was 1.7x its own), SDXL's and SD3's shares for the rest
    compile_cost: ClassVar[Mapping[str, float]] = {
        "cold_s": 22.0,
        "warm_s": 8.0,
        "saved_s": 0.2,
        "saved_s_no_graphs": 0.2,
        "dynamic_s": 22.0,
        "shape_s": 0.3,
        "record_s": 1.5,
    }
    # the one joint attention of each block: video and text tokens share to_q/to_k/to_v/to_out
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoder_lora_targets = ()
    trainable_text_encoders = ()
    #: memory hint: layers that stay in high precision when the frozen weights go to fp8 (the patch and text
    #: embeddings, the timestep and ofs embeddings, the final norms and the projection out)
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": (
            "patch_embed*",
            "time_embedding*",
            "ofs_embedding*",
            "norm_final*",
            "norm_out*",
            "proj_out",
        )
    }

    def __init__(self) -> None:
        self._rotary: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------ sources and configs
    def _arch(self, mcfg: ModelConfig) -> str:
        return mcfg.config or self.default_config

    def _kind_hint(self) -> str:
        if self.image_conditioned:
            return "It is a text-to-video CogVideoX: set family: cogvideox."
        return "It is an image-to-video CogVideoX (in_channels 32): set family: cogvideox-i2v."

    def _check_variant(self, transformer_cfg: dict, where: str) -> None:
        if is_i2v_config(transformer_cfg) != self.image_conditioned:
            raise ModelLoadError(
                f"{where} is {'a text-to-video' if self.image_conditioned else 'an image-to-video'} CogVideoX "
                f"(transformer in_channels {transformer_cfg.get('in_channels')}), not what family {self.name} trains.",
                hint=self._kind_hint(),
            )

    def config_dir(self, name: str | None) -> Path:
        """A bundled architecture of this family's kind (text-to-video or image-to-video)."""
        d = bundled_config_dir(name or self.default_config)
        cfg = _read_json(d / "transformer" / "config.json")
        if is_i2v_config(cfg) != self.image_conditioned:
            raise ModelLoadError(
                f"The bundled config {d.name!r} is {'a text-to-video' if self.image_conditioned else 'an image-to-video'} "
                f"CogVideoX, not what family {self.name} trains.",
                hint=f"Use model.config: one of {', '.join(known_configs(self.image_conditioned))}, or: {self._kind_hint()}",
            )
        return d

    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        return common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint="Set model.path to a diffusers CogVideoX folder (--set model.path=/path/to/CogVideoX-5b), "
            "or to a transformer .safetensors a difftrain full fine-tune exported.",
            missing_hint="Point model.path at a diffusers CogVideoX folder (with transformer/, vae/, text_encoder/, tokenizer/).",
            check_folder=self._check_folder,
            unrecognised_hint="Use a diffusers CogVideoX folder or a .safetensors transformer.",
        )

    def _check_folder(self, p: Path) -> None:
        if not (p / "transformer").is_dir() and not (p / "vae").is_dir():
            hint = (
                "Give the folder that holds model_index.json (a CogVideoX download: THUDM/CogVideoX-5b and the like)."
            )
            if (p / "unet").is_dir():
                hint = common.SDXL_FOLDER_HINT
            elif (p / "config.json").exists() and any(p.glob("diffusion_pytorch_model*.safetensors")):
                hint = "It looks like a transformer/ subfolder: give its parent, the folder with model_index.json."
            raise ModelLoadError(
                f"{p} is a folder but not a diffusers CogVideoX folder (it has no transformer/ or vae/).", hint=hint
            )
        if (p / "text_encoder_3").is_dir():
            raise ModelLoadError(
                f"{p} is an SD3 folder (it has text_encoder_3/), not CogVideoX.", hint="Set family: sd3."
            )
        cfg_file = p / "transformer" / "config.json"
        if cfg_file.exists():
            cfg = _read_json(cfg_file)
            if cfg.get("_class_name", "CogVideoXTransformer3DModel") != "CogVideoXTransformer3DModel":
                raise ModelLoadError(
                    f"{p}'s transformer is a {cfg.get('_class_name')}, not a CogVideoX transformer.",
                    hint="Pick the family of that model, or give a CogVideoX folder.",
                )
            self._check_variant(cfg, str(p))

    def _single_file_missing(self, p: Path, missing: list[str]) -> ModelLoadError:
        names = ", ".join(LABELS[m] for m in missing)
        return ModelLoadError(
            f"{p.name} holds the CogVideoX transformer only; it has no {names} weights.",
            hint="Set model.path to a diffusers CogVideoX folder (it has every part). The VAE and T5 never change in "
            "fine-tuning: precompute with the base model's folder, then train with model.path set to this file "
            "(the same data.cache_dir).",
        )

    def scheduler_config(self, mcfg: ModelConfig) -> dict:
        if mcfg.prediction_type == "epsilon":
            raise ConfigError(
                "model.prediction_type=epsilon does not apply to CogVideoX, which is trained with v-prediction.",
                hint="Remove model.prediction_type.",
            )
        kind, p = self._source(mcfg)
        base = p if kind == "diffusers" and (p / "scheduler").is_dir() else self.config_dir(self._arch(mcfg))
        return _read_json(base / "scheduler" / "scheduler_config.json")

    def training_scheduler(self, mcfg: ModelConfig):
        """CogVideoXDPMScheduler from the model's scheduler config, as diffusers' CogVideoX training scripts use.

        (CogVideoX-2b ships a CogVideoXDDIMScheduler config: the same betas, SNR shift
        and zero-terminal-SNR rescaling, so the same ``alphas_cumprod``.)
        """
        from diffusers import CogVideoXDPMScheduler

        return CogVideoXDPMScheduler.from_config(self.scheduler_config(mcfg))

    def _tokenizer(self, kind: str, p: Path, mcfg: ModelConfig):
        return common.load_t5_tokenizer(
            kind, p, mcfg, "CogVideoX", "T5", "T5's spiece.model or tokenizer.json",
            read_hint="CogVideoX downloads ship T5's spiece.model only; converting it needs "
            "`pip install sentencepiece protobuf` (once: save_pretrained writes a tokenizer.json).",
        )  # fmt: skip

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
        """Load the named parts on ``device`` (plus T5's tokenizer with the text encoder).

        ``precision`` maps a part to a storage precision other than ``dtype``: for
        ``text_encoder`` "int8" | "nf4" (bitsandbytes through transformers, CUDA
        only) or a float type. The VAE comes back with slicing and tiling on, so
        its peak memory is bounded whatever the batch and frame count.
        """
        kind, p = self._source(mcfg)
        parts = list(parts)
        common.check_parts("CogVideoX", parts, PARTS)
        # quantization is checked to be possible before reading a byte
        dtypes, quant = common.t5_precisions(
            parts,
            dtype,
            precision,
            device,
            t5="text_encoder",
            label="CogVideoX",
            loaded_before="the VAE and the transformer",
        )
        if kind == "diffusers":
            comps = self._load_diffusers(p, parts, dtypes, quant, device)
        else:
            missing = [part for part in parts if part != "transformer"]
            if missing:
                raise self._single_file_missing(p, missing)
            comps = {"transformer": self._load_single(kind, p, mcfg, dtypes["transformer"], device)} if parts else {}
        common.freeze(comps, parts, device, quant)
        if "vae" in comps:
            comps["vae"].enable_slicing()
            comps["vae"].enable_tiling()
        if tokenizers and "text_encoder" in comps:
            comps["tokenizer"] = self._tokenizer(kind, p, mcfg)
        return comps

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        kind, p = self._source(mcfg) if mcfg.path is not None else ("bundled", None)
        folder = p / part / "config.json" if kind == "diffusers" and p is not None else None
        cfg_file = (
            folder
            if folder is not None and folder.exists()
            else self.config_dir(self._arch(mcfg)) / part / "config.json"
        )
        return _new_module(part, _read_json(cfg_file))

    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        raise ConfigError(
            "CogVideoX LoRAs have no kohya layout (sd-scripts does not train CogVideoX; its tools "
            "load the diffusers layout).",
            hint="Set save.lora_formats: [diffusers].",
        )

    def _load_diffusers(self, p: Path, parts: list[str], dtypes: dict, quant: dict, device) -> dict[str, Any]:
        from diffusers import AutoencoderKLCogVideoX, CogVideoXTransformer3DModel
        from transformers import T5EncoderModel

        classes = {
            "transformer": CogVideoXTransformer3DModel,
            "vae": AutoencoderKLCogVideoX,
            "text_encoder": T5EncoderModel,
        }
        # every missing part is named before gigabytes are read
        return common.load_diffusers_parts(
            p,
            parts,
            classes,
            dtypes,
            device,
            lambda part: "Is it a complete CogVideoX folder?",
            quant,
            check_first=True,
        )

    @staticmethod
    def _guess_config(keys: list[str], shape) -> str | None:
        """The bundled architecture a transformer state dict's shapes fit (for error hints)."""
        try:
            layers = 1 + max(int(k.split(".")[1]) for k in keys if k.startswith("transformer_blocks."))
            inner = shape("transformer_blocks.0.attn1.to_q.weight")[0]
            proj = shape("patch_embed.proj.weight")
        except (ValueError, KeyError, IndexError):
            return None
        for name in known_configs():
            cfg = _architecture(_read_json(common.configs_root() / name / "transformer" / "config.json"))
            p, pt = cfg["patch_size"], cfg["patch_size_t"]
            # 1.0: a Conv2d patch [inner, C, p, p]; 1.5: a Linear over p x p x p_t patches [inner, C p p p_t]
            patch_in = (
                (len(proj) == 4 and proj[1] == cfg["in_channels"])
                if pt is None
                else (len(proj) == 2 and proj[1] == cfg["in_channels"] * p * p * pt)
            )
            if (
                patch_in
                and cfg["num_layers"] == layers
                and cfg["num_attention_heads"] * cfg["attention_head_dim"] == inner
                and ("patch_embed.pos_embedding" in keys) == bool(cfg["use_learned_positional_embeddings"])
                and ("ofs_embedding.linear_1.weight" in keys) == bool(cfg["ofs_embed_dim"])
            ):
                return name
        return None

    def _load_single(self, kind: str, p: Path, mcfg: ModelConfig, dtype: torch.dtype, device):
        """The transformer of a single file in diffusers key layout, built from a bundled config."""
        from accelerate import init_empty_weights

        keys, get, shape, meta = common.open_checkpoint(kind, p)
        if not ("patch_embed.proj.weight" in keys and "transformer_blocks.0.attn1.to_q.weight" in keys):
            hint = "Give a diffusers CogVideoX folder, or the transformer file a difftrain full fine-tune exported."
            if any(k.startswith("model.diffusion_model.mixins.") or ".mixins." in k for k in keys):
                hint = (
                    "It looks like an original (SAT) CogVideoX checkpoint: convert it with diffusers' "
                    "scripts/convert_cogvideox_to_diffusers.py and give the folder it writes."
                )
            elif any(k.startswith("model.diffusion_model.input_blocks.") for k in keys):
                hint = "It looks like an SDXL checkpoint: set family: sdxl."
            elif any(".joint_blocks." in k for k in keys):
                hint = "It looks like an SD3 checkpoint: set family: sd3."
            raise ModelLoadError(
                f"{p.name} does not look like a CogVideoX transformer (no patch_embed / transformer_blocks keys).",
                hint=hint,
            )
        arch = self._arch(mcfg)
        cfgdir = self.config_dir(arch)
        config = _read_json(cfgdir / "transformer" / "config.json")
        named = meta.get(META_CONFIG) or self._guess_config(keys, shape)

        def mismatch(what: str) -> ModelLoadError:
            hint = f"Set model.config to this checkpoint's architecture (bundled: {', '.join(known_configs(self.image_conditioned))})."
            if named and named != arch:
                hint = f"The file's transformer is {named}: set model.config: {named}."
                if named in known_configs() and named not in known_configs(self.image_conditioned):
                    hint += f" {self._kind_hint()}"
            return ModelLoadError(f"{p.name} does not fit the bundled architecture {arch!r}: {what}", hint=hint)

        # the learned (I2V) positional table is in the file: build it on the meta device too; the sincos table
        # of the 2b is a non-persistent buffer the constructor computes, so it is built for real
        with init_empty_weights(include_buffers=bool(config.get("use_learned_positional_embeddings"))):
            module = _new_module("transformer", config)
        common.check_file_fits(module, keys, shape, mismatch)  # named before a byte of weights is read
        # one tensor at a time from the file: gathered, or each sent where the trainer's placement says
        tensors = ((k, get(k).to(device=device, dtype=dtype)) for k in keys)
        streaming.fill(module, "transformer", tensors, mismatch, common.assign_state_dict)
        return module

    # ------------------------------------------------------------ saving
    @staticmethod
    def module_configs(comps: dict[str, Any]) -> dict[str, dict]:
        return common.module_configs(comps, PARTS)

    def single_file_parts(self, trained: Sequence[str]) -> tuple[str, ...]:
        """What a single-file export holds: the transformer (the VAE and T5 never change in fine-tuning)."""
        return ("transformer",)

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """Write the transformer as one .safetensors in diffusers key layout (loadable by ``load``).

        The header names the architecture (``difftrain.config``: the bundled config
        whose transformer this is, empty for a custom one) and carries the full
        transformer config (``difftrain.transformer_config``). Other parts in
        ``sds`` are not written: CogVideoX's VAE and T5 never change in fine-tuning
        (``save_diffusers`` writes a complete model). Tensors are written one at a
        time, atomically.
        """
        if "transformer" not in sds:
            raise CheckpointError("A CogVideoX single file holds the transformer, and none was given.")
        cfg = common.clean_diffusers_config(dict(configs["transformer"]))
        cfg.setdefault("_class_name", "CogVideoXTransformer3DModel")
        name = config_name_of(cfg) or ""
        meta = {
            "format": "pt",
            META_FAMILY: self.name,
            META_CONFIG: name,
            META_TRANSFORMER: json.dumps(cfg, sort_keys=True, default=str),
            "modelspec.architecture": name or "cogvideox-custom",
        }
        return stream_save_safetensors(path, dict(sds["transformer"]), metadata=meta, dtype=dtype)

    @staticmethod
    def _write_part(tmp: Path, part: str, sd: dict, cfg: dict, dtype: torch.dtype | None) -> None:
        if part != "text_encoder":
            cfg = common.clean_diffusers_config(cfg)
        common.write_part(tmp, part, sd, cfg, dtype, SAVE_AS[part])

    def save_diffusers(
        self,
        sds: dict[str, Any],
        configs: dict[str, dict],
        folder: Path,
        mcfg: ModelConfig,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """Write a diffusers folder (model_index, configs, weights, tokenizer, scheduler), atomically.

        The VAE and T5 may be absent from ``sds`` (they never train): they are then
        copied from a diffusers source folder. The tokenizer and the scheduler
        config are copied from the source (or, from a single file, the tokenizer
        from ``model.tokenizer_path`` and the scheduler from the bundled config).
        """
        return common.save_t5_video_folder(
            Path(folder), sds, configs, self._source(mcfg), self.config_dir(self._arch(mcfg)), mcfg,
            self._write_part, LABELS, "CogVideoX", dtype,
        )  # fmt: skip

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
        frames: int = DEFAULT_FRAMES,
    ) -> dict:
        """Parameter counts of the real architecture (built on the meta device) and measured activation data.

        ``latent_pixels`` is latent frames x latent area: ``latent_frames(frames) *
        (resolution // 8) ** 2``, the largest bucket's area being resolution^2 as in
        the other families. The planner assumes ``DEFAULT_FRAMES`` (49 -> 13 latent
        frames) unless told; CogVideoX's 49x480x720 default has the area of
        resolution 588 (13 x 60 x 90 = 70200 latent pixels; resolution 592 gives
        13 x 74^2 = 71188). The transformer then patchifies 2x2 (2x2x2 for 1.5), so
        it attends over latent_pixels / 4 (/ 8) video tokens plus 226 text tokens.
        """
        bundled = self.config_dir(self._arch(mcfg))
        folder = Path(mcfg.path).expanduser() if mcfg.path is not None and Path(mcfg.path).is_dir() else None

        def config_file(part: str) -> Path:  # the folder's config, else the bundled architecture's
            cfg_file = folder / part / "config.json" if folder is not None else None
            return cfg_file if cfg_file is not None and cfg_file.exists() else bundled / part / "config.json"

        # text_encoder_lora_targets is empty: LoRA parameters are the transformer's alone
        return {
            **common.parameter_hints(
                self, _new_module, config_file, PARTS, loaded, trained, method, lora_targets, lora_rank
            ),
            "latent_pixels": latent_frames(frames) * (resolution // 8) ** 2,
            **common.measured_hints(bundled / "memory.json"),
            "encode_captions": False,  # T5 never trains: its embeddings always come from the cache
        }

    # ------------------------------------------------------------ random stand-ins (benchmarks)
    def build_random(
        self,
        config_name: str,
        path: Path,
        device: str | torch.device = "cpu",
        seed: int = 0,
        parts: Sequence[str] = PARTS,
    ) -> Path:
        """Random weights of a bundled architecture (bf16): the memory and speed of a real one.

        ``parts == ["transformer"]`` writes a transformer-only single file at
        ``path`` (what ``load`` reads with model.config set); otherwise ``path``
        becomes a diffusers folder holding ``parts`` (and an offline tiny T5
        tokenizer with the text encoder; parts left out are null in model_index.json).
        """
        cfgdir = self.config_dir(config_name)
        parts = list(parts)
        comps = common.random_parts(_new_module, cfgdir, parts, device, seed)
        if parts == ["transformer"]:
            sds, configs = {p: m.state_dict() for p, m in comps.items()}, self.module_configs(comps)
            return self.save_single_file(sds, configs, path, dtype=torch.bfloat16)
        return common.write_random_t5_folder(Path(path), cfgdir, parts, PARTS, comps, self._write_part)

    def cache_shapes(
        self, config_name: str, resolution: int | tuple[int, int] = DEFAULT_SIZE, frames: int = DEFAULT_FRAMES
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item: ``resolution`` a square side or (height, width); 49x480x720 by default."""
        cfgdir = self.config_dir(config_name)
        te = _read_json(cfgdir / "text_encoder" / "config.json")
        vae = _read_json(cfgdir / "vae" / "config.json")
        h, w = (resolution, resolution) if isinstance(resolution, int) else resolution
        s = 2 ** (len(vae["block_out_channels"]) - 1)
        lat = (vae["latent_channels"], latent_frames(frames), h // s, w // s)
        latent = {"latents": lat, "crop": (2,)}  # precompute keeps every latent's crop
        if self.image_conditioned:
            latent["image_latents"] = lat
        return {"latent": latent, "t5": {"prompt_embeds": (T5_TOKENS, te["d_model"])}}

    # ------------------------------------------------------------ fingerprints
    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights, memoised by file path, size and mtime."""
        kind, p = self._source(mcfg)
        if kind == "diffusers":
            files = common.weight_files(p / part) if (p / part).is_dir() else []
        else:
            if part != "transformer":
                raise self._single_file_missing(p, [part])
            files = [p]
        return common.hash_files(self.name, part, files, memo)

    # ------------------------------------------------------------ encoding
    @staticmethod
    def _video(pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, F, H, W] (an image batch [B, 3, H, W] becomes F = 1), checked against what the VAE takes."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise DataError(
                f"CogVideoX encodes videos [B, 3, F, H, W] (or images [B, 3, H, W]); got {tuple(pixels.shape)}."
            )
        f, h, w = pixels.shape[2:]
        if (f - 1) % 4:
            raise DataError(
                f"A CogVideoX clip needs 4k + 1 frames (1, 5, ..., 49), got {f}.",
                hint="Sample clips of 49 frames (CogVideoX's default), or 4k + 1 for another k.",
            )
        if h % 16 or w % 16:
            raise DataError(
                f"CogVideoX needs frame sides that are multiples of 16 (VAE 8x, patch 2), got {h}x{w}.",
                hint="Use a data.bucket_step that is a multiple of 16.",
            )
        return pixels

    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """Videos [B, 3, F, H, W] in [-1, 1] -> latents [B, 16, (F - 1) / 4 + 1, H / 8, W / 8] (float32).

        The scaled posterior mean (deterministic, so a cache entry depends on its
        inputs only). An image batch [B, 3, H, W] is encoded as one-frame clips.
        """
        vae = comps["vae"]
        video = self._video(pixels).to(vae.device, vae.dtype)
        latents = vae.encode(video).latent_dist.mean
        return (latents * vae.config.scaling_factor).float()

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """t5 -> prompt_embeds [B, 226, 4096] (float32): T5's last hidden state, as CogVideoXPipeline.encode_prompt.

        Always 226 tokens, whatever text_encoders.t5.max_length says (SD3's knob):
        CogVideoX was trained with 226, and CogVideoX-2b's positional table has
        exactly 226 text positions.
        """
        if stage != "t5":
            raise ConfigError(f"CogVideoX has no text stage {stage!r}.", hint="Its one stage is t5.")
        self.enabled_stages(options)
        te, tok = comps["text_encoder"], comps["tokenizer"]
        long = [c for c, ids in zip(captions, tok(captions, add_special_tokens=True).input_ids) if len(ids) > T5_TOKENS]
        if long:
            from ...console import warn

            warn(
                f"{len(long)} caption(s) longer than CogVideoX's {T5_TOKENS} T5 tokens are cut to it, "
                f"e.g. {long[0][:60]!r}...; shorten them to keep them whole"
            )
        ids = tok(
            captions,
            padding="max_length",
            max_length=T5_TOKENS,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).input_ids
        return {"prompt_embeds": te(ids.to(te.device))[0].float()}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"t5:{options.t5.precision}:{T5_TOKENS}" if stage == "t5" else ""

    def stage_precision(self, stage: str, options: TextEncodersConfig) -> dict[str, str] | None:
        return {"text_encoder": options.t5.precision} if stage == "t5" else None

    def enabled_stages(self, options: TextEncodersConfig) -> list[str]:
        """T5, always: it is CogVideoX's only text conditioning."""
        if not options.t5.enabled:
            raise ConfigError(
                "CogVideoX is conditioned on T5 alone: text_encoders.t5.enabled: false leaves it no text.",
                hint="Remove text_encoders.t5.enabled: false (to save memory, keep T5 in int8 or nf4).",
            )
        return ["t5"]

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Text-to-video CogVideoX has no per-sample conditioning besides the text: {}."""
        return {}

    def combine_texts(
        self, stages: dict[str, dict[str, torch.Tensor]], options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        return {"prompt_embeds": stages["t5"]["prompt_embeds"]}

    # ------------------------------------------------------------ training
    def rotary_embeddings(
        self, transformer, frames: int, height: int, width: int, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """3D RoPE (cos, sin) for ``frames`` latent frames of ``height`` x ``width`` latents, or None (2b: sincos).

        What CogVideoXPipeline._prepare_rotary_positional_embeddings computes: 1.0
        models place the grid inside the base grid (sample_height x sample_width)
        with linspace positions; 1.5 models (patch_size_t) slice integer positions
        and pair frames. Cached per shape and device.
        """
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        cfg = transformer.config
        if not cfg.use_rotary_positional_embeddings:
            return None
        p, p_t = cfg.patch_size, cfg.patch_size_t
        key = (cfg.attention_head_dim, p, p_t, cfg.sample_height, cfg.sample_width, frames, height, width, str(device))
        if key not in self._rotary:
            gh, gw = height // p, width // p
            base_h, base_w = cfg.sample_height // p, cfg.sample_width // p
            if p_t is None:
                self._rotary[key] = get_3d_rotary_pos_embed(  # type: ignore[assignment]  # (cos, sin) unless use_real=False
                    embed_dim=cfg.attention_head_dim,
                    crops_coords=_resize_crop_region((gh, gw), base_w, base_h),
                    grid_size=(gh, gw),
                    temporal_size=frames,
                    device=torch.device(device),
                )
            else:
                self._rotary[key] = get_3d_rotary_pos_embed(  # type: ignore[assignment]  # (cos, sin) unless use_real=False
                    embed_dim=cfg.attention_head_dim,
                    crops_coords=None,
                    grid_size=(gh, gw),
                    temporal_size=(frames + p_t - 1) // p_t,
                    grid_type="slice",
                    max_size=(base_h, base_w),
                    device=torch.device(device),
                )
        return self._rotary[key]

    @staticmethod
    def fit_positional_table(transformer) -> None:
        """Let CogVideoX-5b-I2V's learned positional table serve every bucket; idempotent, a no-op without one.

        The table is a frozen buffer trained for one size (49 frames of 480x720:
        13 x 30 x 45 patches). diffusers refuses any other height or width and,
        for another frame count, silently swaps in a sincos table the model never
        saw. finetrainers (cogvideox-factory's ``--ignore_learned_positional_embeddings``)
        drops the table for multi-resolution training, which changes the model:
        every LoRA trained so must be run with the same edit by hand at inference.

        difftrain keeps the model as it is and resamples the table per batch
        (forward hooks on ``patch_embed``, see :func:`resample_positional_table`):
        at the native size the stored table is used untouched, so a LoRA or full
        fine-tune trained on any mix of sizes runs in the stock
        ``CogVideoXImageToVideoPipeline`` with no edit; with the hooks installed
        (training, difftrain's validation) other sizes run too.
        """
        pe = getattr(transformer, "patch_embed", None)
        if (
            pe is None
            or not getattr(pe, "use_learned_positional_embeddings", False)
            or hasattr(pe, "_difftrain_native")
        ):
            return
        if pe.patch_size_t is not None:  # no released model has both; refuse rather than guess the layout
            raise ModelLoadError(
                "This CogVideoX transformer has a learned positional table and a temporal patch size; "
                "difftrain cannot resample that table.",
                hint="Set use_learned_positional_embeddings to false in its config, or use patch_size_t null.",
            )
        pe._difftrain_native = (pe.sample_frames, pe.sample_height, pe.sample_width)
        pe._difftrain_table = None
        pe.register_forward_pre_hook(_fit_table)
        pe.register_forward_hook(_restore_table, always_call=True)  # also when the forward raises

    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The transformer's v-prediction for noisy latents [B, C, F, h, w]; the output has the same layout.

        Inside: permute to the transformer's [B, F, C, h, w]; for image-to-video,
        concatenate the image latents on channels; 3D RoPE when the model uses it;
        ``ofs = 2.0`` when it has an ofs embedding (1.5-I2V). A 1.5 model pairs
        latent frames (``patch_size_t = 2``): an odd frame count gets copies of
        the first noisy frame prepended (CogVideo's 1.5 fine-tuning pads the clean
        latents the same way; its image latents stay at frame 0), and their
        predictions are cut off again, so the loss covers the real frames only.
        """
        cfg = transformer.config
        lat = noisy.permute(0, 2, 1, 3, 4)
        b, frames, _, h, w = lat.shape
        self.fit_positional_table(transformer)
        pad = 0
        if cfg.patch_size_t and frames % cfg.patch_size_t:
            pad = cfg.patch_size_t - frames % cfg.patch_size_t
            lat = torch.cat([lat[:, :1].expand(-1, pad, -1, -1, -1), lat], dim=1)
        image = batch.get("image_latents")
        extra = cfg.in_channels - lat.shape[2]
        if extra:
            if image is None:
                raise CacheMismatch(
                    "This CogVideoX transformer takes image latents (image-to-video), but the batch has none.",
                    hint="Use family: cogvideox-i2v and run `difftrain precompute` for it.",
                )
            img = image.permute(0, 2, 1, 3, 4).to(lat.dtype)
            if img.shape[2] != extra or img.shape[1] != frames:
                raise CacheMismatch(
                    f"Image latents of shape {tuple(image.shape)} do not fit noisy latents {tuple(noisy.shape)}."
                )
            if pad:
                img = torch.cat([img, img.new_zeros(b, pad, *img.shape[2:])], dim=1)
            lat = torch.cat([lat, img], dim=2)
        elif image is not None:
            raise CacheMismatch(
                "The batch has image latents, but this CogVideoX transformer is text-to-video.",
                hint="Load an image-to-video model (CogVideoX-5b-I2V), or use family: cogvideox.",
            )
        ofs = lat.new_full((1,), OFS) if cfg.ofs_embed_dim else None
        out = transformer(
            hidden_states=lat,
            encoder_hidden_states=batch["prompt_embeds"],
            timestep=timesteps,
            ofs=ofs,
            image_rotary_emb=self.rotary_embeddings(transformer, lat.shape[1], h, w, lat.device),
            return_dict=False,
        )[0]
        return out[:, pad:].permute(0, 2, 1, 3, 4)

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.transformer_blocks)

    # ------------------------------------------------------------ pipelines and export
    def _pipeline_class(self):
        from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline

        return CogVideoXImageToVideoPipeline if self.image_conditioned else CogVideoXPipeline

    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        """CogVideoXPipeline (CogVideoXImageToVideoPipeline) over the loaded parts, with the model's scheduler class."""
        from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler

        cfg = self.scheduler_config(mcfg)
        cls = CogVideoXDDIMScheduler if cfg.get("_class_name") == "CogVideoXDDIMScheduler" else CogVideoXDPMScheduler
        self.fit_positional_table(comps["transformer"])  # validation samples at any size, as training ran
        return self._pipeline_class()(
            tokenizer=comps.get("tokenizer"),
            text_encoder=comps.get("text_encoder"),
            vae=comps["vae"],
            transformer=comps["transformer"],
            scheduler=cls.from_config(cfg),
        )

    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """Write pytorch_lora_weights.safetensors as the CogVideoX pipelines' load_lora_weights expects.

        ``metadata`` (the peft LoRA config) goes into the file header, so the loader
        uses the trained alpha rather than assuming alpha = rank. diffusers'
        CogVideoX LoRA format holds the transformer only.

        Image-to-video: LoRA layers are Linear adapters (to_q, to_k, to_v, to_out.0
        by default); the learned positional table of CogVideoX-5b-I2V is a frozen
        buffer, never part of a LoRA, and training resamples it per bucket without
        changing the model (``fit_positional_table``), so the file loads into the
        stock pipeline with no edit, whatever sizes it was trained on.
        """
        extra = [part for part, sd in layers.items() if sd and part != "transformer"]
        if extra:
            raise CheckpointError(
                f"diffusers' CogVideoX LoRA format has no place for {', '.join(extra)} LoRA layers.",
                hint="Train LoRA on the transformer only (T5 is never trained).",
            )
        self._pipeline_class().save_lora_weights(
            save_directory=str(folder),
            transformer_lora_layers=layers.get("transformer"),
            transformer_lora_adapter_metadata=(metadata or {}).get("transformer"),
            safe_serialization=True,
        )

    # ------------------------------------------------------------ tiny model
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded CogVideoX (2-layer transformer, 3D VAE, T5, offline tokenizer) saved as a diffusers folder."""
        from diffusers import CogVideoXDPMScheduler
        from transformers import T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        folder = Path(folder)
        cfgdir = bundled_config_dir(self.tiny_config)
        torch.manual_seed(seed)
        comps: dict[str, Any] = {part: _new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS}
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            comps["tokenizer"] = T5TokenizerFast.from_pretrained(tiny_t5_tokenizer(tokdir))
            sched = CogVideoXDPMScheduler.from_config(_read_json(cfgdir / "scheduler" / "scheduler_config.json"))
            self._pipeline_class()(scheduler=sched, **comps).save_pretrained(folder, safe_serialization=True)
        finally:
            shutil.rmtree(tokdir, ignore_errors=True)
        return folder
