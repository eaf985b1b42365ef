"""``train``, ``flow``, ``full``, ``ema``, ``save``, ``validation`` and ``report``: how a run trains and what it
writes besides the training state."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import Strict


# ----------------------------------------------------------------- training
class TrainConfig(Strict):
    method: Literal["lora", "full"] = "lora"
    output_dir: Path = Path("runs/difftrain")
    seed: int = 42
    mixed_precision: Literal["no", "bf16", "fp16"] = "bf16"
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    gpu_memory_limit_gib: float | None = Field(
        default=None,
        gt=0,
        description="cap this process's GPU memory (torch's per-process fraction), in training and in "
        "precompute: try a smaller card's tier on a bigger one; going over is an out-of-memory error",
    )
    batch_size: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    max_steps: int | None = Field(default=None, ge=1, description="optimizer steps; default from epochs")
    epochs: int = Field(default=1, ge=1)
    learning_rate: float = Field(default=1e-4, gt=0)
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    noise_offset: float = Field(default=0.0, ge=0)
    min_snr_gamma: float | None = Field(default=None, gt=0)
    # the loss per latent element (sd-scripts' --loss_type and Huber options, library/train_util.py)
    loss_type: Literal["l2", "l1", "huber", "smooth_l1"] = Field(
        default="l2",
        description="l2: squared error (every family's own); l1: absolute error; huber: 2c(sqrt(e^2 + c^2) - c), "
        "smooth_l1: 2(sqrt(e^2 + c^2) - c), pseudo-Huber with c from train.huber_schedule (sd-scripts' formulas)",
    )
    huber_schedule: Literal["constant", "exponential", "snr"] = Field(
        default="snr",
        description="huber/smooth_l1: c per sample from its noise level. constant: huber_c x huber_scale; "
        "exponential: huber_scale x huber_c^(t/T), from 1 at t=0 to huber_c at the last timestep T; snr: "
        "(1 - huber_c) / (1 + sigma)^2 + huber_c with sigma = sqrt((1 - alpha_bar) / alpha_bar) (DDPM) or s / (1 - s) "
        "(flow, the same quantity; sd-scripts' flow scripts refuse snr)",
    )
    huber_c: float = Field(default=0.1, gt=0, le=1, description="huber/smooth_l1: the threshold c (sd-scripts: 0.1)")
    huber_scale: float = Field(
        default=1.0, gt=0, description="huber/smooth_l1: scales c of the constant and exponential schedules"
    )
    checkpoint_every: int | None = Field(default=None, ge=1, description="save training state every N steps")
    keep_checkpoints: int | None = Field(default=None, ge=1, description="keep only the newest N checkpoints")
    log_every: int = Field(
        default=1,
        ge=1,
        description="a metrics record every N steps (losses are read from the GPU as speed.sync_seconds says)",
    )
    nonfinite: Literal["stop", "skip"] = Field(
        default="stop",
        description="a NaN/inf loss or gradient: stop with the step, the likely cause and the last good "
        "checkpoint named; skip: leave the weights unchanged for that step (checked every step: a host sync) and "
        "stop after 5 in a row",
    )
    train_text_encoders: bool = Field(default=False, description="LoRA on the text encoders too (not cached)")
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="several processes (--gpus/--nodes): times torchrun's agent restarts the group after a process "
        "dies (OOM killer, a lost GPU); each restart continues from the newest checkpoint (train.checkpoint_every)",
    )

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v):
        return "no" if v is False else v  # YAML reads a bare `no` as false


class FlowConfig(Strict):
    """Rectified-flow training (SD3, Flux): how timesteps are drawn and how the loss is weighted (diffusers' names)."""

    timestep_sampling: Literal["logit_normal", "mode", "uniform"] = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = Field(default=1.0, gt=0)
    mode_scale: float = Field(default=1.29, description="for timestep_sampling: mode")
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    shift: float | None = Field(
        default=None,
        gt=0,
        description="sigma shift; default: the model's scheduler (SD3: 3.0; Flux.1 [dev]: by the image's size, "
        "e^0.5 at 256 patches to e^1.15 at 4096)",
    )
    guidance_scale: float = Field(
        default=1.0,
        ge=0,
        description="the guidance value a guidance-distilled model is trained with (Flux.1 [dev]; 1.0 as "
        "ai-toolkit and sd-scripts train it)",
    )
    min_timestep: float | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="draw timesteps (1000 x the shifted sigma) from here up only, the shape of timestep_sampling "
        "kept inside the range (musubi-tuner's --min_timestep with --preserve_distribution_shape); default: the "
        "model's, for a two-expert model the expert's range",
    )
    max_timestep: float | None = Field(default=None, ge=0, le=1000, description="up to here only; see min_timestep")

    @model_validator(mode="after")
    def _range(self) -> FlowConfig:
        if self.min_timestep is not None and self.max_timestep is not None and self.min_timestep >= self.max_timestep:
            raise ValueError(
                f"flow.min_timestep ({self.min_timestep:g}) must be below flow.max_timestep ({self.max_timestep:g})"
            )
        return self


