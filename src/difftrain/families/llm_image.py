"""What the 2026 image families share (Z-Image, Krea 2, Qwen-Image): one DiT transformer, one VAE and one language
model as the text encoder (Qwen3 / Qwen3-VL / Qwen2.5-VL), read from a diffusers folder or from the transformer file
ComfyUI users have with the other parts as files of their own; the language model's hidden states cached per caption
at the caption's own length (``collate_text`` pads a batch and keeps the lengths); a transformer-only single file;
LoRAs of the transformer alone.

A family sets the class facts below (its label, bundled config prefix, diffusers class names, file options) and
``new_module``; everything that reads folders, files and configs the same way lives here. The Qwen-Image VAE (Krea
2's and Qwen-Image's) and the 2x2 packing of latents (theirs, as Flux's) are here too.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..config.schema import ModelConfig, TextEncodersConfig
from ..errors import CacheMismatch, CheckpointError, ConfigError, DataError, ModelLoadError, UnsafeCheckpoint
from . import common, streaming
from .base import CachedItem, ModelFamily
from .common import read_json

PARTS = ("transformer", "vae", "text_encoder")
#: the families whose distilled-checkpoint warning was said in this process (once each)
_WARNED: set[str] = set()


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C]: 2x2 patches (the pipelines' _pack_latents, Flux's packing)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack_2x2` for a latent of ``h`` x ``w``."""
    b, _, d = packed.shape
    c = d // 4
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def cached_references(latent_entry: dict[str, torch.Tensor], needs: str, hint: str) -> dict[str, torch.Tensor]:
    """The edit families' ``conditioning``: the reference latents precompute cached beside a target's, or
    CacheMismatch saying which training ``needs`` them and the ``hint`` (how to make them)."""
    refs = latent_entry.get("reference_latents")
    if refs is None:
        raise CacheMismatch(f"The cached latents have no reference latents, which {needs} needs.", hint=hint)
    return {"reference_latents": refs}


def encoded_references(
    references: torch.Tensor | None, encode: Callable[[torch.Tensor], torch.Tensor], needs: str
) -> dict[str, torch.Tensor]:
    """The edit families' ``image_condition_entries``: references [B, N, 3, H, W] in [-1, 1] (each fitted to its
    target's bucket) encoded as the target's latents by ``encode`` -> "reference_latents" [B, N, C, H/8, W/8]; a
    DataError saying who ``needs`` them when there are none."""
    if references is None:
        raise DataError(f"{needs} the reference images of each target, and none were given.")
    b, n = references.shape[:2]
    lat = encode(references.flatten(0, 1))
    return {"reference_latents": lat.view(b, n, *lat.shape[1:])}


def check_2x2(label: str, h: int, w: int) -> None:
    if h % 2 or w % 2:
        raise ConfigError(
            f"A {label} latent of {h}x{w} cannot be cut into 2x2 patches.",
            hint="Use buckets whose sides are multiples of 16 pixels (data.bucket_step: 64 does).",
        )


def qwen_vae_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] -> normalised latents [B, 16, H/8, W/8] (float32): the Qwen-Image VAE's
    posterior mean of the one-frame video, ``(z - mean) / std`` per channel (the pipelines' inverse)."""
    z = vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist.mean.float()
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(shape)
    return ((z - mean) / std).squeeze(2)


def vae_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A VAE file's tensors in diffusers' names: as they are, or from Wan's own names (the Qwen-Image VAE is Wan
    2.1's layout: ComfyUI's qwen_image_vae.safetensors), through diffusers' converter."""
    sd = {k.removeprefix("vae."): v for k, v in sd.items()}
    if "encoder.conv1.weight" in sd:
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        return convert_wan_vae_to_diffusers(sd)
    return sd


