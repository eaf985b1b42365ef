"""The ModelFamily protocol: everything the pipeline stages need from a model family.

A family loads its components (offline, from a diffusers folder or a single
file, using bundled configs), encodes pixels and prompts for the cache, draws
the training conditioning, runs the denoiser on a cached batch, names its LoRA
target modules, saves what training produced, and builds a tiny seeded copy of
itself for tests. Families never import memory techniques: they hand out plain
hints (``high_precision_modules``, ``memory_hints``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ..config.schema import ModelConfig


class ModelFamily(Protocol):
    name: str
    image_encoder: str  # the part precompute encodes pixels with
    text_encoders: tuple[str, ...]  # the parts precompute encodes captions with
    denoiser: str  # the part training always runs
    default_lora_targets: list[str]
    text_encoder_lora_targets: list[str]
    high_precision_modules: dict[str, tuple[str, ...]]  # per part: layers that stay out of fp8/nf4/int8

    # loading
    def load(self, mcfg: ModelConfig, parts: Sequence[str], dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        """Load the named parts (and what they need: tokenizers) on ``device``."""

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights for cache keys; ``memo`` (file stat -> hash) makes reruns cheap."""

    def training_scheduler(self, mcfg: ModelConfig) -> Any:
        """The noise scheduler training draws noisy latents and targets from."""

    # precompute
    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """pixels in [-1, 1], [B, 3, H, W] -> scaled latents [B, C, h, w]."""

    def encode_prompts(self, comps: dict[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        """captions -> named per-item tensors (batch first)."""

    # training
    def tokenize(self, comps: dict[str, Any], captions: list[str]) -> tuple[torch.Tensor, ...]:
        """Token ids for each text encoder (for on-the-fly encoding when a text encoder trains)."""

    def encode_tokens(self, comps: dict[str, Any], *ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Token ids -> the conditioning tensors the denoiser takes (differentiable)."""

    def time_ids(self, original_hw, crop_tl, target_hw) -> torch.Tensor:
        """Per-sample micro-conditioning (SDXL) from the cached sizes and crop."""

    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run the denoiser on a batch of cached conditioning."""

    def memory_hints(self, mcfg: ModelConfig, lora_targets: list[str], lora_rank: int, resolution: int,
                     loaded: list[str], trained: list[str], method: str) -> dict:
        """Plain numbers for the memory planner: parameter counts (meta device) and measured activation data."""

    # saving
    def save_lora(self, folder: Path, layers: dict[str, dict[str, torch.Tensor]], metadata: dict[str, dict] | None = None) -> None:
        """Write the LoRA file the family's diffusers pipeline loads."""

    def module_configs(self, comps: dict[str, Any]) -> dict[str, dict]:
        """Each loaded part's architecture config, as saved beside its weights."""

    def save_single_file(self, sds: dict[str, Any], configs: dict[str, dict], path: Path, dtype: torch.dtype | None = None) -> Path:
        """Write a full model as one file in the layout the family's checkpoints are distributed in."""

    def save_diffusers(self, sds: dict[str, Any], configs: dict[str, dict], folder: Path, mcfg: ModelConfig,
                       dtype: torch.dtype | None = None) -> Path:
        """Write a full model as a diffusers folder."""

    def pipeline(self, comps: dict[str, Any], mcfg: ModelConfig) -> Any:
        """The family's diffusers inference pipeline over loaded components."""

    # tests
    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """Write a tiny seeded model in diffusers layout to ``folder``."""
