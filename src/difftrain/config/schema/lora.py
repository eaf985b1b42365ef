"""``lora``: the adapter a LoRA run trains."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from .base import Strict


class LoraConfig(Strict):
    rank: int = Field(default=16, ge=1)
    alpha: float | None = Field(default=None, gt=0, description="default: rank")
    dropout: float = Field(default=0.0, ge=0, lt=1)
    targets: list[str] = Field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    init: Literal["gaussian", "default"] = "gaussian"
    init_weights: Path | None = Field(
        default=None,
        description="a LoRA file (diffusers or kohya layout) to continue training "
        "from; its rank, alpha and layers must match this config",
    )
