"""Stable Diffusion XL: two CLIP text encoders, a UNet with micro-conditioning, a 4-channel VAE.

Loads offline from a diffusers folder, or from a single-file checkpoint in the
layout SDXL checkpoints are distributed in (what sd-scripts and A1111 load),
using the architecture configs bundled in ``configs/``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ...config.schema import ModelConfig
from ...errors import ModelLoadError
from ...utils import atomic_dir, stream_save_safetensors
from .. import common, streaming
from ..base import CachedItem, ModelFamily
from ..common import read_json as _read_json
from ..tokenizers import tiny_clip_vocab
from . import single_file

PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")
#: how save_diffusers writes each part: a diffusers class, or a transformers (architecture, model_type)
SAVE_AS: dict[str, str | tuple[str, str]] = {
    "unet": "UNet2DConditionModel",
    "vae": "AutoencoderKL",
    "text_encoder": ("CLIPTextModel", "clip_text_model"),
    "text_encoder_2": ("CLIPTextModelWithProjection", "clip_text_model"),
}


def known_configs() -> list[str]:
    return common.config_names("sdxl")


def bundled_config_dir(name: str) -> Path:
    return common.bundled_dir(name, "SDXL", known_configs)


def _arch(mcfg: ModelConfig) -> str:
    return mcfg.config or "sdxl-base-1.0"


def _new_module(part: str, cfg: dict):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    if part == "unet":
        return UNet2DConditionModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKL.from_config(cfg)
    conf = CLIPTextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    return CLIPTextModel(conf) if part == "text_encoder" else CLIPTextModelWithProjection(conf)


class SDXL(ModelFamily):
    name = "sdxl"
    image_encoder = "vae"
    text_encoders = ("text_encoder", "text_encoder_2")
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "clip": ("text_encoder", "text_encoder_2")
    }  # both CLIPs together (small)
    denoiser = "unet"
    parts = PARTS
    kohya_layout = True  # LoRAs also written as sd-scripts names them (lora.kohya)
    kohya_base_version = "sdxl_base_v1-0"  # what sd-scripts / A1111 show for the base model
    modelspec_lora_architecture = "stable-diffusion-xl-v1-base/lora"
    mergeable = True
    single_file_prefixes: ClassVar[Mapping[str, str]] = single_file.PREFIXES
    objective = "ddpm"
    # speed.compile: the blocks compiled one by one (diffusers' UNet lists only the first)
    repeated_blocks = ("BasicTransformerBlock", "ResnetBlock2D")
    #: ZeRO-3 on SDXL's UNet (issue 28; 2 H100s, full fine-tune 1024 px, batch 1 per GPU, benchmarks/multi_gpu.py):
    #: DeepSpeed's own settings hook each of ~1,900 modules and fetch its weights on its own: 2.99 s/step. Whole
    #: transformer stacks and resnets as leaf modules (one fetch each) and small parameters kept gathered: 1.65 s/step
    #: (case Z2-coarse), the best of the combinations tried (leaves of BasicTransformerBlock + ResnetBlock2D 1.81,
    #: those with the persistence settings 2.08, persistence alone 2.32, all-reduce fetch 3.04). Allocated peak the
    #: same 26.75 GiB, reserved 35.9 against 33.2. Then (2026-11-26, one 2 x H100 machine): a cProfile of the step
    #: showed the host busy in DeepSpeed's Python, 743 calls a step in the backward of its own F.linear replacement
    #: among it; torch's native linear (memory_efficient_linear false) took 1.396 s/step against DDP's 0.864 in the
    #: same call (0.62x; the same losses and peak memory), 1.55-1.78 before on that machine; 1.675 against 0.829
    #: (0.49x) in a later call on another such machine: the host side of ZeRO-3 varies between H100 hosts.
    zero3_settings: ClassVar[Mapping[str, Any]] = {
        "leaf_module": {"classes": ["Transformer2DModel", "ResnetBlock2D"]},
        "stage3_param_persistence_threshold": 1_000_000,
        "stage3_max_live_parameters": 3_000_000_000,
        "stage3_max_reuse_distance": 3_000_000_000,
        "memory_efficient_linear": False,
    }
    # H100, 1024 b1 checkpointed (docs/benchmarks.md "Speed", "Fast by default"): first step 104-140 s cold, 29 s
    # warm; eager 0.8-1.2 s/step, compiled + CUDA graphs 0.11-0.16 (one bucket or six), compiled alone 0.45-0.61;
    # over six buckets: ~4 s recompiling at the second shape, ~0.5 s at each later one, each shape's graphs recorded
    # in ~9.6 s (the step times of "Fast by default", second pass)
    tiny_recipe = "tiny-sdxl-lora"  # quickstart --family
    compile_cost: ClassVar[Mapping[str, float]] = {
        "cold_s": 140.0,
        "warm_s": 30.0,
        "saved_s": 0.85,
        "saved_s_no_graphs": 0.35,
        "dynamic_s": 4.0,
        "shape_s": 0.5,
        "record_s": 9.6,
    }
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoder_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj")
    trainable_text_encoders = ("text_encoder", "text_encoder_2")
    #: memory hint: layers that stay in high precision when the frozen weights go to fp8
    #: (the UNet's first and last convolutions and the timestep/micro-conditioning embeddings)
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "unet": ("conv_in", "conv_out", "time_embedding*", "add_embedding*")
    }
    #: the micro-conditioning ids (sizes and crop in pixels) stay exact: the UNet embeds them itself
    full_precision_inputs = ("time_ids",)

    # ------------------------------------------------------------ loading
    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        return common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint="Set model.path to a diffusers folder or an SDXL .safetensors file "
            "(--set model.path=/path/to/sd_xl_base_1.0.safetensors).",
            missing_hint="Point model.path at a diffusers folder (with unet/, vae/, text_encoder/ ...) or a .safetensors checkpoint.",
            check_folder=lambda p: common.require_subfolder(p, "unet", "SDXL"),
        )

    def scheduler_config(self, mcfg: ModelConfig) -> dict:
        kind, p = self._source(mcfg)
        base = p if kind == "diffusers" else bundled_config_dir(_arch(mcfg))
        cfg = _read_json(base / "scheduler" / "scheduler_config.json")
        if mcfg.prediction_type:
            cfg["prediction_type"] = mcfg.prediction_type
        return cfg

    def training_scheduler(self, mcfg: ModelConfig):
        from diffusers import DDPMScheduler

        return DDPMScheduler.from_config(self.scheduler_config(mcfg))

    def _tokenizers(self, kind: str, p: Path, mcfg: ModelConfig) -> dict[str, Any]:
        from transformers import CLIPTokenizer

        if kind == "diffusers":
            base = p
        elif mcfg.tokenizer_path is not None:
            base = Path(mcfg.tokenizer_path)
        else:  # derive CLIP's real vocabulary offline (cached next to the checkpoint's user cache)
            base = common.offline_clip_tokenizers()
        out = {}
        for name in ("tokenizer", "tokenizer_2"):
            if not (base / name).is_dir():
                raise ModelLoadError(
                    f"No {name}/ folder in {base}.", hint="model.tokenizer_path must hold tokenizer/ and tokenizer_2/."
                )
            out[name] = CLIPTokenizer.from_pretrained(base / name)
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
        kind, p = self._source(mcfg)
        parts = list(parts)
        comps: dict[str, Any] = {}
        if kind == "diffusers":
            comps.update(self._load_diffusers(p, parts, dtype, device))
        else:
            comps.update(self._load_single(kind, p, mcfg, parts, dtype, device))
        common.freeze(comps, parts, device)
        if tokenizers and any(part.startswith("text_encoder") for part in parts):
            comps.update(self._tokenizers(kind, p, mcfg))
        return comps

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        kind, p = self._source(mcfg) if mcfg.path is not None else ("bundled", None)
        base = p if kind == "diffusers" and p is not None else bundled_config_dir(_arch(mcfg))
        return _new_module(part, _read_json(base / part / "config.json"))

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        return single_file.detect_sdxl_single_file(keys)

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return "XL" in class_name or (folder / "unet").is_dir()

    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """sd-scripts names the UNet's modules by their original (LDM) paths, the encoders by transformers' paths."""
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        if part != "unet":
            return common.adaptable_paths(module, common.clip_kohya_path)
        rules = single_file._unet_map(single_file.config_json(common.module_config(module)))

        def rename(path: str) -> str | None:
            orig = rules.to_original(path + ".weight")
            return orig[: -len(".weight")] if orig else None

        return common.adaptable_paths(module, rename)

    def _load_diffusers(self, p: Path, parts: list[str], dtype, device) -> dict[str, Any]:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        classes = {
            "unet": UNet2DConditionModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModel,
            "text_encoder_2": CLIPTextModelWithProjection,
        }
        return common.load_diffusers_parts(
            p,
            parts,
            classes,
            dict.fromkeys(parts, dtype),
            device,
            missing_hint=lambda part: "Is it an SDXL model folder?",
        )

    def _load_single(self, kind: str, p: Path, mcfg: ModelConfig, parts: list[str], dtype, device) -> dict[str, Any]:
        from accelerate import init_empty_weights

        configs = {part: _read_json(bundled_config_dir(_arch(mcfg)) / part / "config.json") for part in PARTS}
        keys, get, _, _ = common.open_checkpoint(kind, p)
        if not single_file.detect_sdxl_single_file(keys):
            raise ModelLoadError(
                f"{p.name} does not look like an SDXL checkpoint (no model.diffusion_model / conditioner.embedders keys).",
                hint="Is it an SD 1.x/2.x or SD3 file? Pick the matching family, or give a diffusers folder.",
            )

        def read(k: str) -> torch.Tensor:
            return get(k).to(device=device, dtype=dtype)

        def reworded(e: ModelLoadError) -> ModelLoadError:
            known = ", ".join(known_configs())
            return ModelLoadError(
                f"{p.name} does not fit the bundled architecture {_arch(mcfg)!r}: {e.message}",
                hint=f"Set model.config to this checkpoint's architecture (bundled: {known}). {e.hint or ''}".strip(),
            )

        def reworded_errors(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            try:
                yield from tensors
            except ModelLoadError as e:
                raise reworded(e) from None

        def mismatch(part: str, what: str) -> ModelLoadError:
            return ModelLoadError(
                f"{p.name} does not match the bundled config {_arch(mcfg)!r} for {part}: {what}",
                hint="Set model.config to the architecture of this checkpoint.",
            )

        try:
            # each tensor goes from the file to the device on its own, so host RAM never holds more than one tensor
            # beyond the OS page cache of the file; the parts the trainer's placement takes are streamed below
            # instead (their names checked first there too), each tensor sent where it will live before the next is
            # read (families/streaming.py)
            eager = [part for part in parts if not streaming.takes(part)]
            sds = single_file.original_to_diffusers(read, keys, configs, components=eager) if eager else {}
        except ModelLoadError as e:
            raise reworded(e) from None
        out = {}
        for part in parts:
            with init_empty_weights():
                module = _new_module(part, configs[part])
            if part in sds:
                common.assign_state_dict(module, sds.pop(part), functools.partial(mismatch, part))
            else:
                tensors = reworded_errors(single_file.component_tensors(read, keys, configs, part))
                streaming.fill(module, part, tensors, functools.partial(mismatch, part), common.assign_state_dict)
            out[part] = module
        return out

    @staticmethod
    def module_configs(comps: dict[str, Any]) -> dict[str, dict]:
        return common.module_configs(comps, PARTS)

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """Write UNet, VAE and both text encoders as one .safetensors in the distributed SDXL layout.

        ``sds`` holds a state dict per part (tensors may be on the GPU); they are
        written one tensor at a time, atomically, so host RAM stays bounded.
        """
        original = single_file.diffusers_to_original(sds, configs)
        meta = {"format": "pt", "modelspec.architecture": "stable-diffusion-xl-v1-base"}
        return stream_save_safetensors(path, original, metadata=meta, dtype=dtype)

    def save_diffusers(
        self,
        sds: dict[str, Any],
        configs: dict[str, dict],
        folder: Path,
        mcfg: ModelConfig,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """Write a diffusers folder (model_index, configs, weights, tokenizers, scheduler), atomically."""
        import shutil

        folder = Path(folder)
        src_kind, src = self._source(mcfg)
        base = src if src_kind == "diffusers" else bundled_config_dir(_arch(mcfg))
        with atomic_dir(folder) as tmp:
            for part in PARTS:
                common.write_part(tmp, part, sds[part], configs[part], dtype, SAVE_AS[part])
            shutil.copytree(base / "scheduler", tmp / "scheduler")
            toks = self._tokenizers(src_kind, src, mcfg)
            for name, tok in toks.items():
                tok.save_pretrained(tmp / name)
            shutil.copy(bundled_config_dir(_arch(mcfg)) / "model_index.json", tmp / "model_index.json")
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
        """Parameter counts of the real architecture (built on the meta device) and measured activation data."""
        bundled = bundled_config_dir(_arch(mcfg))
        base = Path(mcfg.path) if mcfg.path is not None and Path(mcfg.path).is_dir() else bundled
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
        """A random-weight model of a bundled architecture as a single file: its memory and speed are a real one's."""
        comps = common.random_parts(_new_module, bundled_config_dir(config_name), parts, device, seed)
        return self.save_single_file(
            {p: m.state_dict() for p, m in comps.items()}, self.module_configs(comps), path, dtype=torch.float16
        )

    def cache_shapes(self, config_name: str, resolution: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item at the largest (square) bucket: what precompute would store."""
        cfgdir = bundled_config_dir(config_name)
        te1, te2 = (_read_json(cfgdir / p / "config.json") for p in ("text_encoder", "text_encoder_2"))
        latent_channels = _read_json(cfgdir / "vae" / "config.json")["latent_channels"]
        side = resolution // 8
        return {
            "latent": {"latents": (latent_channels, side, side), "crop": (2,)},
            "clip": {
                "prompt_embeds": (77, te1["hidden_size"] + te2["hidden_size"]),
                "pooled_prompt_embeds": (te2["projection_dim"],),
            },
        }

    # ------------------------------------------------------------ fingerprints
    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights, memoised by file path, size and mtime.

        Of a single file only this part's tensors are hashed, so a changed UNet keeps the VAE cache valid.
        """
        kind, p = self._source(mcfg)
        files = [p] if kind != "diffusers" else common.weight_files(p / part)
        return common.split_fingerprint(self.name, part, kind, files, memo, single_file.PREFIXES)

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        return common.vae_latents(comps["vae"], pixels)

    def tokenize(self, comps: dict[str, Any], captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = []
        for name in ("tokenizer", "tokenizer_2"):
            tok = comps[name]
            ids.append(
                tok(
                    captions,
                    padding="max_length",
                    max_length=tok.model_max_length,
                    truncation=True,
                    return_tensors="pt",
                ).input_ids
            )
        return ids[0], ids[1]

    def encode_tokens(self, comps: dict[str, Any], ids1: torch.Tensor, ids2: torch.Tensor) -> dict[str, torch.Tensor]:
        """SDXL conditioning: penultimate hidden states of both encoders, concatenated; pooled from encoder 2."""
        te1, te2 = comps["text_encoder"], comps["text_encoder_2"]
        out1 = te1(ids1.to(te1.device), output_hidden_states=True)
        out2 = te2(ids2.to(te2.device), output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
        return {"prompt_embeds": hidden, "pooled_prompt_embeds": out2.text_embeds}

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str = "clip", options=None
    ) -> dict[str, torch.Tensor]:
        ids1, ids2 = self.tokenize(comps, captions)
        return {k: v.float() for k, v in self.encode_tokens(comps, ids1, ids2).items()}

    def text_stage_tag(self, stage: str, options) -> str:
        return ""

    def stage_precision(self, stage: str, options) -> None:
        return None

    # ------------------------------------------------------------ training
    @staticmethod
    def time_ids(original_hw, crop_tl, target_hw) -> torch.Tensor:
        """SDXL micro-conditioning: (orig_h, orig_w, crop_top, crop_left, target_h, target_w)."""
        return torch.tensor([*original_hw, *crop_tl, *target_hw], dtype=torch.float32)

    def enabled_stages(self, options) -> list[str]:
        return ["clip"]

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        w, h = item.bucket
        return {"time_ids": self.time_ids(item.original_size, latent_entry["crop"].tolist(), (h, w))}

    def combine_texts(self, stages: dict[str, dict[str, torch.Tensor]], options=None) -> dict[str, torch.Tensor]:
        return dict(stages["clip"])

    def swap_blocks(self, unet) -> list[torch.nn.Module]:
        """The UNet's resnets and transformer layers, in forward order: the units block swap moves.

        The UNet is not a plain stack like a transformer: its levels differ in
        size (the 1280-channel levels hold ten transformer layers per stack and
        most of the weights). Each resnet and each transformer layer is one unit,
        so block swap can keep the largest ones in host memory and stream them
        one layer at a time; the small projections around them stay resident.
        """
        units: list[torch.nn.Module] = []
        for block in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
            resnets = list(getattr(block, "resnets", None) or [])
            stacks = [list(a.transformer_blocks) for a in (getattr(block, "attentions", None) or [])]
            if block is unet.mid_block:  # resnet, (attention, resnet) * n
                units.append(resnets[0])
                for layers, r in zip(stacks, resnets[1:]):
                    units += layers + [r]
            else:  # (resnet, attention?) * n
                for i, r in enumerate(resnets):
                    units.append(r)
                    if i < len(stacks):
                        units += stacks[i]
        return units

    def denoise(
        self, unet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        added = {"text_embeds": batch["pooled_prompt_embeds"], "time_ids": batch["time_ids"]}
        return unet(
            noisy, timesteps, encoder_hidden_states=batch["prompt_embeds"], added_cond_kwargs=added, return_dict=False
        )[0]

    # ------------------------------------------------------------ pipelines and export
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        sched = EulerDiscreteScheduler.from_config(self.scheduler_config(mcfg))
        return StableDiffusionXLPipeline(
            vae=comps["vae"],
            text_encoder=comps["text_encoder"],
            text_encoder_2=comps["text_encoder_2"],
            tokenizer=comps["tokenizer"],
            tokenizer_2=comps["tokenizer_2"],
            unet=comps["unet"],
            scheduler=sched,
        )

    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """Write pytorch_lora_weights.safetensors as StableDiffusionXLPipeline.load_lora_weights expects.

        ``metadata`` (per part: the peft LoRA config) goes into the file header, so
        the loader uses the trained alpha rather than assuming alpha = rank.
        """
        from diffusers import StableDiffusionXLPipeline

        metadata = metadata or {}
        StableDiffusionXLPipeline.save_lora_weights(
            save_directory=str(folder),
            unet_lora_layers=layers.get("unet"),
            text_encoder_lora_layers=layers.get("text_encoder"),
            text_encoder_2_lora_layers=layers.get("text_encoder_2"),
            unet_lora_adapter_metadata=metadata.get("unet"),
            text_encoder_lora_adapter_metadata=metadata.get("text_encoder"),
            text_encoder_2_lora_adapter_metadata=metadata.get("text_encoder_2"),
            safe_serialization=True,
        )

    # ------------------------------------------------------------ tiny model
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded SDXL (UNet, VAE, both CLIP encoders, offline tokenizers) saved as a diffusers folder."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
        from transformers import CLIPTokenizer

        folder = Path(folder)
        cfgdir = bundled_config_dir("sdxl-tiny")
        torch.manual_seed(seed)
        comps = {part: _new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS}
        tokdir = folder.parent / f".{folder.name}-tokenizers"
        comps["tokenizer"] = CLIPTokenizer.from_pretrained(tiny_clip_vocab(tokdir / "tokenizer"))
        comps["tokenizer_2"] = CLIPTokenizer.from_pretrained(tiny_clip_vocab(tokdir / "tokenizer_2", pad_token="!"))
        sched = EulerDiscreteScheduler.from_config(_read_json(cfgdir / "scheduler" / "scheduler_config.json"))
        pipe = StableDiffusionXLPipeline(scheduler=sched, **comps)
        pipe.save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]  # untyped in diffusers
        import shutil

        shutil.rmtree(tokdir, ignore_errors=True)
        return folder
