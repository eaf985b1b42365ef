"""Wan 2.1 / 2.2: a 3D full-attention DiT on video latents, conditioned by UMT5-XXL, trained by rectified flow.

Architectures are bundled in ``configs/`` (wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-t2v-a14b, wan2.2-ti2v-5b; the
image-to-video ones, family "wan-i2v", in i2v.py; wan-tiny* for tests), so everything loads offline. A two-expert
model (Wan2.2 A14B) trains one expert per run (``model.expert``). Sources:
a diffusers folder (``Wan-AI/*-Diffusers``: transformer/, vae/, text_encoder/, tokenizer/, scheduler/), or the
transformer alone as the single file people download for ComfyUI (the original ``blocks.N.self_attn.q`` names,
``model.diffusion_model.`` prefixed or not, bf16, fp16, fp8 or fp8_scaled; renamed tensor by tensor on the way in
by ``single_file.to_diffusers``) or as a difftrain full fine-tune exported it, with the VAE and UMT5 as files of their
own (``model.ae``, ``model.t5xxl``: ComfyUI's wan_2.1_vae and umt5_xxl files) and ``model.tokenizer_path``.

Layouts. Pixels are videos ``[B, 3, F, H, W]`` in [-1, 1] with F = 4k + 1 frames (an image is F = 1). The 2.1 VAE
compresses 4x in time and 8x in space into 16 channels, the 2.2 VAE (TI2V-5B) 16x in space into 48; cached latents
are ``[C, (F - 1) / 4 + 1, H / s, W / s]``, normalised per channel as the pipelines do: ``(z - latents_mean) /
latents_std`` (no scaling factor). The transformer takes and returns exactly that layout ([B, C, F, h, w]), so
``denoise`` hands the batch through.

Objective. Rectified flow as Wan's pipelines sample it and musubi-tuner, diffusion-pipe and ai-toolkit train it:
``x_s = (1 - s) x0 + s noise``, target ``noise - x0``, the transformer's timestep ``1000 s``. The sigma shift is
the model's scheduler's ``flow_shift`` (3.0; 5.0 for TI2V-5B) unless flow.shift sets one.

Text. UMT5-XXL's last hidden state over 512 tokens, every position past the caption's own tokens zero: what
``WanPipeline._get_t5_prompt_embeds`` feeds the transformer (it cuts at the attention mask and pads with zeros; the
original code attends over that zero padding too). UMT5 is never trained; it loads alone at precompute time, in
int8/nf4 through bitsandbytes on CUDA or in a float type, as SD3's, Flux's and CogVideoX's T5 does.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError, DataError, ModelLoadError
from ...utils import stream_save_safetensors
from .. import common, streaming
from ..base import CachedItem, ModelFamily
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..tokenizers import tiny_t5_tokenizer
from . import single_file

PARTS = ("transformer", "vae", "text_encoder")
LABELS = {"transformer": "transformer", "vae": "VAE", "text_encoder": "UMT5-XXL text encoder"}
DEFAULT_CONFIG = "wan2.1-t2v-1.3b"
#: UMT5 tokens per caption: the pipelines' max_sequence_length, and what the I2V transformers split their
#: cross-attention input at
TEXT_TOKENS = 512
#: the frame count the planner and ``cache_shapes`` assume unless told: 81 frames -> 21 latent frames
DEFAULT_FRAMES = 81
#: the size Wan is trained and sampled at by default (height, width)
DEFAULT_SIZE = (480, 832)
#: single-file header keys (a difftrain export)
META_FAMILY, META_CONFIG, META_TRANSFORMER = "difftrain.family", "difftrain.config", "difftrain.transformer_config"
SAVE_AS: dict[str, str | tuple[str, str]] = {
    "transformer": "WanTransformer3DModel",
    "vae": "AutoencoderKLWan",
    "text_encoder": ("UMT5EncoderModel", "umt5"),
}
#: where each expert of a two-expert model (Wan2.2 A14B) is kept in its diffusers folder: WanPipeline runs
#: ``transformer`` from the boundary timestep up and ``transformer_2`` below it
EXPERT_FOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}


# ------------------------------------------------------------------ bundled configs
def known_configs() -> list[str]:
    return common.config_names("wan")


def bundled_config_dir(name: str | None) -> Path:
    return common.bundled_dir(name or DEFAULT_CONFIG, "Wan", known_configs, prefix="wan")


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    if part == "transformer":
        return WanTransformer3DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKLWan.from_config(cfg)
    if part == "text_encoder":
        return UMT5EncoderModel(UMT5Config(**_hf_config(cfg)))
    raise ModelLoadError(f"Wan has no part named {part!r}.", hint=f"Parts: {', '.join(PARTS)}.")


_ARCH_KEYS = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "in_channels", "out_channels",
              "image_dim", "added_kv_proj_dim", "text_dim")  # fmt: skip


def config_name_of(transformer_cfg: Mapping) -> str | None:
    """The bundled architecture whose transformer config this is (the first of equal ones), if any."""
    for name in known_configs():
        cfg = _read_json(common.configs_root() / name / "transformer" / "config.json")
        if all(cfg.get(k) == transformer_cfg.get(k) for k in _ARCH_KEYS):
            return name
    return None


#: a part's own file, by the options Flux's loader (sd-scripts' names) already has: musubi-tuner's --vae and --t5
FILE_OPTION = {"vae": "ae", "text_encoder": "t5xxl"}
FILE_EXAMPLE = {"vae": "wan_2.1_vae.safetensors", "text_encoder": "umt5_xxl_fp16.safetensors"}


def latent_frames(frames: int) -> int:
    return (frames - 1) // 4 + 1


def _vae_state_dict(keys, weights, read, wants22: bool, mismatch) -> dict[str, torch.Tensor]:
    """A VAE file's tensors in diffusers' names: as they are, or from Wan's own names (wan_2.1_vae through diffusers'
    convert_wan_vae_to_diffusers; TI2V's wan2.2_vae per key, single_file.vae22_to_diffusers), the file's VAE
    checked to be the one the model uses."""
    if "encoder.conv1.weight" not in keys:  # diffusers' names
        return {k: read(k) for k in weights}
    v22 = single_file.is_wan22_vae(keys)
    if v22 != wants22:
        have, want = ("2.2", "2.1") if v22 else ("2.1", "2.2")
        raise mismatch(
            f"it is the Wan{have} VAE and this model uses the Wan{want} one "
            f"({'wan2.2_vae' if wants22 else 'wan_2.1_vae'}.safetensors)."
        )
    if not v22:
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        return convert_wan_vae_to_diffusers({k: read(k) for k in weights})
    sd = {}
    for k in weights:
        if (name := single_file.vae22_to_diffusers(k)) is None:
            raise mismatch(f"{k} is no tensor of the Wan2.2 VAE.")
        sd[name] = read(k)
    return sd


class Wan(ModelFamily):
    """Wan 2.1 T2V (1.3B, 14B), Wan 2.2 T2V-A14B (one expert per run) and Wan 2.2 TI2V-5B, text to video."""

    name = "wan"
    video = True
    default_config = DEFAULT_CONFIG
    tiny_config = "wan-tiny"
    tiny_recipe = "tiny-wan-lora"
    image_encoder = "vae"
    text_encoders = ("text_encoder",)
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"t5": ("text_encoder",)}
    denoiser = "transformer"
    parts: ClassVar[tuple[str, ...]] = PARTS
    objective = "flow"
    repeated_blocks = ("WanTransformerBlock",)
    # not measured on Wan yet: CogVideoX's figures (a video DiT of similar block count and width) until they are
    compile_cost: ClassVar[Mapping[str, float]] = {
        "cold_s": 22.0,
        "warm_s": 8.0,
        "saved_s": 0.2,
        "saved_s_no_graphs": 0.2,
        "dynamic_s": 22.0,
        "shape_s": 0.3,
        "record_s": 1.5,
    }
    # every Linear of a block, as musubi-tuner and diffusion-pipe adapt them: self- and cross-attention q/k/v/o
    # and the feed-forward (the image cross-attention's add_k_proj/add_v_proj of 2.1 I2V can be added)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    text_encoder_lora_targets = ()
    trainable_text_encoders = ()
    #: kept out of fp8 as musubi-tuner and diffusion-pipe keep them: the patch, text, time and image embeddings
    #: and the head (the norms and modulation tables are not Linear layers, and stay in float32 as diffusers keeps them)
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("patch_embedding", "condition_embedder*", "proj_out")
    }
    kohya_layout = True  # musubi-tuner's names: lora_unet_ + the original module path (ComfyUI loads them)
    kohya_prefixes: ClassVar[Mapping[str, str] | None] = {"transformer": "lora_unet"}

    # ------------------------------------------------------------ sources and configs
    def _arch(self, mcfg: ModelConfig) -> str:
        return mcfg.config or self.default_config

    def config_dir(self, name: str | None) -> Path:
        return bundled_config_dir(name or self.default_config)

    def _check_trainable(self, transformer_cfg: Mapping, where: str) -> None:
        if int(transformer_cfg.get("in_channels", 16)) == 36:
            raise ModelLoadError(
                f"{where} is an image-to-video Wan (transformer in_channels 36: noisy latents, mask, first frame), "
                "not what family wan (text to video) trains.",
                hint="Set family: wan-i2v.",
            )

    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        return common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint="Set model.path to a diffusers Wan folder (--set model.path=/path/to/Wan2.1-T2V-1.3B-Diffusers), "
            "or to a Wan transformer .safetensors (ComfyUI's wan2.1_t2v_1.3B_bf16.safetensors) with model.config set.",
            missing_hint="Point model.path at a diffusers Wan folder (with transformer/, vae/, text_encoder/, tokenizer/).",
            check_folder=lambda p: self._check_folder(p, mcfg),
            unrecognised_hint="Use a diffusers Wan folder or a .safetensors transformer.",
        )

    def _check_folder(self, p: Path, mcfg: ModelConfig) -> None:
        if not (p / "transformer").is_dir() and not (p / "vae").is_dir():
            hint = "Give the folder that holds model_index.json (a Wan-AI/*-Diffusers download)."
            if (p / "unet").is_dir():
                hint = common.SDXL_FOLDER_HINT
            elif (p / "config.json").exists() and any(p.glob("diffusion_pytorch_model*.safetensors")):
                hint = "It looks like a transformer/ subfolder: give its parent, the folder with model_index.json."
            raise ModelLoadError(
                f"{p} is a folder but not a diffusers Wan folder (it has no transformer/ or vae/).", hint=hint
            )
        cfg_file = p / "transformer" / "config.json"
        if cfg_file.exists():
            cfg = _read_json(cfg_file)
            if cfg.get("_class_name", "WanTransformer3DModel") != "WanTransformer3DModel":
                raise ModelLoadError(
                    f"{p}'s transformer is a {cfg.get('_class_name')}, not a Wan transformer.",
                    hint="Pick the family of that model, or give a Wan folder.",
                )
            self._check_trainable(cfg, str(p))
        self._check_expert(mcfg, (p / "transformer_2").is_dir(), str(p))

    def _check_expert(self, mcfg: ModelConfig, two: bool, where: str) -> None:
        if two and mcfg.expert is None:
            raise ModelLoadError(
                f"{where} is a two-expert Wan 2.2 model (a high-noise transformer/ and a low-noise transformer_2/); "
                "each expert trains in a run of its own, with its own LoRA.",
                hint="Set model.expert: high_noise (timesteps from the boundary up) or low_noise (below it).",
            )
        if not two and mcfg.expert is not None:
            raise ModelLoadError(
                f"model.expert is set ({mcfg.expert}), but {where} has one transformer, not two experts.",
                hint="Remove model.expert (it is for Wan2.2 A14B's two experts).",
            )

    def _index_folder(self, mcfg: ModelConfig) -> Path:
        """The folder whose model_index.json describes the model (a two-expert one's boundary): the diffusers
        source, else the bundled architecture."""
        kind, p = self._source(mcfg)
        return p if kind == "diffusers" else self.config_dir(self._arch(mcfg))

    def _expert_folder(self, mcfg: ModelConfig, part: str) -> str:
        """The subfolder ``part`` is read from: the chosen expert's, for a two-expert model's transformer."""
        if part != "transformer" or mcfg.expert is None:
            return part
        return EXPERT_FOLDERS.get(mcfg.expert, "transformer")  # both: the experts share one architecture

    def timestep_range(self, mcfg: ModelConfig) -> tuple[float, float] | None:
        """A two-expert model's expert: from the boundary up (high_noise) or below it (low_noise), the boundary
        being the model's ``boundary_ratio`` (0.875 for T2V-A14B) on the shifted scale, as WanPipeline switches."""
        if mcfg.expert is None:
            return None
        if mcfg.expert == "both":
            raise ConfigError(
                "model.expert: both trains the two experts one after the other, and only `difftrain train` runs that.",
                hint="Use `difftrain train`, or set model.expert: high_noise or low_noise for this command.",
            )
        folder = self._index_folder(mcfg)
        index = folder / "model_index.json"
        boundary = _read_json(index).get("boundary_ratio") if index.exists() else None
        if boundary is None:
            raise ModelLoadError(
                f"{folder} names no boundary_ratio in model_index.json: the experts' timestep ranges are unknown.",
                hint="Set flow.min_timestep and flow.max_timestep for this expert (T2V-A14B: 875 - 1000 for "
                "high_noise, 0 - 875 for low_noise).",
            )
        b = float(boundary)
        return (b, 1.0) if mcfg.expert == "high_noise" else (0.0, b)

    def _single_file_missing(self, p: Path, missing: list[str]) -> ModelLoadError:
        names = ", ".join(LABELS[m] for m in missing)
        return ModelLoadError(
            f"{p.name} holds the Wan transformer only; it has no {names} weights.",
            hint="Give the parts' own files as ComfyUI users have them (model.ae=wan_2.1_vae.safetensors, "
            "model.t5xxl=umt5_xxl_fp16.safetensors, model.tokenizer_path=a folder with UMT5's tokenizer), or set "
            "model.path to a diffusers Wan folder (it has every part).",
        )

    def scheduler_config(self, mcfg: ModelConfig) -> dict:
        if mcfg.prediction_type is not None:
            raise ConfigError(
                f"model.prediction_type={mcfg.prediction_type} does not apply to Wan, which is trained by rectified flow.",
                hint="Remove model.prediction_type.",
            )
        kind, p = self._source(mcfg)
        base = p if kind == "diffusers" and (p / "scheduler").is_dir() else self.config_dir(self._arch(mcfg))
        return _read_json(base / "scheduler" / "scheduler_config.json")

    def training_scheduler(self, mcfg: ModelConfig):
        """A flow-matching scheduler with the model's shift (its UniPC config's ``flow_shift``): the objective reads
        ``shift`` from it, as it does SD3's."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        cfg = self.scheduler_config(mcfg)
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), shift=float(cfg.get("flow_shift", 1.0))
        )

    def _tokenizer(self, kind: str, p: Path, mcfg: ModelConfig):
        return common.load_t5_tokenizer(kind, p, mcfg, "Wan", "UMT5", "UMT5's spiece.model and tokenizer.json")

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
        """Load the named parts on ``device`` (plus UMT5's tokenizer with the text encoder); ``precision`` may store
        the text encoder in "int8" | "nf4" (bitsandbytes, CUDA) or another float type. The VAE comes back with
        slicing and tiling on, so its peak memory is bounded whatever the batch and frame count."""
        kind, p = self._source(mcfg)
        parts = list(parts)
        common.check_parts("Wan", parts, PARTS)
        dtypes, quant = common.t5_precisions(
            parts, dtype, precision, device, t5="text_encoder", label="Wan", loaded_before="the VAE and the transformer"
        )
        own = {part: f for part in parts if (f := self._own_file(mcfg, part)) is not None}
        rest = [part for part in parts if part not in own]
        if kind == "diffusers":
            comps = self._load_diffusers(p, mcfg, rest, dtypes, quant, device)
        else:
            missing = [part for part in rest if part != "transformer"]
            if missing:
                raise self._single_file_missing(p, missing)
            comps = {"transformer": self._load_single(kind, p, mcfg, dtypes["transformer"], device)} if rest else {}
        for part, f in own.items():
            comps[part] = self._load_part_file(part, f, mcfg, dtypes[part], device, quant.get(part))
        common.freeze(comps, parts, device, quant)
        if "vae" in comps:
            comps["vae"].enable_slicing()
            comps["vae"].enable_tiling()
        if tokenizers and "text_encoder" in comps:
            comps["tokenizer"] = self._tokenizer(kind, p, mcfg)
        return comps

    def _load_diffusers(
        self, p: Path, mcfg: ModelConfig, parts: list[str], dtypes: dict, quant: dict, device
    ) -> dict[str, Any]:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5EncoderModel

        classes = {"transformer": WanTransformer3DModel, "vae": AutoencoderKLWan, "text_encoder": UMT5EncoderModel}
        return common.load_diffusers_parts(
            p, parts, classes, dtypes, device, lambda part: "Is it a complete Wan folder?", quant, check_first=True,
            subfolders={"transformer": self._expert_folder(mcfg, "transformer")},
        )  # fmt: skip

    def _own_file(self, mcfg: ModelConfig, part: str) -> Path | None:
        """model.ae (the VAE) / model.t5xxl (UMT5) as files of their own, over a folder's part too; checked."""
        from ...errors import UnsafeCheckpoint

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

    def part_config(self, mcfg: ModelConfig, part: str) -> dict:
        """A part's architecture config: a diffusers source folder's, else the bundled architecture's (also with no
        model.path: the architecture alone)."""
        kind, p = self._source(mcfg) if mcfg.path is not None else ("bundled", None)
        f = p / part / "config.json" if kind == "diffusers" and p is not None else None
        return _read_json(
            f if f is not None and f.exists() else self.config_dir(self._arch(mcfg)) / part / "config.json"
        )

    def _load_part_file(
        self, part: str, f: Path, mcfg: ModelConfig, dtype: torch.dtype, device, quant: str | None
    ) -> torch.nn.Module:
        """The VAE or UMT5 from a file of its own, as ComfyUI users have them. The VAE: diffusers' names, or Wan's
        own (wan_2.1_vae.safetensors: renamed by diffusers' convert_wan_vae_to_diffusers; wan2.2_vae.safetensors, TI2V's:
        by single_file.vae22_to_diffusers). UMT5: transformers' names (umt5_xxl_fp16.safetensors; fp8 and fp8_scaled too)."""
        from accelerate import init_empty_weights

        keys, get, _, _ = common.open_checkpoint("single", f)
        option = f"model.{FILE_OPTION[part]}"
        weights, read = common.scaled_fp8(keys, get)
        cfg = self.part_config(mcfg, part)

        def mismatch(what: str) -> ModelLoadError:
            return ModelLoadError(
                f"{option} {f.name} is not the {LABELS[part]} of {self._arch(mcfg)}: {what}",
                hint=f"Give the {LABELS[part]} file of this model ({FILE_EXAMPLE[part]}).",
            )

        if part == "vae":
            sd = _vae_state_dict(keys, weights, read, bool(cfg.get("is_residual")), mismatch)
        else:
            if not any(k.startswith("encoder.block.") for k in weights):
                raise mismatch("it has no encoder.block.N tensors (transformers' UMT5 names).")
            sd = {k: read(k) for k in weights}
            if "encoder.embed_tokens.weight" not in sd and "shared.weight" in sd:
                sd["encoder.embed_tokens.weight"] = sd["shared.weight"]  # tied in the model, stored once in the file
            if quant is not None:
                from transformers import UMT5Config, UMT5EncoderModel

                return common.quantized_t5_from_state_dict(
                    sd, cfg, quant, dtype, device, config_cls=UMT5Config, model_cls=UMT5EncoderModel
                )
        with init_empty_weights(include_buffers=False):
            module = _new_module(part, cfg)
        common.assign_state_dict(module, {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, mismatch)
        return module.requires_grad_(False).eval()

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        return _new_module(part, self.part_config(mcfg, part))

    @staticmethod
    def _guess_config(names: set[str], shape) -> str | None:
        """The bundled architecture a transformer file's shapes fit (for error hints), in diffusers names."""
        try:
            layers = 1 + max(int(k.split(".")[1]) for k in names if k.startswith("blocks."))
            width = shape("blocks.0.attn1.to_q.weight")[0]
            ffn = shape("blocks.0.ffn.net.0.proj.weight")[0]
            in_ch = shape("patch_embedding.weight")[1]
        except (ValueError, KeyError, IndexError):
            return None
        for name in known_configs():
            cfg = _read_json(common.configs_root() / name / "transformer" / "config.json")
            if (
                cfg["num_layers"] == layers
                and cfg["num_attention_heads"] * cfg["attention_head_dim"] == width
                and cfg["ffn_dim"] == ffn
                and cfg["in_channels"] == in_ch
                and bool(cfg.get("image_dim")) == ("blocks.0.attn2.add_k_proj.weight" in names)
            ):
                return name
        return None

    def _load_single(self, kind: str, p: Path, mcfg: ModelConfig, dtype: torch.dtype, device):
        """The transformer of a single file, original names (ComfyUI's and Wan-AI's files) or diffusers names (a
        difftrain export), built from a bundled config and filled one tensor at a time.

        fp8-stored files are read up to ``dtype``; ComfyUI's "fp8_scaled" files keep a ``scale_weight`` per Linear,
        which multiplies its weight (the marker key ``scaled_fp8`` is skipped)."""
        from accelerate import init_empty_weights

        keys, get, shape, meta = common.open_checkpoint(kind, p)
        original = single_file.is_wan_file(keys)
        if not original and not ("patch_embedding.weight" in keys and "blocks.0.attn1.to_q.weight" in keys):
            hint = "Give a diffusers Wan folder, or a Wan transformer file (blocks.N.self_attn.q names)."
            if any(k.startswith("model.diffusion_model.input_blocks.") for k in keys):
                hint = "It looks like an SDXL checkpoint: set family: sdxl."
            elif any(".joint_blocks." in k for k in keys):
                hint = "It looks like an SD3 checkpoint: set family: sd3."
            elif any(k.startswith(("double_blocks.", "model.diffusion_model.double_blocks.")) for k in keys):
                hint = "It looks like a Flux checkpoint: set family: flux."
            raise ModelLoadError(f"{p.name} does not look like a Wan transformer.", hint=hint)
        weights, read = common.scaled_fp8(keys, get)
        names: dict[str, str] = {}  # diffusers name -> file key
        unknown = []
        for k in weights:
            d = single_file.to_diffusers(k) if original else k
            if d is None:
                unknown.append(k)
            else:
                names[d] = k

        def dshape(name: str):
            return shape(names[name])

        arch = self._arch(mcfg)
        config = _read_json(self.config_dir(arch) / "transformer" / "config.json")
        self._check_expert(mcfg, (self.config_dir(arch) / "transformer_2").is_dir(), f"model.config {arch}")
        named = meta.get(META_CONFIG) or self._guess_config(set(names), dshape)

        def mismatch(what: str) -> ModelLoadError:
            hint = f"Set model.config to this checkpoint's architecture (bundled: {', '.join(known_configs())})."
            if named and named != arch:
                hint = f"The file's transformer is {named}: set model.config: {named}."
            return ModelLoadError(f"{p.name} does not fit the bundled architecture {arch!r}: {what}", hint=hint)

        if unknown:
            raise mismatch(f"keys the Wan transformer does not have: {unknown[:3]}.")
        self._check_trainable(config, f"model.config {arch}")
        with init_empty_weights(include_buffers=False):
            module = _new_module("transformer", config)
        common.check_file_fits(module, names, dshape, mismatch)  # named before a byte of weights is read
        keep32 = type(module)._keep_in_fp32_modules or []

        def tensors():
            for d, k in names.items():
                t = read(k)  # fp8_scaled: the stored weight times its scale
                want = torch.float32 if any(m in d.split(".") for m in keep32) else dtype
                yield d, t.to(device=device, dtype=want)
                del t

        streaming.fill(module, "transformer", tensors(), mismatch, common.assign_state_dict)
        return module

    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """musubi-tuner's names: each transformer Linear by its original path (``blocks.0.self_attn.q``)."""
        if part != "transformer":
            raise ConfigError(f"Wan LoRAs adapt the transformer only, not {part}.")
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)

        def rename(path: str) -> str | None:
            o = single_file.to_original(path + ".weight")
            return None if o is None else o.removesuffix(".weight")

        return common.adaptable_paths(module, rename)

    # ------------------------------------------------------------ saving
    @staticmethod
    def module_configs(comps: dict[str, Any]) -> dict[str, dict]:
        return common.module_configs(comps, PARTS)

    def single_file_parts(self, trained: Sequence[str]) -> tuple[str, ...]:
        """What a single-file export holds: the transformer (the VAE and UMT5 are files of their own in ComfyUI's
        layout and never change in fine-tuning)."""
        return ("transformer",)

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """Write the transformer as one .safetensors in the original names (what ComfyUI's diffusion-model loader
        and Wan's own code read, and ``load`` reads back), its config in the header; one tensor at a time,
        atomically."""
        if "transformer" not in sds:
            raise CheckpointError("A Wan single file holds the transformer, and none was given.")
        cfg = common.clean_diffusers_config(dict(configs["transformer"]))
        cfg.setdefault("_class_name", "WanTransformer3DModel")
        name = config_name_of(cfg) or ""
        sd = {}
        for k, v in sds["transformer"].items():
            o = single_file.to_original(k)
            if o is None:
                raise CheckpointError(f"The Wan transformer's {k} has no name in the original layout.")
            sd[o] = v
        meta = {
            "format": "pt",
            META_FAMILY: self.name,
            META_CONFIG: name,
            META_TRANSFORMER: json.dumps(cfg, sort_keys=True, default=str),
            "modelspec.architecture": name or "wan-custom",
        }
        return stream_save_safetensors(path, sd, metadata=meta, dtype=dtype)

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
        """Write a diffusers folder (model_index, configs, weights, tokenizer, scheduler), atomically; the VAE and
        UMT5, when not in ``sds``, are copied from the diffusers source folder (an I2V model's image encoder too)."""
        return common.save_t5_video_folder(
            Path(folder), sds, configs, self._source(mcfg), self.config_dir(self._arch(mcfg)), mcfg,
            self._write_part, LABELS, "Wan", dtype, copied=("image_encoder", "image_processor"),
        )  # fmt: skip

    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """Write pytorch_lora_weights.safetensors as WanPipeline.load_lora_weights expects (the peft config in the
        header, so the trained alpha is used)."""
        from diffusers import WanPipeline

        extra = [part for part, sd in layers.items() if sd and part != "transformer"]
        if extra:
            raise CheckpointError(
                f"diffusers' Wan LoRA format has no place for {', '.join(extra)} LoRA layers.",
                hint="Train LoRA on the transformer only (UMT5 is never trained).",
            )
        WanPipeline.save_lora_weights(
            save_directory=str(folder),
            transformer_lora_layers=layers.get("transformer"),
            transformer_lora_adapter_metadata=(metadata or {}).get("transformer"),
            safe_serialization=True,
        )

    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        """WanPipeline over the loaded parts, with the model's UniPC scheduler (flow sigmas, its flow_shift); a
        TI2V-5B transformer (48 channels) runs with the pipeline's expand_timesteps, as its model_index sets."""
        from diffusers import UniPCMultistepScheduler, WanPipeline

        self.warn_one_expert(mcfg)
        transformer = comps["transformer"]
        return WanPipeline(
            tokenizer=comps.get("tokenizer"),
            text_encoder=comps.get("text_encoder"),
            vae=comps["vae"],
            transformer=transformer,
            scheduler=UniPCMultistepScheduler.from_config(self.scheduler_config(mcfg)),
            expand_timesteps=int(transformer.config.in_channels) == 48,
        )

    @staticmethod
    def warn_one_expert(mcfg: ModelConfig) -> None:
        """A two-expert model's validation samples run the trained expert over every step (the other is not loaded
        beside it): said, since a high-noise expert's samples then look unfinished."""
        if mcfg.expert is not None:
            from ...console import warn

            warn(
                f"validation: the samples run the {mcfg.expert} expert alone over every step (the other expert is not "
                "loaded); judge them with that in mind, or load both experts and the LoRA in WanPipeline"
            )

    # ------------------------------------------------------------ encoding
    def _video(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, F, H, W] (an image batch [B, 3, H, W] becomes F = 1), checked against what the VAE takes."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise DataError(f"Wan encodes videos [B, 3, F, H, W] (or images [B, 3, H, W]); got {tuple(pixels.shape)}.")
        f, h, w = pixels.shape[2:]
        if (f - 1) % 4:
            raise DataError(
                f"A Wan clip needs 4k + 1 frames (1, 5, ..., 81), got {f}.",
                hint="Sample clips of 81 frames (Wan's default), or 4k + 1 for another k.",
            )
        side = 2 * common.spatial_factor(vae.config)  # VAE x patch 2
        if h % side or w % side:
            raise DataError(
                f"This Wan model needs frame sides that are multiples of {side}, got {h}x{w}.",
                hint=f"Use a data.bucket_step that is a multiple of {side}.",
            )
        return pixels

    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """Videos [B, 3, F, H, W] in [-1, 1] -> normalised latents [B, C, (F - 1) / 4 + 1, H / s, W / s] (float32):
        the posterior mean (deterministic, so a cache entry depends on its inputs only), ``(z - mean) / std``."""
        vae = comps["vae"]
        video = self._video(vae, pixels).to(vae.device, vae.dtype)
        z = vae.encode(video).latent_dist.mean.float()
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(shape)
        return (z - mean) / std

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """t5 -> prompt_embeds [B, 512, d] (float32): UMT5's last hidden state with every position past the
        caption's tokens zero, as WanPipeline encodes prompts (the caption cleaned as it cleans them; 512 tokens
        whatever text_encoders.t5.max_length says)."""
        if stage != "t5":
            raise ConfigError(f"Wan has no text stage {stage!r}.", hint="Its one stage is t5 (UMT5-XXL).")
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        self.enabled_stages(options)
        te, tok = comps["text_encoder"], comps["tokenizer"]
        captions = [prompt_clean(c) for c in captions]  # ftfy, HTML entities, runs of spaces: as the pipelines
        enc = tok(
            captions,
            padding="max_length",
            max_length=TEXT_TOKENS,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        long = [c for c, n in zip(captions, tok(captions).input_ids) if len(n) > TEXT_TOKENS]
        if long:
            from ...console import warn

            warn(
                f"{len(long)} caption(s) longer than Wan's {TEXT_TOKENS} UMT5 tokens are cut to it, e.g. {long[0][:60]!r}..."
            )
        ids, mask = enc.input_ids.to(te.device), enc.attention_mask.to(te.device)
        hidden = te(ids, mask).last_hidden_state.float()
        return {"prompt_embeds": hidden * mask.unsqueeze(-1).to(hidden.dtype)}

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return f"umt5:{options.t5.precision}:{TEXT_TOKENS}" if stage == "t5" else ""

    def stage_precision(self, stage: str, options: TextEncodersConfig) -> dict[str, str] | None:
        return {"text_encoder": options.t5.precision} if stage == "t5" else None

    def enabled_stages(self, options: TextEncodersConfig) -> list[str]:
        if not options.t5.enabled:
            raise ConfigError(
                "Wan is conditioned on UMT5 alone: text_encoders.t5.enabled: false leaves it no text.",
                hint="Remove text_encoders.t5.enabled: false (to save memory, keep UMT5 in int8 or nf4).",
            )
        return ["t5"]

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Text-to-video Wan has no per-sample conditioning besides the text: {}."""
        return {}

    def combine_texts(
        self, stages: dict[str, dict[str, torch.Tensor]], options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        return {"prompt_embeds": stages["t5"]["prompt_embeds"]}

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The transformer's flow prediction (noise - x0) for noisy latents [B, C, F, h, w]; the same layout out."""
        return transformer(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=batch["prompt_embeds"],
            return_dict=False,
        )[0]

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return list(transformer.blocks)

    def split_blocks(self, blocks: list[torch.nn.Module]) -> int:
        """memory.activations.split: each block as checkpointed segments, the feed-forward over token chunks (at
        81 frames of 480x832 a recomputed block held 4.3 GiB for the 1.3B, 12.1 for the 14B: docs/benchmarks.md)."""
        from .segments import split_blocks

        return split_blocks(blocks)

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
        """Parameter counts of the real architecture (meta device) and the activation data measured for it.

        ``latent_pixels`` is latent frames x latent area at the largest square bucket (resolution^2 pixels, the
        VAE's spatial factor s: 8, or 16 for the 2.2 VAE); the transformer attends over latent_pixels / 4 video
        tokens (patch 1x2x2) and 512 text tokens."""
        bundled = self.config_dir(self._arch(mcfg))
        folder = Path(mcfg.path).expanduser() if mcfg.path is not None and Path(mcfg.path).is_dir() else None

        def config_file(part: str) -> Path:
            cfg_file = folder / part / "config.json" if folder is not None else None
            return cfg_file if cfg_file is not None and cfg_file.exists() else bundled / part / "config.json"

        s = common.spatial_factor(_read_json(config_file("vae")))
        tcfg = _read_json(config_file("transformer"))
        width = int(tcfg["num_attention_heads"]) * int(tcfg["attention_head_dim"])
        return {
            # what checkpointing keeps per latent pixel: each block's input, one bf16 token of the width per 2x2
            # latent pixels (memory.activations.offload moves it to host RAM)
            "checkpoint_input_bytes": int(tcfg["num_layers"]) * width * 2 / 4,
            "checkpoint_blocks": int(tcfg["num_layers"]),
            # what save_attention keeps: each block's self-attention output over the video tokens (bf16) and its
            # log-sum-exp per head (fp32); the cross-attentions (512 text, 257 image tokens) are recomputed
            "attention_output_bytes": int(tcfg["num_layers"]) * (width * 2 + int(tcfg["num_attention_heads"]) * 4) / 4,
            **common.parameter_hints(
                self, _new_module, config_file, PARTS, loaded, trained, method, lora_targets, lora_rank
            ),
            "latent_pixels": latent_frames(frames) * (resolution // s) ** 2,
            **common.measured_hints(bundled / "memory.json"),
            "encode_captions": False,  # UMT5 never trains: its embeddings always come from the cache
        }

    # ------------------------------------------------------------ tiny and random models
    def build_tiny(self, folder: Path, seed: int = 0, config: str | None = None) -> Path:
        """A tiny seeded Wan (2-block transformer, the 2.1 VAE's layout, UMT5, offline tokenizer) as a diffusers
        folder that WanPipeline.from_pretrained loads; ``config`` "wan-tiny-a14b": two experts, as Wan2.2 A14B;
        "wan-tiny-ti2v": TI2V-5B's layout (the 2.2 VAE, 48 channels, expand_timesteps)."""
        from diffusers import UniPCMultistepScheduler, WanPipeline
        from transformers import T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        folder = Path(folder)
        cfgdir = bundled_config_dir(config or self.tiny_config)
        torch.manual_seed(seed)
        comps: dict[str, Any] = {part: _new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS}
        if (cfgdir / "transformer_2").is_dir():
            comps["transformer_2"] = _new_module("transformer", _read_json(cfgdir / "transformer_2" / "config.json"))
            comps["boundary_ratio"] = _read_json(cfgdir / "model_index.json")["boundary_ratio"]
        if _read_json(cfgdir / "model_index.json").get("expand_timesteps"):  # TI2V-5B's
            comps["expand_timesteps"] = True
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            comps["tokenizer"] = T5TokenizerFast.from_pretrained(tiny_t5_tokenizer(tokdir))
            sched = UniPCMultistepScheduler.from_config(_read_json(cfgdir / "scheduler" / "scheduler_config.json"))
            WanPipeline(scheduler=sched, **comps).save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]
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
        """Random weights of a bundled architecture (bf16): the memory and speed of a real one. ``parts ==
        ["transformer"]`` writes a transformer single file in the original names; otherwise a diffusers folder."""
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
        """Shapes of one cached item: ``resolution`` a square side or (height, width); 81x480x832 by default."""
        cfgdir = self.config_dir(config_name)
        te = _read_json(cfgdir / "text_encoder" / "config.json")
        vae = _read_json(cfgdir / "vae" / "config.json")
        h, w = (resolution, resolution) if isinstance(resolution, int) else resolution
        s = common.spatial_factor(vae)
        lat = (vae["z_dim"], latent_frames(frames), h // s, w // s)
        return {"latent": {"latents": lat, "crop": (2,)}, "t5": {"prompt_embeds": (TEXT_TOKENS, te["d_model"])}}

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights, memoised by file path, size and mtime."""
        own = self._own_file(mcfg, part)
        if own is not None:
            return common.hash_files(self.name, part, [own], memo)
        kind, p = self._source(mcfg)
        if kind == "diffusers":
            sub = p / self._expert_folder(mcfg, part)
            files = common.weight_files(sub) if sub.is_dir() else []
        else:
            if part != "transformer":
                raise self._single_file_missing(p, [part])
            files = [p]
        return common.hash_files(self.name, part, files, memo)
