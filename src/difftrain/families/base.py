"""The ModelFamily protocol: everything the pipeline stages need from a model family.

A family loads its components (offline, from a diffusers folder or a single
file, using bundled configs), encodes pixels and prompts for the cache, draws
the training target, runs the denoiser on a cached batch, names its LoRA
target modules, and builds a tiny seeded copy of itself for tests.
Families never import memory techniques: they hand out plain hints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ..config.schema import ModelConfig


class ModelFamily(Protocol):
    name: str
    #: parts whose outputs precompute caches, and the cache entry kind each fills
    image_encoder: str
    text_encoders: tuple[str, ...]
    denoiser: str

    def load(self, mcfg: ModelConfig, parts: Sequence[str], dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        """Load the named parts (and what they need: tokenizers, scheduler)."""

    def fingerprint(self, mcfg: ModelConfig, part: str, memo: dict[str, str]) -> str:
        """A content hash of one part's weights for cache keys; ``memo`` (file stat -> hash) makes reruns cheap."""

    def encode_images(self, comps: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """pixels in [-1, 1], [B, 3, H, W] -> scaled latents [B, C, h, w]."""

    def encode_prompts(self, comps: dict[str, Any], captions: list[str]) -> dict[str, torch.Tensor]:
        """captions -> named per-item tensors (batch first)."""

    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run the denoiser on a batch of cached conditioning."""

    def build_tiny(self, folder: Path, seed: int = 0) -> Path:
        """Write a tiny seeded model in diffusers layout to ``folder``."""
