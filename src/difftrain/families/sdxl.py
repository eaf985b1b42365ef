"""Stable Diffusion XL: two CLIP text encoders, a UNet with micro-conditioning, a 4-channel VAE.

Loads offline from a diffusers folder, or from a single-file checkpoint in the
layout SDXL checkpoints are distributed in (what sd-scripts and A1111 load),
using the architecture configs bundled in ``configs/``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config.schema import ModelConfig
from ..errors import ModelLoadError, UnsafeCheckpoint
from ..utils import atomic_dir, sha256_file, stream_save_safetensors
from . import sdxl_single_file as single_file
from .tokenizers import clip_vocab_from_open_clip, tiny_clip_vocab

PICKLE_EXTS = (".ckpt", ".pt", ".pth", ".bin")
PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def bundled_config_dir(name: str) -> Path:
    d = resources.files("difftrain") / "families" / "configs" / name
    if not d.is_dir():
        known = sorted(p.name for p in (resources.files("difftrain") / "families" / "configs").iterdir() if p.name.startswith("sdxl"))
        raise ModelLoadError(f"No bundled SDXL config named {name!r}.", hint=f"Use model.config: one of {', '.join(known)}.")
    return Path(str(d))


def _arch(mcfg: ModelConfig) -> str:
    return mcfg.config or "sdxl-base-1.0"


def _read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _new_module(part: str, cfg: dict):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    if part == "unet":
        return UNet2DConditionModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKL.from_config(cfg)
    conf = CLIPTextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    return CLIPTextModel(conf) if part == "text_encoder" else CLIPTextModelWithProjection(conf)


def _module_config(module) -> dict:
    cfg = module.config
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


class SDXL:
    name = "sdxl"
    image_encoder = "vae"
    text_encoders = ("text_encoder", "text_encoder_2")
    text_stages = {"clip": ("text_encoder", "text_encoder_2")}  # both CLIPs together (small)
    denoiser = "unet"
    objective = "ddpm"
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    text_encoder_lora_targets = ["q_proj", "k_proj", "v_proj", "out_proj"]
    trainable_text_encoders = ("text_encoder", "text_encoder_2")
    #: memory hint: layers that stay in high precision when the frozen weights go to fp8
    #: (the UNet's first and last convolutions and the timestep/micro-conditioning embeddings)
    high_precision_modules = {"unet": ("conv_in", "conv_out", "time_embedding*", "add_embedding*")}

    # ------------------------------------------------------------ loading
    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        if mcfg.path is None:
            raise ModelLoadError(
                "No model was given.",
                hint="Set model.path to a diffusers folder or an SDXL .safetensors file "
                "(--set model.path=/path/to/sd_xl_base_1.0.safetensors).",
            )
        p = Path(mcfg.path).expanduser()
        if not p.exists():
            raise ModelLoadError(
                f"The model path {p} does not exist.",
                hint="Point model.path at a diffusers folder (with unet/, vae/, text_encoder/ ...) or a .safetensors checkpoint.",
            )
        if p.is_dir():
            if not (p / "unet").is_dir():
                raise ModelLoadError(
                    f"{p} is a folder but not a diffusers SDXL folder (it has no unet/ subfolder).",
                    hint="Give the folder that holds model_index.json, or a single-file .safetensors checkpoint.",
                )
            return "diffusers", p
        if p.suffix.lower() == ".safetensors":
            return "single", p
        if p.suffix.lower() in PICKLE_EXTS:
            if not mcfg.allow_pickle:
                raise UnsafeCheckpoint(
                    f"{p.name} is a pickle checkpoint; loading one can run arbitrary code, so difftrain refuses it by default.",
                    hint="Convert it to .safetensors, or pass --allow-pickle (it is then read with torch.load(weights_only=True)).",
                )
            return "pickle", p
        raise ModelLoadError(f"Unrecognised model file {p.name}.", hint="Use a .safetensors checkpoint or a diffusers folder.")

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
            base = Path.home() / ".cache" / "difftrain" / "clip-tokenizer"
            if not (base / "tokenizer_2" / "vocab.json").exists():
                clip_vocab_from_open_clip(base / "tokenizer")
                clip_vocab_from_open_clip(base / "tokenizer_2", pad_token="!")
        out = {}
        for name in ("tokenizer", "tokenizer_2"):
            if not (base / name).is_dir():
                raise ModelLoadError(f"No {name}/ folder in {base}.", hint="model.tokenizer_path must hold tokenizer/ and tokenizer_2/.")
            out[name] = CLIPTokenizer.from_pretrained(base / name)
        return out

    def load(self, mcfg: ModelConfig, parts: Sequence[str], dtype: torch.dtype = torch.float32, device="cpu",
             precision: dict[str, str] | None = None) -> dict[str, Any]:
        kind, p = self._source(mcfg)
        parts = list(parts)
        comps: dict[str, Any] = {}
        if kind == "diffusers":
            comps.update(self._load_diffusers(p, parts, dtype, device))
        else:
            comps.update(self._load_single(kind, p, mcfg, parts, dtype, device))
        for part in parts:
            comps[part].requires_grad_(False).eval().to(device)
        if any(part.startswith("text_encoder") for part in parts):
            comps.update(self._tokenizers(kind, p, mcfg))
        return comps

    def _load_diffusers(self, p: Path, parts: list[str], dtype, device) -> dict[str, Any]:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        classes = {
            "unet": UNet2DConditionModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModel,
            "text_encoder_2": CLIPTextModelWithProjection,
        }
        out = {}
        for part in parts:
            if not (p / part).is_dir():
                raise ModelLoadError(f"The diffusers folder {p} has no {part}/ subfolder.", hint="Is it an SDXL model folder?")
            try:
                # device_map: weights go to the GPU as they are read (no full host copy first)
                extra = {"device_map": {"": str(device)}} if torch.device(device).type == "cuda" else {}
                out[part] = classes[part].from_pretrained(p, subfolder=part, torch_dtype=dtype, local_files_only=True, **extra)
            except OSError as e:
                raise ModelLoadError(f"Could not load {part} from {p}: {e}") from None
        return out

    def _load_single(self, kind: str, p: Path, mcfg: ModelConfig, parts: list[str], dtype, device) -> dict[str, Any]:
        from accelerate import init_empty_weights

        configs = {part: _read_json(bundled_config_dir(_arch(mcfg)) / part / "config.json") for part in PARTS}
        if kind == "single":
            from safetensors import safe_open

            try:
                handle = safe_open(str(p), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"{p} is not a readable safetensors file: {e}", hint="Is the download complete?") from None
            keys, get = list(handle.keys()), handle.get_tensor
        else:
            state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            state = state.get("state_dict", state) if isinstance(state, dict) else state
            keys, get = list(state.keys()), state.__getitem__
        if not single_file.detect_sdxl_single_file(keys):
            raise ModelLoadError(
                f"{p.name} does not look like an SDXL checkpoint (no model.diffusion_model / conditioner.embedders keys).",
                hint="Is it an SD 1.x/2.x or SD3 file? Pick the matching family, or give a diffusers folder.",
            )
        try:
            # each tensor goes from the memory-mapped file to the device on its own, so host
            # RAM never holds more than one tensor beyond the OS page cache of the file
            sds = single_file.original_to_diffusers(lambda k: get(k).to(device=device, dtype=dtype), keys, configs, components=parts)
        except ModelLoadError as e:
            known = ", ".join(sorted(p.name for p in bundled_config_dir(_arch(mcfg)).parent.iterdir() if p.name.startswith("sdxl")))
            raise ModelLoadError(
                f"{p.name} does not fit the bundled architecture {_arch(mcfg)!r}: {e.message}",
                hint=f"Set model.config to this checkpoint's architecture (bundled: {known}). {e.hint or ''}".strip(),
            ) from None
        out = {}
        for part in parts:
            with init_empty_weights():
                module = _new_module(part, configs[part])
            missing, unexpected = module.load_state_dict(sds.pop(part), strict=False, assign=True)
            missing = [m for m in missing if not m.endswith("position_ids")]
            if missing or unexpected:
                raise ModelLoadError(
                    f"{p.name} does not match the bundled config {_arch(mcfg)!r} for {part}: "
                    f"missing {missing[:3]}, unexpected {unexpected[:3]}.",
                    hint="Set model.config to the architecture of this checkpoint.",
                )
            out[part] = module
        return out

    @staticmethod
    def module_configs(comps: dict[str, Any]) -> dict[str, dict]:
        return {part: _module_config(comps[part]) for part in PARTS if part in comps}

    def save_single_file(self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None) -> Path:
        """Write UNet, VAE and both text encoders as one .safetensors in the distributed SDXL layout.

        ``sds`` holds a state dict per part (tensors may be on the GPU); they are
        written one tensor at a time, atomically, so host RAM stays bounded.
        """
        original = single_file.diffusers_to_original(sds, configs)
        meta = {"format": "pt", "modelspec.architecture": "stable-diffusion-xl-v1-base"}
        return stream_save_safetensors(path, original, metadata=meta, dtype=dtype)

    def save_diffusers(self, sds: dict[str, Any], configs: dict[str, dict], folder: Path, mcfg: ModelConfig,
                       dtype: torch.dtype | None = None) -> Path:
        """Write a diffusers folder (model_index, configs, weights, tokenizers, scheduler), atomically."""
        import shutil

        folder = Path(folder)
        src_kind, src = self._source(mcfg)
        base = src if src_kind == "diffusers" else bundled_config_dir(_arch(mcfg))
        with atomic_dir(folder) as tmp:
            for part in PARTS:
                (tmp / part).mkdir()
                cfg = dict(configs[part])
                if part.startswith("text_encoder"):
                    cfg.setdefault("architectures", ["CLIPTextModel" if part == "text_encoder" else "CLIPTextModelWithProjection"])
                    cfg.setdefault("model_type", "clip_text_model")
                    name = "model.safetensors"
                else:
                    cfg.setdefault("_class_name", "UNet2DConditionModel" if part == "unet" else "AutoencoderKL")
                    name = "diffusion_pytorch_model.safetensors"
                (tmp / part / "config.json").write_text(json.dumps(cfg, indent=2, default=str), encoding="utf-8")
                sd = {k: v for k, v in sds[part].items() if not k.endswith("position_ids")}
                stream_save_safetensors(tmp / part / name, sd, metadata={"format": "pt"}, dtype=dtype)
            shutil.copytree(base / "scheduler", tmp / "scheduler")
            toks = self._tokenizers(src_kind, src, mcfg)
            for name, tok in toks.items():
                tok.save_pretrained(tmp / name)
            shutil.copy(bundled_config_dir(_arch(mcfg)) / "model_index.json", tmp / "model_index.json")
        return folder

    # ------------------------------------------------------------ memory hints (plain numbers)
    def memory_hints(self, mcfg: ModelConfig, lora_targets: list[str], lora_rank: int, resolution: int,
                     loaded: list[str], trained: list[str], method: str) -> dict:
        """Parameter counts of the real architecture (built on the meta device) and measured activation data."""
        import fnmatch

        if mcfg.path is not None and Path(mcfg.path).is_dir():
            base = Path(mcfg.path)
        else:
            base = bundled_config_dir(_arch(mcfg))
        parts, lora, largest, swap_units = {}, 0, 0, []
        for part in PARTS:
            if part not in loaded:
                continue
            with torch.device("meta"):
                module = _new_module(part, _read_json(base / part / "config.json"))
            keep = self.high_precision_modules.get(part, ())
            eligible = linear = 0
            for name, m in module.named_modules():
                if type(m) in (torch.nn.Linear, torch.nn.Conv2d):
                    if not any(fnmatch.fnmatch(name, k) for k in keep):
                        eligible += m.weight.numel()
                        linear += m.weight.numel() if type(m) is torch.nn.Linear else 0
                    if method == "lora" and part in trained:
                        targets = lora_targets if part == self.denoiser else self.text_encoder_lora_targets
                        if any(name == tg or name.endswith("." + tg) for tg in targets):
                            if isinstance(m, torch.nn.Linear):
                                lora += lora_rank * (m.in_features + m.out_features)
                            else:
                                kh, kw = m.kernel_size
                                lora += lora_rank * (m.in_channels // m.groups) * kh * kw + m.out_channels * lora_rank
            total = sum(p.numel() for p in module.parameters())
            largest = max([largest] + [p.numel() for p in module.parameters()])
            parts[part] = {"total": total, "fp8_eligible": eligible, "linear": linear}
            if part == self.denoiser:
                swap_units = [sum(p.numel() for p in u.parameters()) for u in self.swap_blocks(module)]
        data_file = bundled_config_dir(_arch(mcfg)) / "memory.json"
        data = _read_json(data_file) if data_file.exists() else {}
        return {
            "parts": parts,
            "denoiser": self.denoiser,
            "swap_units": swap_units,
            "trained_parts": list(trained),
            "lora_params": lora,
            "largest_param": largest,
            "latent_pixels": (resolution // 8) ** 2,  # the largest bucket's latent area, SDXL's VAE downsamples 8x
            "activations": data.get("activations_bytes_per_latent_pixel", {}),
            "text_encoder_activations": data.get("text_encoder_activation_bytes_per_sample", 0),
            "workspace": data.get("workspace_bytes", 0),
            "fused_backward_extra": data.get("fused_backward_extra_bytes", 0),
            "encode_captions": any(p.startswith("text_encoder") for p in trained),
        }

    # ------------------------------------------------------------ random stand-ins (benchmarks)
    def build_random(self, config_name: str, path: Path, device="cpu", seed: int = 0, parts: Sequence[str] = PARTS) -> Path:
        """A random-weight model of a bundled architecture as a single file: its memory and speed are a real one's."""
        cfgdir = bundled_config_dir(config_name)
        torch.manual_seed(seed)
        with torch.device(device):
            comps = {part: _new_module(part, _read_json(cfgdir / part / "config.json")).to(torch.bfloat16) for part in parts}
        return self.save_single_file({p: m.state_dict() for p, m in comps.items()}, self.module_configs(comps), path,
                                     dtype=torch.float16)

    def cache_shapes(self, config_name: str, resolution: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item at the largest (square) bucket: what precompute would store."""
        cfgdir = bundled_config_dir(config_name)
        te1, te2 = (_read_json(cfgdir / p / "config.json") for p in ("text_encoder", "text_encoder_2"))
        latent_channels = _read_json(cfgdir / "vae" / "config.json")["latent_channels"]
        side = resolution // 8
        return {"latent": {"latents": (latent_channels, side, side), "crop": (2,)},
                "clip": {"prompt_embeds": (77, te1["hidden_size"] + te2["hidden_size"]),
                         "pooled_prompt_embeds": (te2["projection_dim"],)}}

    # ------------------------------------------------------------ fingerprints
    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights, memoised by file path, size and mtime."""
        import hashlib

        kind, p = self._source(mcfg)
        files = [p] if kind != "diffusers" else sorted(f for f in (p / part).iterdir() if f.suffix in (".safetensors", ".bin"))
        h = hashlib.sha256(f"{self.name}:{part}".encode())
        for f in files:
            st = f.stat()
            key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{part if kind != 'diffusers' else ''}"
            if key not in memo:
                memo[key] = sha256_file(f) if kind == "diffusers" else self._part_hash(kind, f, mcfg, part)
            h.update(memo[key].encode())
        return h.hexdigest()

    def _part_hash(self, kind: str, f: Path, mcfg: ModelConfig, part: str) -> str:
        """Hash only this part's tensors of a single file, so a changed UNet keeps the VAE cache valid."""
        import hashlib

        prefix = single_file.PREFIXES[part]
        h = hashlib.sha256()
        if kind == "single":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for k in sorted(k for k in handle.keys() if k.startswith(prefix)):
                    t = handle.get_tensor(k)
                    h.update(f"{k}|{t.dtype}|{tuple(t.shape)}".encode())
                    h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            return h.hexdigest()
        return sha256_file(f)

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        vae = comps["vae"]
        pixels = pixels.to(vae.device, vae.dtype)
        # the posterior mean: deterministic, so a cache entry depends on its inputs only
        latents = vae.encode(pixels).latent_dist.mean
        return (latents * vae.config.scaling_factor).float()

    def tokenize(self, comps: dict[str, Any], captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = []
        for name in ("tokenizer", "tokenizer_2"):
            tok = comps[name]
            ids.append(
                tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt").input_ids
            )
        return ids[0], ids[1]

    def encode_tokens(self, comps: dict[str, Any], ids1: torch.Tensor, ids2: torch.Tensor) -> dict[str, torch.Tensor]:
        """SDXL conditioning: penultimate hidden states of both encoders, concatenated; pooled from encoder 2."""
        te1, te2 = comps["text_encoder"], comps["text_encoder_2"]
        out1 = te1(ids1.to(te1.device), output_hidden_states=True)
        out2 = te2(ids2.to(te2.device), output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
        return {"prompt_embeds": hidden, "pooled_prompt_embeds": out2.text_embeds}

    def encode_prompts(self, comps: dict[str, Any], captions: list[str], stage: str = "clip", options=None) -> dict[str, torch.Tensor]:
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

    def conditioning(self, item: dict, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        w, h = item["bucket"]
        return {"time_ids": self.time_ids(item["original_size"], latent_entry["crop"].tolist(), (h, w))}

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

    def denoise(self, unet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        added = {"text_embeds": batch["pooled_prompt_embeds"], "time_ids": batch["time_ids"]}
        return unet(noisy, timesteps, encoder_hidden_states=batch["prompt_embeds"], added_cond_kwargs=added, return_dict=False)[0]

    def checkpointing_hint(self, unet) -> None:
        unet.enable_gradient_checkpointing()

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

    def save_lora(self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None) -> None:
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
        pipe.save_pretrained(folder, safe_serialization=True)
        import shutil

        shutil.rmtree(tokdir, ignore_errors=True)
        return folder
