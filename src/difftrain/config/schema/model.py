"""``model``: where the weights come from."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from .base import Strict


class ModelConfig(Strict):
    path: Path | None = Field(default=None, description="diffusers folder or single-file checkpoint")
    config: str | None = Field(
        default=None,
        description="bundled architecture config used for single-file checkpoints (offline); "
        "default: the family's base model (sdxl-base-1.0, sd3-medium)",
    )
    tokenizer_path: Path | None = Field(
        default=None, description="folder with tokenizer/ and tokenizer_2/ for single-file checkpoints"
    )
    # Flux's parts as separate files, named as sd-scripts' flux_train_network.py names them (--ae, --clip_l, --t5xxl):
    # model.path is then the transformer alone (flux1-dev.safetensors); each may also replace a folder's part
    ae: Path | None = Field(
        default=None,
        description="the VAE's own file: Flux's ae.safetensors (BFL/LDM names), Wan's wan_2.1_vae.safetensors",
    )
    clip_l: Path | None = Field(default=None, description="Flux: the CLIP-L file (clip_l.safetensors)")
    t5xxl: Path | None = Field(
        default=None,
        description="the T5 encoder's own file: Flux's t5xxl_fp16.safetensors, Wan's umt5_xxl_fp16.safetensors "
        "(fp8-stored ones too)",
    )
    text_encoder: Path | None = Field(
        default=None,
        description="the language-model text encoder's own file: Z-Image's qwen_3_4b.safetensors (transformers' "
        "names, with or without model.); its tokenizer from model.tokenizer_path",
    )
    allow_pickle: bool = Field(default=False, description="allow .ckpt/.pt/.bin (loaded with weights_only=True)")
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        default=None, description="override the scheduler's prediction type"
    )
    expert: Literal["high_noise", "low_noise", "both"] | None = Field(
        default=None,
        description="a two-expert model (Wan2.2 A14B): the expert this run trains, high_noise (transformer/, "
        "timesteps from the model's boundary up) or low_noise (transformer_2/, below it); both: `difftrain train` "
        "trains one after the other, each with its own LoRA and range, in train.output_dir/high_noise and "
        "/low_noise",
    )
