"""FLUX.1 [dev] and [schnell]: a 12B MMDiT (19 double-stream and 38 single-stream blocks) on 16-channel VAE latents,
conditioned by CLIP-L's pooled output and T5-XXL's token embeddings.

First slice (issue 27): loads offline from a diffusers folder (or a Hub id) with the architecture configs bundled
in ``configs/`` (flux-dev, flux-schnell; flux-tiny for tests); the Black Forest Labs single-file layouts are not
read yet, nor written (a full fine-tune exports a diffusers folder). Trained with rectified flow
(``objective = "flow"``) exactly as the Flux pipelines run the transformer:

- the latents ``[B, 16, h, w]`` are packed into 2x2 patches, ``[B, h/2 * w/2, 64]``, with the pipeline's position
  ids (``img_ids``: row and column of each patch; ``txt_ids``: zeros), and the prediction unpacked back, so the
  loss is taken in latent space as for SD3;
- the noise level's shift depends on the image's token count when the scheduler says so
  (``use_dynamic_shifting``, [dev]: mu from base_shift at 256 tokens to max_shift at 4096, shift = e^mu; see
  ``trainers.objectives.dynamic_shift``); [schnell]'s scheduler has a fixed shift;
- the guidance-distilled [dev] takes a guidance value (``flow.guidance_scale``, 1.0 by default as ai-toolkit and
  sd-scripts train it); [schnell] has no guidance embedding.

The two text encoders are two precompute stages, each cached on its own: CLIP-L (its pooled output) and T5-XXL
(int8/nf4 through bitsandbytes on CUDA or a float type, ``text_encoders.t5`` as for SD3, cached under its own key).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..config.schema import ModelConfig, TextEncodersConfig
from ..errors import CheckpointError, ConfigError, ModelLoadError
from . import common
from .base import CachedItem, ModelFamily
from .common import hf_config as _hf_config
from .common import read_json as _read_json
from .tokenizers import tiny_clip_vocab

PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2")
DEFAULT_CONFIG = "flux-dev"
TOKENIZER_OF = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
CLIP_TOKENS = 77
SAVE_AS: dict[str, str | tuple[str, str]] = {
    "transformer": "FluxTransformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": ("CLIPTextModel", "clip_text_model"),
    "text_encoder_2": ("T5EncoderModel", "t5"),
}
#: the single-stream blocks' output projection (attention and MLP together), by index: peft matches a target list
#: by name suffix, and a bare "proj_out" would also take the transformer's final projection
SINGLE_PROJ_OUT = tuple(f"single_transformer_blocks.{i}.proj_out" for i in range(38))


def known_configs() -> list[str]:
    return common.config_names("flux")


def bundled_config_dir(name: str | None) -> Path:
    return common.bundled_dir(name or DEFAULT_CONFIG, "Flux", known_configs, prefix="flux")


def _new_module(part: str, cfg: dict):
    """A component built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if part == "transformer":
        return FluxTransformer2DModel.from_config(cfg)
    if part == "vae":
        return AutoencoderKL.from_config(cfg)
    if part == "text_encoder_2":
        return T5EncoderModel(T5Config(**_hf_config(cfg)))
    return CLIPTextModel(CLIPTextConfig(**_hf_config(cfg)))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C]: 2x2 patches, as FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack` for a latent of ``h`` x ``w`` (FluxPipeline._unpack_latents in latent units)."""
    b, _, d = packed.shape
    c = d // 4
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """[h/2 * w/2, 3] position ids of a packed latent: (0, row, column), as FluxPipeline._prepare_latent_image_ids."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h // 2, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device, dtype=dtype)[None, :]
    return ids.reshape(-1, 3)


class Flux(ModelFamily):
    name = "flux"
    image_encoder = "vae"
    text_encoders = ("text_encoder", "text_encoder_2")
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]] = {"clip_l": ("text_encoder",), "t5": ("text_encoder_2",)}
    denoiser = "transformer"
    parts = PARTS
    objective = "flow"
    repeated_blocks = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    tiny_recipe = "tiny-flux-lora"
    avoid_cudnn_attention = True  # cuDNN's attention backward failed at 1024 px (H100, torch 2.11 + CUDA 13)
    # not measured on Flux yet: SD3's figures scaled by the transformer's size (12B against 2B), to be replaced by
    # the H100 measurement (issue 27's Measure)
    compile_cost: ClassVar[Mapping[str, float]] = {
        "cold_s": 60.0,
        "warm_s": 20.0,
        "saved_s": 0.3,
        "saved_s_no_graphs": 0.2,
        "dynamic_s": 60.0,
        "shape_s": 0.0,
        "record_s": 4.0,
    }
    # the diffusers Flux LoRA script's targets (both streams' attention and MLPs of the double blocks), the single
    # blocks' attention and MLP input (to_q/k/v, proj_mlp) and their output projection
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "proj_mlp",
        *SINGLE_PROJ_OUT,
    )
    text_encoder_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj")
    trainable_text_encoders = ("text_encoder",)  # CLIP-L; T5 only ever encodes for the cache
    #: T5-XXL's width (the transformer's joint_attention_dim): zeros of it stand for T5 when it is disabled
    joint_attention_dim = 4096
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transformer": ("x_embedder", "time_text_embed*", "context_embedder", "norm_out*", "proj_out")
    }

    # ------------------------------------------------------------ loading
    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        kind, p = common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint="Set model.path to a diffusers Flux folder or a Hub id "
            "(--set model.path=black-forest-labs/FLUX.1-dev).",
            missing_hint="Point model.path at a diffusers Flux folder (with transformer/, vae/, text_encoder/ ...).",
            check_folder=lambda p: common.require_subfolder(p, "transformer", "Flux"),
        )
        if kind != "diffusers":
            raise ModelLoadError(
                f"{p.name}: difftrain reads Flux from a diffusers folder (or a Hub id) so far; the Black Forest Labs "
                "single-file layout (flux1-dev.safetensors with separate VAE and text-encoder files) is not read yet.",
                hint="Use a diffusers folder: black-forest-labs/FLUX.1-dev as a Hub id, or its download.",
            )
        return kind, p

    def scheduler_config(self, mcfg: ModelConfig) -> dict:
        if mcfg.prediction_type:
            raise ConfigError(
                f"model.prediction_type={mcfg.prediction_type!r} does not apply to Flux, which is trained with "
                "rectified flow.",
                hint="Remove model.prediction_type; the flow section (flow.shift, flow.timestep_sampling, "
                "flow.guidance_scale) tunes Flux's training.",
            )
        if mcfg.path is None:
            base = bundled_config_dir(mcfg.config)
        else:
            p = self._source(mcfg)[1]
            base = p if (p / "scheduler").is_dir() else bundled_config_dir(mcfg.config)
        return _read_json(base / "scheduler" / "scheduler_config.json")

    def training_scheduler(self, mcfg: ModelConfig):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config(mcfg))

    def _tokenizers(self, p: Path, names: Sequence[str]) -> dict[str, Any]:
        from transformers import CLIPTokenizer, T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        out: dict[str, Any] = {}
        for name in names:
            folder = p / name
            if not folder.is_dir():
                raise ModelLoadError(f"No {name}/ folder in {p}.", hint="Is it a complete diffusers Flux folder?")
            out[name] = (T5TokenizerFast if name == "tokenizer_2" else CLIPTokenizer).from_pretrained(folder)
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
        """Load the named parts on ``device`` (plus the tokenizers their text encoders need); ``precision`` may
        store T5 (``text_encoder_2``) in int8 | nf4 (bitsandbytes, CUDA) or another float type."""
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        _, p = self._source(mcfg)
        parts = list(parts)
        common.check_parts("Flux", parts, PARTS)
        dtypes, quant = common.t5_precisions(
            parts, dtype, precision, device, t5="text_encoder_2", label="Flux", loaded_before="the transformer"
        )
        toks = self._tokenizers(p, [TOKENIZER_OF[x] for x in parts if x in TOKENIZER_OF]) if tokenizers else {}
        classes = {
            "transformer": FluxTransformer2DModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModel,
            "text_encoder_2": T5EncoderModel,
        }
        comps = common.load_diffusers_parts(p, parts, classes, dtypes, device, lambda _: "Is it a Flux folder?", quant)
        if "transformer" in comps:
            self.joint_attention_dim = int(comps["transformer"].config.joint_attention_dim)
        common.freeze(comps, parts, device, quant)
        comps.update(toks)
        return comps

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        base = self._source(mcfg)[1] if mcfg.path is not None else bundled_config_dir(mcfg.config)
        module = _new_module(part, _read_json(base / part / "config.json"))
        if part == "transformer":
            self.joint_attention_dim = int(module.config.joint_attention_dim)
        return module

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name.startswith("Flux")

    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        raise ConfigError(
            "Flux LoRAs are written in the diffusers layout only so far (the sd-scripts / ComfyUI layout is to come).",
            hint="Leave lora.kohya off for family flux.",
        )

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        _, p = self._source(mcfg)
        files = common.weight_files(p / part) if (p / part).is_dir() else []
        return common.split_fingerprint(self.name, part, "diffusers", files, memo, {})

    @staticmethod
    def module_configs(comps: dict[str, Any]) -> dict[str, dict]:
        return common.module_configs(comps, PARTS)

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
        """Parameter counts of the real architecture (built on the meta device) and the activation data."""
        bundled = bundled_config_dir(mcfg.config)
        p = Path(mcfg.path) if mcfg.path is not None else None
        base = p if p is not None and p.is_dir() and (p / "transformer").is_dir() else bundled
        return common.image_memory_hints(
            self, _new_module, base, bundled, PARTS, loaded, trained, method, lora_targets, lora_rank, resolution
        )

    # ------------------------------------------------------------ encoding
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """The posterior mean, shifted and scaled as FluxPipeline decodes it back (shift 0.1159, scale 0.3611)."""
        return common.vae_latents(comps["vae"], pixels)

    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """clip_l -> clip_l_pooled [B, 768] (CLIP-L's pooled output, as FluxPipeline._get_clip_prompt_embeds);
        t5 -> t5_embeds [B, text_encoders.t5.max_length, 4096] (FluxPipeline._get_t5_prompt_embeds), or {} with T5
        disabled."""
        if stage == "clip_l":
            tok, te = comps["tokenizer"], comps["text_encoder"]
            ids = tok(
                captions, padding="max_length", max_length=CLIP_TOKENS, truncation=True, return_tensors="pt"
            ).input_ids
            return {"clip_l_pooled": te(ids.to(te.device), output_hidden_states=False).pooler_output.float()}
        if stage == "t5":
            if not options.t5.enabled:
                return {}
            tok, te = comps["tokenizer_2"], comps["text_encoder_2"]
            ids = tok(
                captions,
                padding="max_length",
                max_length=options.t5.max_length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).input_ids
            return {"t5_embeds": te(ids.to(te.device), output_hidden_states=False)[0].float()}
        raise ConfigError(f"Flux has no text stage {stage!r}.", hint=f"Stages: {', '.join(self.text_stages)}.")

    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        return common.t5_stage_tag(stage, options)

    def stage_precision(self, stage: str, options: TextEncodersConfig) -> dict[str, str] | None:
        return {"text_encoder_2": options.t5.precision} if stage == "t5" else None

    def enabled_stages(self, options: TextEncodersConfig) -> list[str]:
        return ["clip_l"] + (["t5"] if options.t5.enabled else [])

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """No per-sample conditioning besides the text (position ids are made from the latent's shape): {}."""
        return {}

    def combine_texts(
        self, stages: dict[str, dict[str, torch.Tensor]], options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """prompt_embeds = T5's tokens [B, L, 4096] (zeros without T5), pooled_prompt_embeds = CLIP-L's pooled."""
        pooled = stages["clip_l"]["clip_l_pooled"]
        t5 = (stages.get("t5") or {}).get("t5_embeds")
        if t5 is None:
            t5 = pooled.new_zeros(pooled.shape[0], options.t5.max_length, self.joint_attention_dim)
        return {"prompt_embeds": t5.to(pooled.device, pooled.dtype), "pooled_prompt_embeds": pooled}

    # ------------------------------------------------------------ training
    def denoise(
        self, transformer, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The transformer's velocity on packed 2x2 patches, unpacked back to ``noisy``'s shape; ``timesteps`` are
        sigma * 1000 (the transformer scales its sigma input by 1000 itself, as the pipeline feeds it)."""
        b, _, h, w = noisy.shape
        if h % 2 or w % 2:
            raise ConfigError(
                f"A Flux latent of {h}x{w} cannot be packed into 2x2 patches.",
                hint="Use buckets whose sides are multiples of 16 pixels (data.bucket_step: 64 does).",
            )
        text = batch["prompt_embeds"]
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=noisy.device, dtype=torch.float32)
        out = transformer(
            hidden_states=pack(noisy),
            timestep=timesteps / 1000,
            guidance=guidance,
            pooled_projections=batch["pooled_prompt_embeds"],
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
            img_ids=image_ids(h, w, noisy.device, noisy.dtype),
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def swap_blocks(self, transformer) -> list[torch.nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    # ------------------------------------------------------------ pipelines and export
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        from diffusers import FluxPipeline

        return FluxPipeline(
            transformer=comps["transformer"],
            scheduler=self.training_scheduler(mcfg),
            vae=comps["vae"],
            text_encoder=comps["text_encoder"],
            tokenizer=comps["tokenizer"],
            text_encoder_2=comps["text_encoder_2"],
            tokenizer_2=comps["tokenizer_2"],
        )

    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """pytorch_lora_weights.safetensors as FluxPipeline.load_lora_weights reads it (the transformer and CLIP-L;
        the peft configs in the header, so the loader uses the trained alpha)."""
        from diffusers import FluxPipeline

        if layers.get("text_encoder_2"):
            raise CheckpointError(
                "diffusers' Flux LoRA format has no place for T5 LoRA layers.",
                hint="Train LoRA on the transformer and CLIP-L only.",
            )
        metadata = metadata or {}
        FluxPipeline.save_lora_weights(
            save_directory=str(folder),
            transformer_lora_layers=layers.get("transformer"),
            text_encoder_lora_layers=layers.get("text_encoder"),
            transformer_lora_adapter_metadata=metadata.get("transformer"),
            text_encoder_lora_adapter_metadata=metadata.get("text_encoder"),
            safe_serialization=True,
        )

    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        raise CheckpointError(
            "Flux's Black Forest Labs single-file layout is not written yet.",
            hint="Set save.formats: [diffusers] for a Flux full fine-tune.",
        )

    def save_diffusers(
        self,
        sds: dict[str, Any],
        configs: dict[str, dict],
        folder: Path,
        mcfg: ModelConfig,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """A diffusers folder: the trained parts written, the others (T5, VAE when not given) copied from the
        source folder with its tokenizers, scheduler and model_index.json, atomically."""
        import shutil

        from ..utils import atomic_dir

        _, src = self._source(mcfg)
        with atomic_dir(Path(folder)) as tmp:
            for part in PARTS:
                if part in sds:
                    common.write_part(tmp, part, sds[part], configs[part], dtype, SAVE_AS[part])
                elif (src / part).is_dir():
                    shutil.copytree(src / part, tmp / part)
            for extra in ("tokenizer", "tokenizer_2", "scheduler"):
                if (src / extra).is_dir():
                    shutil.copytree(src / extra, tmp / extra)
            shutil.copy(src / "model_index.json", tmp / "model_index.json")
        return Path(folder)

    # ------------------------------------------------------------ tests and benchmarks
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded Flux of the real layout (guidance-distilled like [dev]) saved as a diffusers folder."""
        import shutil

        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
        from transformers import CLIPTokenizer, T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        from .sd3 import tiny_t5_tokenizer

        folder = Path(folder)
        cfgdir = bundled_config_dir("flux-tiny")
        torch.manual_seed(seed)
        comps: dict[str, Any] = {part: _new_module(part, _read_json(cfgdir / part / "config.json")) for part in PARTS}
        tokdir = folder.parent / f".{folder.name}-tokenizers"
        try:
            comps["tokenizer"] = CLIPTokenizer.from_pretrained(tiny_clip_vocab(tokdir / "tokenizer"))
            comps["tokenizer_2"] = T5TokenizerFast.from_pretrained(tiny_t5_tokenizer(tokdir / "tokenizer_2"))
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                _read_json(cfgdir / "scheduler" / "scheduler_config.json")
            )
            FluxPipeline(scheduler=sched, **comps).save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]
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
        """Random bf16 weights of a bundled architecture as a diffusers folder (Flux is read from folders so far),
        with the bundled configs, scheduler and model_index.json; no tokenizers (benchmarks give stand-ins)."""
        import json
        import shutil

        from ..utils import atomic_dir

        cfgdir = bundled_config_dir(config_name)
        comps = common.random_parts(_new_module, cfgdir, parts, device, seed)
        configs = self.module_configs(comps)
        with atomic_dir(Path(path)) as tmp:
            for part, m in comps.items():
                common.write_part(tmp, part, m.state_dict(), configs[part], torch.bfloat16, SAVE_AS[part])
            shutil.copytree(cfgdir / "scheduler", tmp / "scheduler")
            index = _read_json(cfgdir / "model_index.json")
            (tmp / "model_index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
        return Path(path)

    def cache_shapes(
        self, config_name: str, resolution: int, t5_max_length: int = 512
    ) -> dict[str, dict[str, tuple[int, ...]]]:
        cfgdir = bundled_config_dir(config_name)
        te1, te2 = (_read_json(cfgdir / p / "config.json") for p in ("text_encoder", "text_encoder_2"))
        side = resolution // 8
        return {
            "latent": {
                "latents": (_read_json(cfgdir / "vae" / "config.json")["latent_channels"], side, side),
                "crop": (2,),
            },
            "clip_l": {"clip_l_pooled": (te1["hidden_size"],)},
            "t5": {"t5_embeds": (t5_max_length, te2["d_model"])},
        }
