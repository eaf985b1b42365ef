"""FLUX.1 [dev] and [schnell]: a 12B MMDiT (19 double-stream and 38 single-stream blocks) on 16-channel VAE latents,
conditioned by CLIP-L's pooled output and T5-XXL's token embeddings.

Loads offline from a diffusers folder (or a Hub id), or from the single files people download
(``single_file``): the transformer alone in Black Forest Labs' names (``flux1-dev.safetensors``, fp8-stored
copies too) as model.path, with the VAE, CLIP-L and T5-XXL as their own files (model.ae / model.clip_l /
model.t5xxl, sd-scripts' option names), or ComfyUI's one-file checkpoint; the architecture configs are bundled in
``configs/`` (flux-dev, flux-schnell; flux-tiny for tests). Trained with rectified flow
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

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from ...config.schema import ModelConfig, TextEncodersConfig
from ...errors import CheckpointError, ConfigError, ModelLoadError, UnsafeCheckpoint
from .. import common, streaming
from ..base import CachedItem, ModelFamily
from ..common import hf_config as _hf_config
from ..common import read_json as _read_json
from ..llm_image import pack_2x2, unpack_2x2
from ..tokenizers import tiny_clip_vocab
from . import single_file

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
    return common.config_names("flux-")  # FLUX.1's (flux2-* are FLUX.2's, another family)


def bundled_config_dir(name: str | None) -> Path:
    return common.bundled_dir(name or DEFAULT_CONFIG, "Flux", known_configs, prefix="flux-")


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


#: FluxPipeline's 2x2 packing of latents ([B, C, h, w] <-> [B, h/2 * w/2, 4C]), shared with the 2026 image families
pack, unpack = pack_2x2, unpack_2x2


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
    # measured on the H100 (2026-11-25, docs/benchmarks.md): flux-lora-24gb (fp8, 1024 px) eager 1.266 s/step,
    # compiled without graphs 0.789 after a ~50 s first step; bf16 compiled + graphs 1.168 against 1.966 eager.
    # warm_s, dynamic_s and record_s are SD3's scaled by the transformer's size (not measured on Flux)
    compile_cost: ClassVar[Mapping[str, float]] = common.FLUX_COMPILE_COST
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
    mergeable = True
    single_file_prefixes: ClassVar[Mapping[str, str]] = single_file.PREFIXES
    kohya_layout = True
    #: sd-scripts' Flux LoRA prefixes (networks/lora_flux.py): the transformer is "lora_unet", T5 "lora_te3"
    kohya_prefixes: ClassVar[Mapping[str, str]] = {
        "transformer": "lora_unet",
        "text_encoder": "lora_te1",
        "text_encoder_2": "lora_te3",
    }
    kohya_base_version = "flux1"
    modelspec_lora_architecture = "flux-1-dev/lora"

    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        return common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint="Set model.path to a diffusers Flux folder, a Hub id "
            "(--set model.path=black-forest-labs/FLUX.1-dev) or the transformer file (flux1-dev.safetensors, with "
            "model.ae, model.clip_l and model.t5xxl for the other parts).",
            missing_hint="Point model.path at a diffusers Flux folder (with transformer/, vae/, text_encoder/ ...) or "
            "a Flux .safetensors file.",
            check_folder=lambda p: common.require_subfolder(p, "transformer", "Flux"),
        )

    def _file_keys(self, p: Path, memo: dict[Path, list[str]] | None = None) -> list[str]:
        if memo is not None and p in memo:
            return memo[p]
        kind = "pickle" if p.suffix.lower() in common.PICKLE_EXTS else "single"
        keys = common.open_checkpoint(kind, p)[0]
        if memo is not None:
            memo[p] = keys
        return keys

    def part_files(self, mcfg: ModelConfig, parts: Sequence[str]) -> dict[str, tuple[str, Path, str]]:
        """Where each part comes from: ("diffusers", folder, "") or (file kind, file, the prefix of its tensors).

        model.ae / model.clip_l / model.t5xxl name a part's own file (over a folder's part too); else model.path's
        folder, or the part's tensors in model.path's file (a ComfyUI checkpoint has them all). What is missing is
        said before anything is read, with the option that gives it."""
        kind, p = self._source(mcfg)
        memo: dict[Path, list[str]] = {}
        out: dict[str, tuple[str, Path, str]] = {}
        for part in parts:
            option = single_file.FILE_OPTION.get(part)
            own = getattr(mcfg, option) if option else None
            if own is not None:
                f = Path(own).expanduser()
                if not f.is_file():
                    raise ModelLoadError(
                        f"model.{option} {f} does not exist.",
                        hint=f"Give the {single_file.LABELS[part]} .safetensors file.",
                    )
                if f.suffix.lower() != ".safetensors" and not (
                    mcfg.allow_pickle and f.suffix.lower() in common.PICKLE_EXTS
                ):
                    raise UnsafeCheckpoint(
                        f"model.{option} {f.name} is not a .safetensors file; difftrain does not unpickle a "
                        "checkpoint by default.",
                        hint="Use the .safetensors file, or pass --allow-pickle (read with torch.load(weights_only=True)).",
                    )
                out[part] = self._file_part(part, f, self._file_keys(f, memo), f"model.{option}")
            elif kind == "diffusers":
                out[part] = ("diffusers", p, "")
            else:
                keys = self._file_keys(p, memo)
                if single_file.detect_prefix(keys) is None:
                    raise ModelLoadError(
                        f"{p.name} does not look like a Flux transformer (no double_blocks / single_blocks tensors).",
                        hint="Give flux1-dev.safetensors (or schnell, or an fp8 copy), a ComfyUI Flux checkpoint or "
                        "a diffusers Flux folder; an SDXL or SD3 file needs family: sdxl / sd3.",
                    )
                if part == "transformer" or part in single_file.parts_in_file(keys):
                    out[part] = self._file_part(part, p, keys, "model.path")
                else:
                    raise ModelLoadError(
                        f"{p.name} holds no {single_file.LABELS[part]} weights (it is the transformer alone).",
                        hint=f"Set model.{option} to the {single_file.LABELS[part]} file "
                        f"({ {'vae': 'ae.safetensors', 'text_encoder': 'clip_l.safetensors'}.get(part, 't5xxl_fp16.safetensors') }"
                        "), as ComfyUI users have it, or model.path to a diffusers Flux folder.",
                    )
        return out

    def _file_part(self, part: str, f: Path, keys: list[str], label: str) -> tuple[str, Path, str]:
        """(kind, file, prefix) of ``part`` in the file ``f`` (its tensors under ComfyUI's prefix, or the file alone)."""
        single_file.refuse_scaled_fp8(keys, f.name)
        kind = "pickle" if f.suffix.lower() in common.PICKLE_EXTS else "single"
        prefix = single_file.PREFIXES[part]
        if any(k.startswith(prefix) for k in keys):
            return kind, f, prefix
        if part == "transformer" and single_file.detect_prefix(keys) == "":
            return kind, f, ""
        found = single_file.parts_in_file(keys)
        if part in found and len(found) == 1:
            return kind, f, ""
        has = ", ".join(single_file.LABELS[x] for x in single_file.PARTS if x in found) or "nothing Flux knows"
        raise ModelLoadError(
            f"{label} {f.name} holds no {single_file.LABELS[part]} weights (it holds {has}).",
            hint=f"Give the {single_file.LABELS[part]} file there.",
        )

    def architecture(self, mcfg: ModelConfig) -> str:
        """The bundled config: model.config, else what a single file's transformer looks like, else flux-dev."""
        if mcfg.config or mcfg.path is None:
            return mcfg.config or DEFAULT_CONFIG
        kind, p = self._source(mcfg)
        if kind == "diffusers":
            return DEFAULT_CONFIG
        return single_file.guess_architecture(self._file_keys(p)) or DEFAULT_CONFIG

    def _config_dir(self, mcfg: ModelConfig, part: str = "transformer") -> Path:
        """Where ``part``'s config.json is read: model.path's folder, else the bundled architecture."""
        if mcfg.path is not None:
            kind, p = self._source(mcfg)
            if kind == "diffusers" and (p / part).is_dir():
                return p
        return bundled_config_dir(self.architecture(mcfg))

    def scheduler_config(self, mcfg: ModelConfig) -> dict:
        if mcfg.prediction_type:
            raise ConfigError(
                f"model.prediction_type={mcfg.prediction_type!r} does not apply to Flux, which is trained with "
                "rectified flow.",
                hint="Remove model.prediction_type; the flow section (flow.shift, flow.timestep_sampling, "
                "flow.guidance_scale) tunes Flux's training.",
            )
        return _read_json(self._config_dir(mcfg, "scheduler") / "scheduler" / "scheduler_config.json")

    def training_scheduler(self, mcfg: ModelConfig):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config(mcfg))

    def _tokenizers(self, mcfg: ModelConfig, names: Sequence[str]) -> dict[str, Any]:
        """From model.path's folder, else model.tokenizer_path; CLIP-L's is derived offline when neither has it."""
        from transformers import CLIPTokenizer, T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        kind, p = self._source(mcfg)
        base = p if kind == "diffusers" else (Path(mcfg.tokenizer_path).expanduser() if mcfg.tokenizer_path else None)
        out: dict[str, Any] = {}
        for name in names:
            folder = base / name if base is not None else None
            if name == "tokenizer_2":
                if folder is None or not folder.is_dir():
                    raise ModelLoadError(
                        "T5's tokenizer is in no file, and its vocabulary cannot be built offline"
                        + (f": no tokenizer_2/ in {base}." if base is not None else "."),
                        hint="Set model.tokenizer_path to a folder with tokenizer_2/ (the tokenizer folders of a "
                        "diffusers FLUX.1 download), or set text_encoders.t5.enabled: false to train without T5.",
                    )
                out[name] = T5TokenizerFast.from_pretrained(folder)
                continue
            if folder is None or (kind != "diffusers" and not folder.is_dir()):
                folder = common.offline_clip_tokenizers() / name  # CLIP-L's real vocabulary, shared with SDXL/SD3
            if not folder.is_dir():
                raise ModelLoadError(
                    f"No {name}/ folder in {folder.parent}.", hint="Is it a complete diffusers Flux folder?"
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
        """Load the named parts on ``device`` (plus the tokenizers their text encoders need); ``precision`` may
        store T5 (``text_encoder_2``) in int8 | nf4 (bitsandbytes, CUDA) or another float type."""
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        parts = list(parts)
        common.check_parts("Flux", parts, PARTS)
        dtypes, quant = common.t5_precisions(
            parts, dtype, precision, device, t5="text_encoder_2", label="Flux", loaded_before="the transformer"
        )
        # what can be wrong is said before gigabytes are read: each part's file, then the tokenizers
        sources = self.part_files(mcfg, parts)
        toks = self._tokenizers(mcfg, [TOKENIZER_OF[x] for x in parts if x in TOKENIZER_OF]) if tokenizers else {}
        classes = {
            "transformer": FluxTransformer2DModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModel,
            "text_encoder_2": T5EncoderModel,
        }
        from_folder = [x for x in parts if sources[x][0] == "diffusers"]
        comps = (
            common.load_diffusers_parts(
                sources[from_folder[0]][1],
                from_folder,
                classes,
                dtypes,
                device,
                lambda _: "Is it a Flux folder?",
                quant,
            )
            if from_folder
            else {}
        )
        for part in parts:
            if part not in comps:
                comps[part] = self._load_from_file(mcfg, part, sources[part], dtypes[part], quant.get(part), device)
        if "transformer" in comps:
            self.joint_attention_dim = int(comps["transformer"].config.joint_attention_dim)
        common.freeze(comps, parts, device, quant)
        comps.update(toks)
        return comps

    def _load_from_file(self, mcfg: ModelConfig, part: str, source, dtype, quant: str | None, device):
        """One part from a single file: its tensors read one at a time to ``device`` (fp8-stored ones cast to
        ``dtype``), renamed, and assigned to the part built on the meta device."""
        from accelerate import init_empty_weights

        kind, f, prefix = source
        arch = self.architecture(mcfg)
        config = _read_json(bundled_config_dir(arch) / part / "config.json")
        keys, get, _, _ = common.open_checkpoint(kind, f)
        part_keys = [k for k in keys if k.startswith(prefix)]
        if prefix == "" and part == "transformer":
            part_keys = [k for k in keys if not k.startswith(tuple(single_file.PREFIXES.values()))]
        read = common.single_file_reader(
            get, dtype, device, quant is not None, part == "text_encoder_2" and dtype == torch.float16
        )
        if part == "transformer":  # streamed: each tensor read, converted and set before the next
            with init_empty_weights(include_buffers=False):
                module = _new_module(part, config)
            names = [k[len(prefix) :] for k in part_keys]
            tensors = single_file.transformer_tensors(names, lambda k: read(prefix + k), config)
            streaming.fill(module, part, tensors, self._file_mismatch(f, part, keys, arch), common.assign_state_dict)
            return module
        ckpt = {k: read(k) for k in part_keys}
        if part == "vae":
            sd = single_file.vae_to_diffusers(ckpt, config)
        elif part == "text_encoder":
            sd = single_file.clip_to_diffusers(ckpt, prefix)
        else:
            sd = single_file.t5_to_diffusers(ckpt, prefix)
        del ckpt
        if quant is not None:
            return common.quantized_t5_from_state_dict(sd, config, quant, dtype, device)

        with init_empty_weights(include_buffers=False):
            module = _new_module(part, config)
        if part == "text_encoder" and not hasattr(module, "text_model"):  # transformers >= 5.6: no wrapper
            sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
        common.assign_state_dict(module, sd, self._file_mismatch(f, part, keys, arch))
        if part == "text_encoder_2":  # assign=True replaced shared.weight: re-tie the encoder's embedding
            module.encoder.embed_tokens.weight = module.shared.weight
        return module

    @staticmethod
    def _file_mismatch(f: Path, part: str, keys: Sequence[str], arch: str) -> Callable[[str], ModelLoadError]:
        def mismatch(what: str) -> ModelLoadError:
            guess = single_file.guess_architecture(keys) if part == "transformer" else None
            hint = f"Set model.config to the file's architecture (bundled: {', '.join(known_configs())})."
            if guess and guess != arch:
                hint = f"The file's transformer looks like {guess}: set model.config: {guess}."
            return ModelLoadError(
                f"{f.name} does not fit the bundled architecture {arch!r} for the {single_file.LABELS[part]}: {what}",
                hint=hint,
            )

        return mismatch

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        module = _new_module(part, _read_json(self._config_dir(mcfg, part) / part / "config.json"))
        if part == "transformer":
            self.joint_attention_dim = int(module.config.joint_attention_dim)
        return module

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        return class_name.startswith("Flux") and not class_name.startswith("Flux2")  # FLUX.2 is its own family

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        """A FLUX.1 transformer: BFL's block names with each double block's own modulation (FLUX.2 shares one)."""
        return single_file.is_flux_file(keys) and any(k.endswith("double_blocks.0.img_mod.lin.weight") for k in keys)

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        return single_file.guess_architecture(keys)

    def parts_in_single_file(self, keys: Sequence[str]) -> list[str]:
        found = single_file.parts_in_file(keys)
        return [p for p in PARTS if p in found]

    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """sd-scripts' Flux names: the transformer's modules by their BFL paths (``double_blocks.0.img_attn.proj``),
        CLIP-L's by transformers' (``text_model.encoder...``). A module fused in the BFL layout (q/k/v, and the
        single blocks' q/k/v/MLP) is named by ``kohya_fused``."""
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        if part != "transformer":
            return common.adaptable_paths(module, common.clip_kohya_path)
        return {
            pair.members[0]: pair.bfl
            for pair in single_file.kohya_groups(cast(Mapping, module.config))
            if len(pair.members) == 1 and not pair.swap
        }

    def kohya_fused(self, mcfg: ModelConfig, part: str) -> dict[str, tuple[tuple[tuple[str, int], ...], bool]]:
        """The transformer's modules that one sd-scripts LoRA name covers: BFL path -> ((module, output width)
        in the order the fused weight stacks them, whether the output's halves are swapped)."""
        if part != "transformer":
            return {}
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        groups = single_file.kohya_groups(cast(Mapping, module.config))
        return common.fused_widths(module, ((p.bfl, p.members, p.swap) for p in groups if len(p.members) > 1 or p.swap))

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of the part's weights: a folder's part files, or only the part's tensors of a file."""
        kind, f, prefix = self.part_files(mcfg, [part])[part]
        if kind == "diffusers":
            files = common.weight_files(f / part) if (f / part).is_dir() else []
            return common.split_fingerprint(self.name, part, kind, files, memo, {})
        return common.split_fingerprint(self.name, part, kind, [f], memo, {part: prefix})

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
        if p is not None and p.is_file() and not mcfg.config:
            base = bundled = bundled_config_dir(single_file.guess_architecture(self._file_keys(p)) or DEFAULT_CONFIG)
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
        """The transformer alone in Black Forest Labs' layout (what flux1-dev.safetensors is: ComfyUI's "Load
        Diffusion Model", sd-scripts and the BFL code read it), or, given other parts too, ComfyUI's one-file
        checkpoint layout. Tensors are written one at a time, atomically; a fused projection is concatenated only
        while it is written."""
        from ...utils import stream_save_safetensors
        from ..common import LazyTensors

        tensors = LazyTensors(single_file.to_single_file(sds, configs))
        arch = "flux-1-dev" if (configs.get("transformer") or {}).get("guidance_embeds", True) else "flux-1-schnell"
        return stream_save_safetensors(
            path, tensors, metadata={"format": "pt", "modelspec.architecture": arch}, dtype=dtype
        )

    def single_file_parts(self, trained: Sequence[str]) -> tuple[str, ...]:
        """A full fine-tune of the transformer alone is written as the BFL transformer file (the VAE and text
        encoders are the user's unchanged files); one that also trained CLIP-L as a whole ComfyUI checkpoint."""
        return ("transformer",) if set(trained) <= {"transformer"} else PARTS

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

        from ...utils import atomic_dir

        kind, src = self._source(mcfg)
        if kind != "diffusers":
            missing = [x for x in PARTS if x not in sds]
            if missing:
                raise CheckpointError(f"A diffusers folder from Flux single files needs every part; missing {missing}.")
            tok_base = Path(mcfg.tokenizer_path).expanduser() if mcfg.tokenizer_path else None
            toks = {
                name: (tok_base / name if tok_base is not None and (tok_base / name).is_dir() else None)
                for name in ("tokenizer", "tokenizer_2")
            }
            toks["tokenizer"] = toks["tokenizer"] or common.offline_clip_tokenizers() / "tokenizer"
            if toks["tokenizer_2"] is None:
                raise CheckpointError(
                    "A diffusers Flux folder needs T5's tokenizer, which no single file carries.",
                    hint="Set model.tokenizer_path to a folder with tokenizer_2/, or save.formats: [single_file].",
                )
            src = bundled_config_dir(self.architecture(mcfg))
        with atomic_dir(Path(folder)) as tmp:
            for part in PARTS:
                if part in sds:
                    common.write_part(tmp, part, sds[part], configs[part], dtype, SAVE_AS[part])
                elif (src / part).is_dir():
                    shutil.copytree(src / part, tmp / part)
            if kind == "diffusers":
                for extra in ("tokenizer", "tokenizer_2"):
                    if (src / extra).is_dir():
                        shutil.copytree(src / extra, tmp / extra)
            else:
                for name, tok in toks.items():
                    assert tok is not None  # checked above
                    shutil.copytree(tok, tmp / name)
            shutil.copytree(src / "scheduler", tmp / "scheduler")
            shutil.copy(src / "model_index.json", tmp / "model_index.json")
        return Path(folder)

    # ------------------------------------------------------------ tests and benchmarks
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded Flux of the real layout (guidance-distilled like [dev]) saved as a diffusers folder."""
        import shutil

        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
        from transformers import CLIPTokenizer, T5TokenizerFast  # type: ignore[attr-defined]  # v5: an untyped alias

        from ..tokenizers import tiny_t5_tokenizer

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

        from ...utils import atomic_dir

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