class LLMImageFamily(ModelFamily):
    """The shared half of Z-Image, Krea 2 and Qwen-Image (see the module's doc)."""

    image_encoder = "vae"
    text_encoders = ("text_encoder",)
    denoiser = "transformer"
    parts = PARTS
    objective = "flow"
    text_encoder_lora_targets = ()
    trainable_text_encoders = ()  # the language model only ever encodes for the cache
    #: lora merge writes the merged transformer in the family's single-file names (the other parts are the user's
    #: unchanged files)
    mergeable = True
    kohya_layout = True
    kohya_prefixes: ClassVar[Mapping[str, str]] = {"transformer": "lora_unet"}

    #: the model in messages, its bundled configs' prefix and default, a Hub id for hints
    label: ClassVar[str]
    config_prefix: ClassVar[str]
    default_config: ClassVar[str]
    hub_example: ClassVar[str]
    #: the one text stage, the pipeline's diffusers class and how each part is saved (write_part's ``model``)
    text_stage: ClassVar[str]
    pipeline_class: ClassVar[str]
    save_as: ClassVar[Mapping[str, str | tuple[str, str]]]
    #: model.<option> naming a part's own file, the parts' names in messages, a file example per option
    file_option: ClassVar[Mapping[str, str]]
    part_labels: ClassVar[Mapping[str, str]]
    file_examples: ClassVar[Mapping[str, str]]
    #: the language model in messages, what tells the family's transformer file (for the refusal of another), and
    #: what to do when a transformer file is all there is
    encoder_name: ClassVar[str]
    file_markers: ClassVar[str]
    single_file_hint: ClassVar[str]
    #: bundled configs under config_prefix that belong to another family (whose classes differ): refused here
    foreign_configs: ClassVar[Mapping[str, str]] = {}
    #: the folders besides the parts a diffusers export copies from the source folder
    copied_folders: ClassVar[tuple[str, ...]] = ("tokenizer", "scheduler")
    #: what training a distilled (Turbo) checkpoint is warned with, or "" where the model has none
    distilled_warning: ClassVar[str] = ""

    def new_module(self, part: str, cfg: dict) -> torch.nn.Module:
        """A part built from its config (random weights; on the meta device inside ``torch.device("meta")``)."""
        raise NotImplementedError

    def diffusers_classes(self) -> dict[str, Any]:
        """Each part's class, as a diffusers folder holds it."""
        raise NotImplementedError

    def text_encoder_classes(self) -> tuple[Any, Any]:
        """(config class, model class) of the language model, for its own file quantized."""
        raise NotImplementedError

    def transformer_tensors(self, keys: Sequence[str], read) -> Any:
        """(diffusers name, tensor) of a transformer file's tensors, each read by ``read`` as its turn comes."""
        raise NotImplementedError

    # ------------------------------------------------------------ sources and configs
    def known_configs(self) -> list[str]:
        foreign = tuple(self.foreign_configs)
        return [n for n in common.config_names(self.config_prefix) if not n.startswith(foreign)]

    def bundled(self, name: str | None) -> Path:
        name = name or self.default_config
        for prefix, family in self.foreign_configs.items():  # another family's architecture under this one's prefix
            if name.startswith(prefix):
                raise ModelLoadError(
                    f"The bundled config {name!r} is a {family} architecture, not a {self.label} one.",
                    hint=f"Set family: {family} (--set family={family}), or model.config: one of "
                    f"{', '.join(self.known_configs())}.",
                )
        return common.bundled_dir(name, self.label, self.known_configs, prefix=self.config_prefix)

    def _source(self, mcfg: ModelConfig) -> tuple[str, Path]:
        return common.resolve_source(
            mcfg,
            parts=self.parts,
            no_model_hint=f"Set model.path to a diffusers {self.label} folder, a Hub id (--set model.path="
            f"{self.hub_example}) or the transformer file (with the other parts' own files).",
            missing_hint=f"Point model.path at a diffusers {self.label} folder (with transformer/, vae/, "
            f"text_encoder/, tokenizer/) or a {self.label} .safetensors file.",
            check_folder=lambda p: common.require_subfolder(p, "transformer", self.label),
        )

    def architecture(self, mcfg: ModelConfig) -> str:
        return mcfg.config or self.default_config

    def config_dir(self, name: str | None) -> Path:
        return self.bundled(name)

    def _folder(self, mcfg: ModelConfig) -> Path | None:
        """model.path when it is a diffusers folder."""
        if mcfg.path is None:
            return None
        kind, p = self._source(mcfg)
        return p if kind == "diffusers" else None

    def part_config(self, mcfg: ModelConfig, part: str) -> dict:
        """A part's config: a diffusers source folder's, else the bundled architecture's."""
        p = self._folder(mcfg)
        if p is not None and (p / part / "config.json").exists():
            return read_json(p / part / "config.json")
        return read_json(self.bundled(self.architecture(mcfg)) / part / "config.json")

    def _own_file(self, mcfg: ModelConfig, part: str) -> Path | None:
        """A part's own file (model.ae, model.text_encoder), over a folder's part too; checked."""
        option = self.file_option.get(part)
        own = getattr(mcfg, option) if option else None
        if own is None:
            return None
        f = Path(own).expanduser()
        if not f.is_file():
            raise ModelLoadError(
                f"model.{option} {f} does not exist.",
                hint=f"Give the {self.part_labels[part]} file ({self.file_examples[part]}).",
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
                f"model.prediction_type={mcfg.prediction_type} does not apply to {self.label}, which is trained by "
                "rectified flow.",
                hint="Remove model.prediction_type.",
            )
        p = self._folder(mcfg)
        base = p if p is not None and (p / "scheduler").is_dir() else self.bundled(self.architecture(mcfg))
        return read_json(base / "scheduler" / "scheduler_config.json")

    def training_scheduler(self, mcfg: ModelConfig):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config(mcfg))

    def mismatch(self, f: Path, part: str, mcfg: ModelConfig):
        """The error for a file that does not fit the bundled architecture."""

        def make(what: str) -> ModelLoadError:
            return ModelLoadError(
                f"{f.name} does not fit the bundled {self.label} architecture {self.architecture(mcfg)!r} for the "
                f"{self.part_labels[part]}: {what}",
                hint=f"Is it a {self.label} {self.part_labels[part]} file? (bundled: {', '.join(self.known_configs())})",
            )

        return make

    # ------------------------------------------------------------ loading
    @staticmethod
    def _model_names(mcfg: ModelConfig) -> str:
        return " ".join(str(x) for x in (mcfg.path, mcfg.config) if x is not None)

    def distilled(self, mcfg: ModelConfig) -> bool:
        """model.path / model.config name a distilled (Turbo) checkpoint: nothing in the files of these models says
        it, but their names do."""
        return "turbo" in self._model_names(mcfg).lower()

    def before_load(self, mcfg: ModelConfig, parts: list[str]) -> None:
        """Loading the transformer of a distilled checkpoint to train: warned, once a process."""
        if "transformer" in parts and self.distilled_warning and self.name not in _WARNED and self.distilled(mcfg):
            from ..console import warn

            _WARNED.add(self.name)
            warn(f"{self._model_names(mcfg)}: {self.distilled_warning}")

    def after_load(self, comps: dict[str, Any], mcfg: ModelConfig) -> None:
        """What the loaded parts need to know of the model (Krea 2's tapped layers)."""

    def tokenizer(self, kind: str, p: Path, mcfg: ModelConfig):
        """The language model's tokenizer: the diffusers folder's, else model.tokenizer_path (its tokenizer/ or
        itself)."""
        from transformers import AutoTokenizer

        base = p if kind == "diffusers" else (Path(mcfg.tokenizer_path).expanduser() if mcfg.tokenizer_path else None)
        if base is None:
            raise ModelLoadError(
                f"{self.encoder_name}'s tokenizer is in no model file.",
                hint=f"Set model.tokenizer_path to a folder with {self.encoder_name}'s tokenizer (tokenizer.json, "
                f"tokenizer_config.json: the tokenizer/ folder of a diffusers {self.label} download).",
            )
        folder = base / "tokenizer" if (base / "tokenizer").is_dir() else base
        if not (folder / "tokenizer_config.json").is_file():
            raise ModelLoadError(
                f"No {self.encoder_name} tokenizer in {folder} (no tokenizer_config.json).",
                hint=f"Point model.tokenizer_path at the tokenizer/ folder of a diffusers {self.label} download.",
            )
        return AutoTokenizer.from_pretrained(folder)

    def load(
        self,
        mcfg: ModelConfig,
        parts: Sequence[str],
        dtype: torch.dtype = torch.float32,
        device="cpu",
        precision: dict[str, str] | None = None,
        tokenizers: bool = True,
    ) -> dict[str, Any]:
        """Load the named parts on ``device`` (the tokenizer with the text encoder); ``precision`` may store the
        language model in int8 | nf4 (bitsandbytes, CUDA) or another float type. What can be wrong (a part no source
        has, a tokenizer nowhere) is said before a weight is read."""
        parts = list(parts)
        common.check_parts(self.label, parts, self.parts)
        kind, p = self._source(mcfg)
        self.before_load(mcfg, parts)
        dtypes, quant = common.t5_precisions(
            parts,
            dtype,
            precision,
            device,
            t5="text_encoder",
            label=self.label,
            loaded_before="the VAE and the transformer",
            encoder=self.encoder_name,
        )
        own = {part: f for part in parts if (f := self._own_file(mcfg, part)) is not None}
        rest = [part for part in parts if part not in own]
        if kind != "diffusers" and (missing := [part for part in rest if part != "transformer"]):
            raise ModelLoadError(
                f"{p.name} holds the {self.label} transformer only; it has no "
                f"{', '.join(self.part_labels[m] for m in missing)} weights.",
                hint=self.single_file_hint,
            )
        toks = {"tokenizer": self.tokenizer(kind, p, mcfg)} if tokenizers and "text_encoder" in parts else {}
        if kind == "diffusers":
            comps = common.load_diffusers_parts(
                p,
                rest,
                self.diffusers_classes(),
                dtypes,
                device,
                lambda _: f"Is it a complete {self.label} folder?",
                quant,
                check_first=True,
            )
        else:
            comps = (
                {"transformer": self.load_transformer_file(kind, p, mcfg, dtypes["transformer"], device)}
                if rest
                else {}
            )
        for part, f in own.items():
            comps[part] = self.load_part_file(part, f, mcfg, dtypes[part], device, quant.get(part))
        common.freeze(comps, parts, device, quant)
        self.after_load(comps, mcfg)
        comps.update(toks)
        return comps

    def load_transformer_file(self, kind: str, p: Path, mcfg: ModelConfig, dtype: torch.dtype, device):
        """The transformer from a file of the family's layout, streamed: each tensor read, renamed and set before
        the next (families/streaming.py)."""
        from accelerate import init_empty_weights

        keys, get, _, _ = common.open_checkpoint(kind, p)
        if not self.recognises_single_file(keys):
            raise ModelLoadError(
                f"{p.name} does not look like a {self.label} transformer (no {self.file_markers}).",
                hint=f"Give the {self.label} transformer file (fp8-stored copies too) or a diffusers {self.label} "
                "folder; another model's file needs its own family.",
            )
        config = read_json(self.bundled(self.architecture(mcfg)) / "transformer" / "config.json")
        read = common.single_file_reader(get, dtype, device, False, False)
        with init_empty_weights(include_buffers=False):
            module = self.new_module("transformer", config)
        tensors = self.transformer_tensors(keys, read)
        streaming.fill(module, "transformer", tensors, self.mismatch(p, "transformer", mcfg), common.assign_state_dict)
        return module

    def vae_tensors(self, sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
        """A VAE file's tensors in diffusers' names (diffusers' or Wan's names; Z-Image's LDM names too)."""
        return vae_state_dict(sd)

    def text_encoder_tensors(
        self, keys: Sequence[str], get: Callable[[str], torch.Tensor], dtype: torch.dtype, device, quantized: bool
    ) -> dict[str, torch.Tensor]:
        """A language-model file's tensors in the module's names: the model's, or a generation model's with
        ``model.`` and a head, which is left out; an fp8-scaled copy's weights times their scales."""
        keys, get = common.scaled_fp8(keys, get)
        read = common.single_file_reader(get, dtype, device, quantized, False)
        return {k.removeprefix("model."): read(k) for k in keys if not k.startswith("lm_head.")}

    def load_part_file(self, part: str, f: Path, mcfg: ModelConfig, dtype: torch.dtype, device, quant: str | None):
        """The VAE or the language model (``text_encoder_tensors``) from a file of its own."""
        keys, get, _, _ = common.open_checkpoint("single", f)
        if part == "vae":
            read = common.single_file_reader(get, dtype, device, quant is not None, False)
            return self.load_module(
                part, self.vae_tensors({k: read(k) for k in keys}, self.part_config(mcfg, part)), f, mcfg
            )
        sd = self.text_encoder_tensors(keys, get, dtype, device, quant is not None)
        if quant is not None:
            config_cls, model_cls = self.text_encoder_classes()
            return common.quantized_t5_from_state_dict(
                sd, self.part_config(mcfg, part), quant, dtype, device, config_cls=config_cls, model_cls=model_cls
            )
        return self.load_module(part, sd, f, mcfg)

    def load_module(self, part: str, sd: dict[str, torch.Tensor], f: Path, mcfg: ModelConfig) -> torch.nn.Module:
        """``part`` built on the meta device and given the tensors ``sd`` (every one checked)."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            module = self.new_module(part, self.part_config(mcfg, part))
        common.assign_state_dict(module, sd, self.mismatch(f, part, mcfg))
        return module

    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        return self.new_module(part, self.part_config(mcfg, part))

    def kohya_fused_groups(self, paths: Sequence[str]) -> Mapping[str, Sequence[str]]:
        """The layers the kohya layout names as one, from the transformer's module ``paths``: fused path -> its
        diffusers members, in the order the fused weight stacks them (Z-Image's and FLUX.2's q/k/v, Qwen-Image 2.1's
        SwiGLU gate and up). None by default."""
        return {}

    def kohya_fused(self, mcfg: ModelConfig, part: str) -> dict[str, tuple[tuple[tuple[str, int], ...], bool]]:
        """``kohya_fused_groups`` of the transformer with each member's output width (halves never swapped)."""
        if part != "transformer":
            return {}
        with torch.device("meta"):
            module = self.empty_part(mcfg, part)
        paths = [name for name, _ in module.named_modules()]
        return common.fused_widths(module, ((f, m, False) for f, m in self.kohya_fused_groups(paths).items()))

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
            raise ModelLoadError(
                f"{p.name} holds the {self.label} transformer only; give the {self.part_labels[part]}'s own file."
            )
        return common.hash_files(self.name, part, [p], memo)

    def module_configs(self, comps: dict[str, Any]) -> dict[str, dict]:
        return common.module_configs(comps, PARTS)

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
        bundled = self.bundled(self.architecture(mcfg))
        p = Path(mcfg.path).expanduser() if mcfg.path is not None else None
        base = p if p is not None and p.is_dir() and (p / "transformer").is_dir() else bundled
        return common.image_memory_hints(
            self, self.new_module, base, bundled, PARTS, loaded, trained, method, lora_targets, lora_rank, resolution
        )

    # ------------------------------------------------------------ text
    def stage_precision(self, stage: str, options: TextEncodersConfig) -> dict[str, str] | None:
        return {"text_encoder": options.llm.precision} if stage == self.text_stage else None

    def enabled_stages(self, options: TextEncodersConfig) -> list[str]:
        return [self.text_stage]

    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}

    def collate_text(
        self, stage: str, entries: list[dict[str, torch.Tensor]], pin: bool = False
    ) -> dict[str, torch.Tensor]:
        """Captions of several lengths in one batch: padded with zeros to the longest, their lengths kept; with
        ``pin``, in pinned host memory (as base.host_stack)."""
        states = [e["prompt_embeds"] for e in entries]
        n = max(s.shape[0] for s in states)
        pin = pin and all(s.device.type == "cpu" for s in states)
        padded = torch.empty(len(states), n, *states[0].shape[1:], dtype=states[0].dtype, pin_memory=pin)
        for i, s in enumerate(states):
            padded[i, : s.shape[0]] = s
            padded[i, s.shape[0] :] = 0
        return {"prompt_embeds": padded, "prompt_length": torch.tensor([s.shape[0] for s in states])}

    def combine_texts(
        self, stages: dict[str, dict[str, torch.Tensor]], options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        return dict(stages[self.text_stage])

    def warn_long(self, captions: list[str], lengths: Sequence[int], room: int, shown: int, encoder: str) -> None:
        """Said once per batch: the captions whose tokens (``lengths``) pass ``room``, cut to ``shown`` tokens."""
        long = [c for c, n in zip(captions, lengths) if n > room]
        if long:
            from ..console import warn

            warn(
                f"{len(long)} caption(s) longer than {self.label}'s {shown} {encoder} tokens are cut to it, "
                f"e.g. {long[0][:60]!r}..."
            )

    # ------------------------------------------------------------ export
    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """pytorch_lora_weights.safetensors as the pipeline's load_lora_weights reads it (the peft config in the
        header, so the loader uses the trained alpha)."""
        import diffusers

        extra = [part for part, sd in layers.items() if sd and part != "transformer"]
        if extra:
            raise CheckpointError(
                f"diffusers' {self.label} LoRA format has no place for {', '.join(extra)} LoRA layers.",
                hint="Train LoRA on the transformer only (the text encoder is never trained).",
            )
        getattr(diffusers, self.pipeline_class).save_lora_weights(
            save_directory=str(folder),
            transformer_lora_layers=layers.get("transformer"),
            transformer_lora_adapter_metadata=(metadata or {}).get("transformer"),
            safe_serialization=True,
        )

    def single_file_parts(self, trained: Sequence[str]) -> tuple[str, ...]:
        """A single-file export holds the transformer (the VAE and text encoder never change in fine-tuning)."""
        return ("transformer",)

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
        from ..utils import atomic_dir

        kind, src = self._source(mcfg)
        if kind != "diffusers":
            raise CheckpointError(
                f"A diffusers {self.label} folder is written from a diffusers source folder (its VAE, text encoder and "
                "tokenizer are copied from there).",
                hint="Train from the diffusers folder, or save.formats: [single_file].",
            )
        with atomic_dir(Path(folder)) as tmp:
            for part in PARTS:
                if part in sds:
                    common.write_part(tmp, part, sds[part], configs[part], dtype, self.save_as[part])
                elif (src / part).is_dir():
                    shutil.copytree(src / part, tmp / part)
            for extra in self.copied_folders:
                if (src / extra).is_dir():
                    shutil.copytree(src / extra, tmp / extra)
            shutil.copy(src / "model_index.json", tmp / "model_index.json")
        return Path(folder)

    def pipeline_kwargs(self, mcfg: ModelConfig) -> dict[str, Any]:
        """The pipeline's arguments beyond its parts (Krea 2's tapped layers and distilled flag)."""
        return {}

    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig):
        """The family's diffusers pipeline over the loaded parts, with the model's scheduler."""
        import diffusers

        return getattr(diffusers, self.pipeline_class)(
            scheduler=self.training_scheduler(mcfg),
            vae=comps["vae"],
            text_encoder=comps["text_encoder"],
            tokenizer=comps["tokenizer"],
            transformer=comps["transformer"],
            **self.pipeline_kwargs(mcfg),
        )

    # ------------------------------------------------------------ tests and benchmarks

    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """A tiny seeded model of the real layout (the language model with an offline byte-level Qwen tokenizer)
        saved as its pipeline saves it."""
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer

        from .tokenizers import tiny_qwen_tokenizer

        folder = Path(folder)
        cfgdir = self.bundled(self.tiny_config)
        torch.manual_seed(seed)
        comps: dict[str, Any] = {
            part: self.new_module(part, read_json(cfgdir / part / "config.json")) for part in PARTS
        }
        tokdir = folder.parent / f".{folder.name}-tokenizer"
        try:
            comps["tokenizer"] = AutoTokenizer.from_pretrained(tiny_qwen_tokenizer(tokdir))
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                read_json(cfgdir / "scheduler" / "scheduler_config.json")
            )
            pipe = getattr(diffusers, self.pipeline_class)(
                scheduler=sched, **comps, **self.pipeline_kwargs(ModelConfig(config=self.tiny_config))
            )
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
        model_index.json; no tokenizer: benchmarks give stand-ins)."""
        from ..utils import atomic_dir

        cfgdir = self.bundled(config_name)
        comps = common.random_parts(self.new_module, cfgdir, parts, device, seed)
        configs = self.module_configs(comps)
        with atomic_dir(Path(path)) as tmp:
            for part, m in comps.items():
                common.write_part(tmp, part, m.state_dict(), configs[part], torch.bfloat16, self.save_as[part])
            shutil.copytree(cfgdir / "scheduler", tmp / "scheduler")
            shutil.copy(cfgdir / "model_index.json", tmp / "model_index.json")
        return Path(path)