# ----------------------------------------------------------------- full fine-tuning
class FullConfig(Strict):
    """What a full fine-tune trains (sd-scripts' sdxl_train.py names where they exist)."""

    train_unet: bool = True
    train_text_encoder_1: bool = False
    train_text_encoder_2: bool = False
    learning_rate_te1: float | None = Field(default=None, gt=0, description="default: train.learning_rate")
    learning_rate_te2: float | None = Field(default=None, gt=0, description="default: train.learning_rate")


class EMAConfig(Strict):
    """An exponential moving average of the trained weights: ema = decay * ema + (1 - decay) * w."""

    enabled: bool = False
    decay: float = Field(default=0.9999, gt=0, lt=1)
    update_every: int = Field(
        default=1, ge=1, description="update every N optimizer steps (decay applied once per update)"
    )
    device: Literal["same", "cpu"] = Field(default="same", description="cpu keeps the EMA copy in host RAM")
    export: bool = Field(default=True, description="export the EMA weights instead of the raw ones")


ExportFormat = Literal["single_file", "diffusers"]


def _formats_default() -> list[ExportFormat]:
    # named for mypy, as _report_to_default
    return ["single_file"]


class SaveConfig(Strict):
    """Exported models of a full fine-tune (the training state is train.checkpoint_every)."""

    every_n_steps: int | None = Field(default=None, ge=1)
    every_n_epochs: int | None = Field(default=None, ge=1)
    formats: list[ExportFormat] = Field(default_factory=_formats_default)
    precision: Literal["fp16", "bf16", "fp32"] = "fp16"
    lora_formats: list[Literal["diffusers", "kohya"]] | None = Field(
        default=None,
        description="LoRA files written: diffusers (pytorch_lora_weights.safetensors) and/or kohya "
        "(lora_kohya.safetensors, for ComfyUI / A1111); default both where the family has a kohya layout",
    )
    trigger_phrase: str | None = Field(
        default=None, description="recorded in the LoRA's metadata; default dreambooth.instance_prompt"
    )


# ----------------------------------------------------------------- validation
class ValidationConfig(Strict):
    """Sample images (mp4 for video families) from fixed prompts and seed while training, and a held-out loss."""

    @model_validator(mode="after")
    def _images(self):
        if self.images and len(self.images) != len(self.prompts):
            raise ValueError(
                f"validation.images has {len(self.images)} entries for {len(self.prompts)} prompts: "
                "give one start image per prompt (image-to-video), or none"
            )
        return self

    prompts: list[str] = Field(default_factory=list, description="empty: no validation samples")
    images: list[Path | list[Path]] = Field(
        default_factory=list,
        description="image-to-video: the start image of each prompt, in order; edit training: each prompt's "
        "reference image (or list of them)",
    )
    every_n_steps: int | None = Field(
        default=None, ge=1, description="samples and validation loss; also once at the end of training"
    )
    loss_items: int = Field(
        default=0,
        ge=0,
        description="cached items held out of training (chosen by validation.seed) for a "
        "validation loss on fixed (item, noise level, noise) triples; 0: none",
    )
    loss_timesteps: int = Field(
        default=4, ge=1, description="noise levels per held-out item: the quantiles (k + 1/2) / K"
    )
    num_inference_steps: int = Field(default=25, ge=1)
    guidance_scale: float = Field(default=5.0, ge=0)
    seed: int = 0
    resolution: int | None = Field(default=None, ge=64, description="square side; default data.resolution")
    fps: int = Field(
        default=8, ge=1, description="video families: frames per second of the mp4 (CogVideoX: 8; 1.5: 16)"
    )
    cpu_offload: bool = Field(
        default=False,
        description="VAE and text encoders wait on the CPU and visit the GPU one at a time "
        "(T5 in bf16); the denoiser stays where training keeps it",
    )


# ----------------------------------------------------------------- reports
ReportSink = Literal["tensorboard", "wandb"]


def _report_to_default() -> list[ReportSink]:
    # a named factory, not a lambda: mypy types a lambda's ["tensorboard"] as list[str], not the Literal's list
    return ["tensorboard"]


class ReportConfig(Strict):
    """Where a run's metrics go besides metrics.jsonl (diffusers' scripts call it --report_to), and its report page."""

    to: list[ReportSink] = Field(
        default_factory=_report_to_default,
        description="tensorboard: event files in RUN/tensorboard; "
        "wandb: Weights & Biases (pip install wandb), offline unless report.wandb_mode is online",
    )
    wandb_project: str = "difftrain"
    wandb_mode: Literal["offline", "online"] = "offline"
    html: bool = Field(
        default=True, description="RUN/report.html (loss plots, validation samples, memory, config) and RUN/plots/*.png"
    )
