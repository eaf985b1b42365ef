"""The model family base class: everything the pipeline stages need from a model family.

A family loads its components (offline, from a diffusers folder or a single
file, using bundled configs), encodes pixels and prompts for the cache, draws
the training conditioning, runs the denoiser on a cached batch, names its LoRA
target modules, saves what training produced, and builds a tiny seeded copy of
itself for tests. Families never import memory techniques: they hand out plain
hints (``high_precision_modules``, ``memory_hints``).

Every family subclasses :class:`ModelFamily`: the abstract methods are what each must implement, the class
attributes without a default are the facts each must state, and the optional capabilities (video, image
conditioning, kohya LoRA names ...) have defaults here, so the rest of difftrain reads them directly instead
of probing with getattr. tests/unit/test_families.py checks every registered family against this class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import torch

from ..config.schema import ModelConfig, TextEncodersConfig


class CachedItem(Protocol):
    """What a family reads of a cached item (``difftrain.data.index.IndexItem``, which families do not import:
    data/ and families/ are independent layers)."""

    @property
    def bucket(self) -> tuple[int, int]: ...  # (width, height) in pixels

    @property
    def original_size(self) -> tuple[int, int]: ...  # (height, width) of the source


def host_stack(xs: Sequence[torch.Tensor], pin: bool = False) -> torch.Tensor:
    """``torch.stack(xs)``; with ``pin``, stacked straight into a pinned host buffer (one host copy where a stack and
    then ``pin_memory()`` make two; ``pin_memory()`` of the result is the result itself). The buffer comes from
    torch's pinned-memory cache, which does not hand it out again before a copy queued from it is done."""
    if not pin or any(x.device.type != "cpu" for x in xs):
        return torch.stack(list(xs))
    out = torch.empty((len(xs), *xs[0].shape), dtype=xs[0].dtype, pin_memory=True)
    return torch.stack(list(xs), out=out)


class ModelFamily(ABC):
    name: ClassVar[str]  # the config's ``family`` value
    image_encoder: ClassVar[str]  # the part precompute encodes pixels with
    text_encoders: ClassVar[tuple[str, ...]]  # the parts precompute encodes captions with
    #: precompute loads each group of text encoders on its own, encodes every caption, frees it:
    #: peak memory is that of the largest group. Each stage is cached under its own key.
    text_stages: ClassVar[Mapping[str, tuple[str, ...]]]
    denoiser: ClassVar[str]  # the part training always runs
    #: the training objective: "ddpm" (epsilon / v-prediction, from the scheduler config)
    #: or "flow" (rectified flow: x_t = (1 - s) x0 + s noise, target noise - x0)
    objective: ClassVar[Literal["ddpm", "flow"]]
    parts: ClassVar[tuple[str, ...]]  # every part of the model, in the order its folders and files hold them
    default_lora_targets: ClassVar[Sequence[str]]
    text_encoder_lora_targets: ClassVar[Sequence[str]]
    trainable_text_encoders: ClassVar[tuple[str, ...]]  # what train_text_encoders / full.train_text_encoder_N train
    high_precision_modules: ClassVar[Mapping[str, tuple[str, ...]]]  # per part: layers kept out of fp8/nf4/int8
    repeated_blocks: ClassVar[tuple[str, ...]]  # class names of the denoiser blocks speed.compile compiles one by one
    #: speed auto's estimate (difftrain.speed.CompileCost's fields): the first step's compile time, cold and from a
    #: warm cache, and the seconds a step saves compiled with and without CUDA graphs, measured on an H100
    compile_cost: ClassVar[Mapping[str, float]]

    # ------------------------------------------------------------ optional capabilities (defaults: none)
    #: DeepSpeed ZeRO-3 settings measured faster for the family's denoiser, merged into the generated config under
    #: zero_optimization (memory.engine.family_settings false leaves DeepSpeed's own; config_file overrides both).
    #: Empty: none measured, DeepSpeed's own
    zero3_settings: ClassVar[Mapping[str, Any]] = {}
    #: the guidance value a guidance-distilled denoiser is trained with (Flux.1 [dev]; flow.guidance_scale, set by
    #: the objective); the others take none
    guidance_scale: float = 1.0
    #: speed.attention auto leaves cuDNN's attention out (torch picks among flash, efficient, math): its backward
    #: failed on the family's shapes ("mha_graph.execute ... is_good()": Flux.1 [dev] LoRA at 1024 px, 4 608 tokens,
    #: H100, torch 2.11 + CUDA 13, 2026-11-25)
    avoid_cudnn_attention: ClassVar[bool] = False
    #: conditioning inputs ``denoise`` takes in float32 whatever the compute precision (SDXL's size and crop ids)
    full_precision_inputs: ClassVar[tuple[str, ...]] = ()
    #: a video family: cached latents have a frame axis, ``memory_hints`` and ``cache_shapes`` take a frame count
    video: ClassVar[bool] = False
    #: the denoiser also takes first-frame image latents (precompute caches ``image_condition_entries``)
    image_conditioned: ClassVar[bool] = False
    #: the denoiser also takes reference images (Qwen-Image-Edit): precompute pairs each target with its references
    #: (data/pairs.py), decodes them fitted to the target's bucket and hands them to ``image_condition_entries``
    #: (``references=``), and encodes each caption with them (``encode_prompts_with_images``)
    references: ClassVar[bool] = False
    #: edit training whose caption is encoded with the references as the VAE sees them, fitted to the target's bucket
    #: (Qwen-Image 2.1: a reference fills as many vision tokens as its latents have 2x2 groups): precompute hands
    #: ``encode_prompts_with_images`` the fitted references and keys the text entry by the bucket (and the crop)
    text_references_fitted: ClassVar[bool] = False
    #: the recipe that trains the family's tiny seeded model (``build_tiny``): what ``difftrain quickstart --family``
    #: runs; None: no quickstart. A family sharing another's recipe (image-to-video) sets its own config over it
    tiny_recipe: ClassVar[str | None] = None
    #: the side of the square of latent pixels the denoiser makes one image token of (2: Flux's 2x2 packing; 1:
    #: latents read unpatched): what a dynamic shift counts an image's tokens by (objectives.dynamic_shift)
    latent_patch: ClassVar[int] = 2
    #: the bundled config of the tiny model, when the tiny recipe names another family's
    tiny_config: ClassVar[str | None] = None
    #: its LoRAs can also be written as sd-scripts names them (lora.kohya, ``kohya_names``)
    kohya_layout: ClassVar[bool] = False
    #: what a LoRA file's header names the base model as: sd-scripts' ss_base_model_version (None: the family's
    #: name) and the SAI model spec's modelspec.architecture (None: "<name>/lora"), which A1111 and ComfyUI show
    #: the kohya name prefix of each part, where the family's differ from sd-scripts' SD ones (lora.kohya.PREFIXES)
    kohya_prefixes: ClassVar[Mapping[str, str] | None] = None
    #: the second LoRA file in the model's original names under this prefix with peft's lora_A / lora_B and the
    #: alpha folded in, instead of kohya's names (Krea 2: what both ComfyUI and diffusers' converter read)
    lora_native_prefix: ClassVar[str | None] = None
    kohya_base_version: ClassVar[str | None] = None
    modelspec_lora_architecture: ClassVar[str | None] = None
    #: ``difftrain lora merge`` can bake its LoRAs into a single file: it has a single-file layout, whose parts'
    #: keys start with these prefixes (part -> prefix), and ``recognises_single_file`` / ``recognises_folder``
    mergeable: ClassVar[bool] = False
    single_file_prefixes: ClassVar[Mapping[str, str]] = {}

    def recognises_single_file(self, keys: Sequence[str]) -> bool:
        """The tensor names of a single-file checkpoint are this family's layout."""
        return False

    def parts_in_single_file(self, keys: Sequence[str]) -> list[str]:
        """The parts a single file's tensors hold (by ``single_file_prefixes``)."""
        return [p for p in self.parts if any(k.startswith(self.single_file_prefixes[p]) for k in keys)]

    def recognises_folder(self, folder: Path, class_name: str) -> bool:
        """A diffusers folder (its model_index.json's ``_class_name``) holds this family."""
        return False

    def single_file_architecture(self, keys: Sequence[str]) -> str | None:
        """The bundled architecture a single file's keys match, where the family can tell (None: the default)."""
        return None

    def encode_first_frame(
        self, comps: dict[str, Any], pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Image-to-video families: the image conditioning of a batch of clips (cached beside their latents)."""
        raise NotImplementedError(f"{self.name} is not image-conditioned")

    def image_condition_entries(
        self, comps: dict[str, Any], pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Image-to-video families: what precompute caches beside a batch's latents for the image conditioning, by
        the names ``conditioning`` reads them back under."""
        raise NotImplementedError(f"{self.name} is not image-conditioned")

    def encode_prompts_with_images(
        self,
        comps: dict[str, Any],
        captions: list[str],
        images: list[list[Any]],
        stage: str,
        options: TextEncodersConfig,
        mcfg: ModelConfig,
    ) -> dict[str, Any]:
        """Families with ``references``: each caption encoded with its reference images (PIL, as read), as the
        family's pipeline encodes an instruction; per-item tensors by name, as ``encode_prompts``."""
        raise NotImplementedError(f"{self.name} takes no reference images")

    def validation_image(self, images: list[Any], side: int, mcfg: ModelConfig) -> Any:
        """An image-conditioned family's validation prompt's images (PIL, as read) as its pipeline's ``image``
        argument: the start frame fitted to the sample's square side (image-to-video)."""
        return images[0].resize((side, side))

    def timestep_range(self, mcfg: ModelConfig) -> tuple[float, float] | None:
        """The noise levels (shifted sigmas, timestep / 1000) the denoiser is trained on, where it is not all of
        them (a two-expert model's expert: Wan2.2 A14B); None: all."""
        return None

    def drop_image_conditioning(
        self, batch: dict[str, torch.Tensor], generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Image-to-video families: ``batch`` with its image conditioning sometimes dropped (drawn from
        ``generator``). Other families: ``batch`` as it is, and nothing drawn."""
        return batch

    def collate_text(
        self, stage: str, entries: list[dict[str, torch.Tensor]], pin: bool = False
    ) -> dict[str, torch.Tensor]:
        """The cached entries of one text stage for a batch, stacked (a family whose entries differ in length,
        Z-Image's unpadded Qwen3 states, pads them here and keeps the lengths). ``pin``: into pinned host memory
        (the feed asks for it when a CUDA GPU trains with speed.pin_memory; see host_stack)."""
        return {k: host_stack([e[k] for e in entries], pin) for k in entries[0]}

    def kept_clean(self, latents: torch.Tensor) -> torch.Tensor | None:
        """Where the noisy input keeps the clean latents: a bool mask broadcastable to ``latents`` (the conditioning
        frames of a model that conditions in place: Wan2.2 TI2V-5B's first frame in image-to-video); those
        positions are left out of the loss. None: every latent is noised and learned (every other family)."""
        return None

    # loading
    @abstractmethod
    def load(
        self,
        mcfg: ModelConfig,
        parts: Sequence[str],
        dtype: torch.dtype,
        device: torch.device | str,
        precision: dict[str, str] | None = None,
        tokenizers: bool = True,
    ) -> dict[str, Any]:
        """Load the named parts (and what they need: tokenizers, unless ``tokenizers`` is False) on ``device``.

        ``precision`` may name a storage precision per part that differs from
        ``dtype`` (SD3's T5: "int8" | "nf4" through bitsandbytes, or a float type).
        """

    @abstractmethod
    def empty_part(self, mcfg: ModelConfig, part: str) -> torch.nn.Module:
        """``part`` built from the model's config (the folder's, else the bundled architecture's) without reading a
        weight: what DeepSpeed's ``zero.Init`` partitions as it is built, to be filled from the weights after."""

    @abstractmethod
    def kohya_names(self, mcfg: ModelConfig, part: str) -> dict[str, str]:
        """For each Linear/Conv module of ``part`` (diffusers path), the path its kohya LoRA name is made of
        (SDXL's UNet: the original LDM path); raises ConfigError for a family without that layout."""

    def kohya_fused(self, mcfg: ModelConfig, part: str) -> dict[str, tuple[tuple[tuple[str, int], ...], bool]]:
        """Modules the kohya layout names as one (Flux's fused q/k/v): kohya path -> ((diffusers module, output
        width) in the order the fused weight stacks them, whether the output's two halves are swapped). {}: none."""
        return {}

    @abstractmethod
    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights for cache keys; ``memo`` (file stat -> hash) makes reruns cheap."""

    @abstractmethod
    def training_scheduler(self, mcfg: ModelConfig) -> Any:
        """The noise scheduler training draws noisy latents and targets from."""

    # precompute
    @abstractmethod
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """pixels in [-1, 1], [B, 3, H, W] -> scaled latents [B, C, h, w]."""

    @abstractmethod
    def encode_prompts(
        self, comps: dict[str, Any], captions: list[str], stage: str, options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """captions -> named per-item tensors (batch first) of one text stage (its encoders loaded in ``comps``)."""

    @abstractmethod
    def text_stage_tag(self, stage: str, options: TextEncodersConfig) -> str:
        """What besides weights and dtype decides a stage's output (T5 precision, length): part of its cache key."""

    @abstractmethod
    def stage_precision(self, stage: str, options: TextEncodersConfig) -> dict[str, str] | None:
        """The ``precision`` argument ``load`` gets for one text stage (None: the precompute dtype)."""

    @abstractmethod
    def enabled_stages(self, options: TextEncodersConfig) -> list[str]:
        """The text stages that run (SD3 without T5: its embeddings are zeros, the encoder never loads)."""

    @abstractmethod
    def conditioning(self, item: CachedItem, latent_entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One sample's non-text denoiser inputs (SDXL: time ids) from its index item and latent cache entry."""

    @abstractmethod
    def combine_texts(
        self, stages: dict[str, dict[str, torch.Tensor]], options: TextEncodersConfig
    ) -> dict[str, torch.Tensor]:
        """Batched outputs of each enabled text stage (cached, or encoded on the fly when one of its encoders
        trains) -> the text conditioning the denoiser takes ("prompt_embeds", "pooled_prompt_embeds")."""

    # training
    @abstractmethod
    def denoise(
        self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Run the denoiser on a batch of conditioning (``timesteps``: integer steps for ddpm,
        sigma * 1000 as floats for flow)."""

    @abstractmethod
    def swap_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The denoiser's repeated blocks, in forward order: what block swap may keep in host memory."""

    def unused_parameters(self, denoiser: torch.nn.Module) -> list[str]:
        """Names of the denoiser's parameters that take no part in its output (a full fine-tune leaves them frozen:
        no gradient reaches them, and DDP refuses a trained parameter that gets none). None in most families."""
        return []

    def split_blocks(self, blocks: list[torch.nn.Module]) -> int:
        """memory.activations.split: each block's forward as checkpointed segments (its attentions and feed-forward
        with the norms and residuals around them), so a block recomputed in backward holds one segment's tensors at
        a time; returns how many blocks took it (0: the family has no segmented forward, split does nothing)."""
        return 0

    @abstractmethod
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
        """Plain numbers for the memory planner: parameter counts (meta device) and measured activation data.
        Optional: "checkpoint_input_bytes", the bytes per latent pixel that checkpointing keeps (the blocks'
        inputs), which memory.activations.offload moves to host RAM (none stated: the planner moves nothing), and
        "checkpoint_blocks", how many blocks hold them (memory.activations.keep_on_gpu keeps that many of them);
        "attention_output_bytes", the bytes per latent pixel of every block's attention outputs together, which
        memory.activations.save_attention keeps beside the checkpoints (none stated: the planner cannot count it)."""

    # saving
    @abstractmethod
    def save_lora(
        self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None
    ) -> None:
        """Write the LoRA file the family's diffusers pipeline loads."""

    @abstractmethod
    def module_configs(self, comps: dict[str, Any]) -> dict[str, dict]:
        """Each loaded part's architecture config, as saved beside its weights."""

    @abstractmethod
    def save_single_file(
        self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None
    ) -> Path:
        """Write a full model as one file in the layout the family's checkpoints are distributed in."""

    def single_file_parts(self, trained: Sequence[str]) -> tuple[str, ...]:
        """The parts a full fine-tune's single file holds, given the trained ones: all (the distributed layout
        is one file with every part) unless the family's layout keeps parts in files of their own."""
        return (self.denoiser, self.image_encoder, *self.text_encoders)

    @abstractmethod
    def save_diffusers(
        self,
        sds: dict[str, Any],
        configs: dict[str, dict],
        folder: Path,
        mcfg: ModelConfig,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """Write a full model as a diffusers folder."""

    @abstractmethod
    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig) -> Any:
        """The family's diffusers inference pipeline over loaded components."""

    # tests and benchmarks
    @abstractmethod
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """Write a tiny seeded model in diffusers layout to ``folder``."""

    @abstractmethod
    def build_random(
        self,
        config_name: str,
        path: Path,
        device: str | torch.device = "cpu",
        seed: int = 0,
        parts: Sequence[str] = ...,
    ) -> Path:
        """Random weights of a bundled architecture's ``parts`` (default: all), saved loadable by ``load``
        (the memory and speed of a real one)."""

    @abstractmethod
    def cache_shapes(self, config_name: str, resolution: int) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of one cached item at the largest square bucket: {"latent": {...}, <text stage>: {...}}."""

    def synthetic_text(
        self, stage: str, shapes: dict[str, tuple[int, ...]], latents: tuple[int, ...], generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """A random cache entry of a text ``stage`` of ``shapes`` (bench's synthetic cache, for an item whose latents
        have the shape ``latents``): random normal tensors, unless the family's entries hold more than numbers."""
        return {k: torch.randn(v, generator=generator) for k, v in shapes.items()}


def stage_precisions(family: ModelFamily, options: TextEncodersConfig, stages) -> dict[str, str] | None:
    """The ``precision`` argument of ``family.load`` for the encoders of several text stages (None: none set)."""
    out: dict[str, str] = {}
    for stage in stages:
        out.update(family.stage_precision(stage, options) or {})
    return out or None
