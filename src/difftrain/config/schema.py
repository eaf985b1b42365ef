"""The training configuration, as pydantic models.

Every model forbids unknown keys, so a typo is an error with its dotted path.
Memory techniques are tagged unions (``{kind: ...}``) so an error points at the
chosen option. Cross-field rules live in validators whose messages say what to
change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class Strict(BaseModel):
    # NaN and infinity are refused everywhere (a NaN learning rate would train silently to garbage)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
            raise ValueError(f"{v} is too large (at most 2^63 - 1)")
        return v


# ----------------------------------------------------------------- model
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
    ae: Path | None = Field(default=None, description="Flux: the VAE file (ae.safetensors), BFL/LDM names")
    clip_l: Path | None = Field(default=None, description="Flux: the CLIP-L file (clip_l.safetensors)")
    t5xxl: Path | None = Field(
        default=None, description="Flux: the T5-XXL encoder file (t5xxl_fp16.safetensors; fp8-stored ones too)"
    )
    allow_pickle: bool = Field(default=False, description="allow .ckpt/.pt/.bin (loaded with weights_only=True)")
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        default=None, description="override the scheduler's prediction type"
    )


# ----------------------------------------------------------------- data
class DataConfig(Strict):
    dir: Path | None = Field(default=None, description="folder of images with caption/tag files")
    metadata: Path | None = Field(default=None, description="merge-tags JSON (optional)")
    allow_outside_paths: bool = Field(
        default=False,
        description="let dataset files lead outside data.dir: links to files "
        "elsewhere, videos.txt lines with absolute or ../ paths, metadata keys naming "
        "other folders (off: refused, so a dataset from elsewhere cannot read your files)",
    )
    caption_ext: str = ".caption"
    tag_ext: str = ".txt"
    caption_source: Literal["caption_then_tags", "caption_and_tags", "tags"] = "caption_then_tags"
    resolution: int = Field(default=1024, ge=64, le=16384, description="bucket max area = resolution^2")
    bucket_step: int = Field(default=64, ge=8)
    min_side: int = Field(default=512, ge=8, le=16384)
    max_side: int = Field(default=2048, ge=8, le=16384)
    no_upscale: bool = False
    max_upscale: float | None = Field(
        default=4.0,
        ge=1,
        description="skip (and report) an image that would have to be "
        "enlarged more than this to fill its bucket; null: any",
    )
    random_crop: bool = False
    cache_dir: Path | None = Field(default=None, description="precompute cache (default: <data.dir>/.difftrain-cache)")
    frames: int = Field(
        default=49, ge=1, description="video families: the longest frame bucket (4k+1; CogVideoX was trained with 49)"
    )
    frame_sampling: Literal["uniform", "first"] = Field(
        default="uniform", description="video families: frames spread evenly over the clip, or the first N"
    )
    caption_fallback: Literal["empty", "filename"] = Field(
        default="empty",
        description="an image with neither caption nor tags: the empty caption, or its file name "
        "(underscores as spaces); the tags as a caption's fallback are caption_source: caption_then_tags",
    )
    # caption augmentation (sd-scripts' names); works with cached text embeddings (see data/captions.py)
    shuffle_caption: bool = Field(default=False, description="shuffle the comma-separated tags of each caption")
    keep_tokens: int = Field(
        default=0, ge=0, description="the first N tags stay first and are never shuffled or dropped"
    )
    keep_tokens_separator: str = Field(
        default="",
        description="if set and present in a caption, what precedes it is kept instead of the first keep_tokens tags",
    )
    caption_separator: str = Field(default=",", min_length=1, description="what separates tags in a caption")
    caption_tag_dropout_rate: float = Field(
        default=0.0, ge=0, lt=1, description="chance of dropping each (not kept) tag"
    )
    caption_dropout_rate: float = Field(default=0.0, ge=0, le=1, description="chance of training on the empty caption")
    caption_variants: int = Field(
        default=8,
        ge=1,
        le=256,
        description="with shuffle or tag dropout and cached text "
        "embeddings: augmented versions of each caption precompute encodes",
    )

    @model_validator(mode="after")
    def _sides(self):
        if not self.min_side <= self.resolution <= self.max_side:
            raise ValueError(
                f"resolution ({self.resolution}) must lie between min_side ({self.min_side}) and max_side ({self.max_side}): "
                "lower data.min_side or raise data.resolution"
            )
        if self.frames % 4 != 1:
            raise ValueError(
                f"data.frames ({self.frames}) must be 4k+1 (1, 5, ..., 49): the video VAE compresses time 4x "
                "after the first frame"
            )
        if self.resolution % self.bucket_step:
            raise ValueError(f"resolution ({self.resolution}) must be a multiple of bucket_step ({self.bucket_step})")
        return self


class PrecomputeConfig(Strict):
    vae_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32", description="SDXL's VAE gives NaN in fp16; fp32 or bf16 is safe"
    )
    text_encoder_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    batch_size: int = Field(default=4, ge=1)
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    shard_max_mb: float = Field(
        default=512, gt=0, description="cache shard size: entries are written in files of about this size"
    )
    num_workers: int | None = Field(
        default=None,
        ge=0,
        description="processes that decode and resize images while the "
        "encoder runs; null: half the CPU cores (at most 8); 0: in the main process",
    )


class T5Options(Strict):
    """SD3's T5-XXL: the largest encoder, used only at precompute time (its embeddings are cached)."""

    precision: Literal["int8", "nf4", "bf16", "fp16", "fp32"] = Field(
        default="int8",
        description="int8/nf4 through bitsandbytes (CUDA only): 5.5 / 4.0 GiB loaded instead of 8.9 GiB in bf16 (measured)",
    )
    max_length: int = Field(default=256, ge=77, le=512, description="T5 tokens per caption (SD3 was trained with 256)")
    enabled: bool = Field(
        default=True, description="false: T5 is never loaded and its embeddings are zeros (SD3 allows it)"
    )


class TextEncodersConfig(Strict):
    t5: T5Options = Field(default_factory=T5Options)


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


class DreamBoothConfig(Strict):
    """DreamBooth (the diffusers scripts' names): one instance prompt, optional prior preservation."""

    instance_prompt: str | None = Field(
        default=None, description='e.g. "a photo of sks dog": the caption of every training image'
    )
    use_captions: bool = Field(
        default=False, description="per-image captions where an image has one, the instance prompt for the rest"
    )
    with_prior_preservation: bool = False
    class_prompt: str | None = Field(default=None, description='e.g. "a photo of a dog"')
    class_data_dir: Path | None = Field(
        default=None, description="class images: supplied, or generated here up to num_class_images"
    )
    num_class_images: int = Field(default=100, ge=1)
    prior_loss_weight: float = Field(default=1.0, ge=0)
    class_sample_steps: int = Field(default=25, ge=1, description="denoising steps when generating class images")

    @model_validator(mode="after")
    def _prior(self):
        if self.with_prior_preservation and not (self.class_prompt and self.class_data_dir):
            raise ValueError(
                "dreambooth.with_prior_preservation needs dreambooth.class_prompt and dreambooth.class_data_dir "
                "(class images are generated there when it holds fewer than num_class_images)"
            )
        return self


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
    images: list[Path] = Field(
        default_factory=list, description="image-to-video: the start image of each prompt, in order"
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


# ----------------------------------------------------------------- LoRA
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


# ----------------------------------------------------------------- memory
class WeightsBF16(Strict):
    kind: Literal["bf16"] = "bf16"


class WeightsFP16(Strict):
    kind: Literal["fp16"] = "fp16"


class WeightsFP32(Strict):
    kind: Literal["fp32"] = "fp32"


class WeightsFP8(Strict):
    """Frozen Linear/Conv2d weights stored in float8 e4m3 (1 byte a weight); LoRA only."""

    kind: Literal["fp8"] = "fp8"
    scale: Literal["tensor", "channel"] = Field(
        default="tensor", description="one scale per tensor, or per output channel"
    )
    compute: Literal["bf16", "fp16", "fp32"] = Field(
        default="bf16", description="dtype of the upcast and of the other weights"
    )


class _Adam(Strict):
    """AdamW's hyper-parameters, shared by every optimizer kind."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=1e-2, ge=0)


class OptAdamW(_Adam):
    kind: Literal["adamw"] = "adamw"
    bf16_stochastic_rounding: bool = Field(
        default=True,
        description="when trained weights are bf16, round updates stochastically (else small updates vanish)",
    )


class OptAdamW8bit(_Adam):
    """8-bit AdamW (CUDA): optimizer state in 8 bits, a quarter of AdamW's."""

    kind: Literal["adamw8bit"] = "adamw8bit"
    backend: Literal["bnb", "torchao"] = Field(default="bnb", description="bitsandbytes or torchao")
    paged: bool = Field(
        default=False, description="bitsandbytes paged optimizer (state spills to host RAM under pressure)"
    )


class OptAdamW4bit(_Adam):
    """torchao's 4-bit AdamW (CUDA): an eighth of AdamW's state."""

    kind: Literal["adamw4bit"] = "adamw4bit"


class OptAdafactor(Strict):
    """Adafactor as sd-scripts runs it for SDXL full fine-tunes (``--optimizer_type adafactor`` with
    ``scale_parameter=False relative_step=False warmup_init=False``): the learning rate is used as given, no first
    moment, the second moment factored into a row and a column vector for every matrix. Its state is a small
    fraction of AdamW's, which with fused_backward fits SDXL's full fine-tune in 12 GB."""

    kind: Literal["adafactor"] = "adafactor"
    decay_rate: float = Field(default=-0.8, lt=0, description="second-moment decay: beta2 = 1 - step ** decay_rate")
    eps: tuple[float, float] = Field(default=(1e-30, 1e-3), description="added to the squared gradient; unused 2nd")
    clip_threshold: float = Field(default=1.0, gt=0, description="the update's RMS is clipped to this")
    weight_decay: float = Field(default=0.0, ge=0)
    bf16_stochastic_rounding: bool = Field(
        default=True,
        description="when trained weights are bf16, round updates stochastically (else small updates vanish)",
    )


class OptCPUOffload(_Adam):
    """torchao's CPUOffloadOptimizer: AdamW state and step on the CPU, weights on the GPU."""

    kind: Literal["cpu_offload"] = "cpu_offload"
    offload_gradients: bool = Field(default=False, description="move gradients to host RAM as they are produced")


class ActNone(Strict):
    kind: Literal["none"] = "none"


class ActCheckpoint(Strict):
    kind: Literal["checkpoint"] = "checkpoint"
    every: int = Field(
        default=1, ge=1, description="checkpoint every k-th block (1 = all: least memory, most recompute)"
    )


class OffloadNone(Strict):
    kind: Literal["none"] = "none"


class OffloadBlockSwap(Strict):
    """Keep the largest ``blocks_to_swap`` denoiser blocks in pinned host RAM, streamed in as each is needed."""

    kind: Literal["block_swap"] = "block_swap"
    blocks_to_swap: int = Field(
        ge=1, description="how many blocks live in host RAM (more: less GPU memory, more copying)"
    )
    prefetch: int = Field(default=1, ge=1, description="blocks copied ahead of the one computing")


class EngineAuto(Strict):
    """Not named: difftrain chooses at start. One process trains alone; on several (``train --gpus N``), DDP where a
    replica fits each GPU as the planner sees it, else the first DeepSpeed ZeRO stage that fits a full fine-tune
    (stage 2 before 3, the optimizer offloaded before the weights); one line says which and why. A resumed run keeps
    the engine its checkpoint was made with (planning.choose_engine)."""

    kind: Literal["auto"] = "auto"


class EngineSingle(Strict):
    """One process; launched on several it runs as ``ddp`` with its defaults."""

    kind: Literal["single"] = "single"


class EngineDDP(Strict):
    """torch DistributedDataParallel: each process holds the whole model and all-reduces gradients in buckets.
    A plain ``single`` config launched on several processes runs as ``ddp`` with these defaults."""

    kind: Literal["ddp"] = "ddp"
    bucket_cap_mb: float = Field(
        default=25.0, gt=0, description="gradient bucket size (DDP's default); capped below 2^31 elements"
    )
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = Field(
        default=False,
        description="gradients are views into DDP's buckets: no copy into them, and no second copy of every "
        "gradient on the GPU (torch's default: false; gloo with over 2^31 trained elements keeps it false)",
    )
    static_graph: bool = Field(
        default=False,
        description="DDP's static_graph: the same parameters take part every step (true of every family's step), "
        "which lets DDP skip its per-step search for unused ones",
    )


class EngineDeepSpeed(Strict):
    """DeepSpeed ZeRO (accelerate's DeepSpeed plugin names). DeepSpeed owns the optimizer (AdamW)."""

    kind: Literal["deepspeed"] = "deepspeed"
    stage: Literal[2, 3] = 2
    offload_optimizer_device: Literal["none", "cpu"] = Field(
        default="cpu", description="AdamW state and step in host RAM"
    )
    offload_param_device: Literal["none", "cpu"] = Field(
        default="none", description="ZeRO-3: weights in host RAM, fetched per layer"
    )
    family_settings: bool = Field(
        default=True,
        description="ZeRO-3: the model family's measured settings (SDXL: whole blocks as leaf modules, small "
        "parameters kept gathered; 1.8x faster on 2 H100s); false: DeepSpeed's own",
    )
    config_file: Path | None = Field(
        default=None, description="a DeepSpeed JSON whose keys override the generated config"
    )


class EngineFSDP(Strict):
    """torch's own sharding (FSDP2 ``fully_shard``, as torchtune and accelerate use it) for full fine-tunes of the
    denoiser: each process keeps 1/N of every weight (fp32 master), gradient and AdamW state; each of the
    denoiser's blocks is gathered for its forward and backward (in bf16 under mixed precision bf16). Built on
    the meta device and filled from the main process's mapped read: no process holds the whole model."""

    kind: Literal["fsdp"] = "fsdp"
    reshard_after_forward: bool = Field(
        default=True,
        description="free each block's gathered weights after its forward and gather again for backward (least "
        "memory, as ZeRO-3); false keeps them until backward (less communication, as ZeRO-2 plus sharded weights)",
    )
    offload_params: bool = Field(
        default=False,
        description="the weight, gradient and optimizer shares in pinned host RAM (torch's "
        "CPUOffloadPolicy: the optimizer steps on the CPU)",
    )


class WeightsNF4(Strict):
    """Frozen Linear weights in 4-bit NormalFloat through bitsandbytes (QLoRA); LoRA only, CUDA only."""

    kind: Literal["nf4"] = "nf4"
    compute: Literal["bf16", "fp16", "fp32"] = "bf16"


class WeightsInt8(Strict):
    """Frozen Linear weights in LLM.int8 through bitsandbytes; LoRA only, CUDA only."""

    kind: Literal["int8"] = "int8"
    compute: Literal["bf16", "fp16", "fp32"] = "bf16"
    outlier_threshold: float = Field(
        default=0.0,
        ge=0,
        description="LLM.int8 outlier decomposition (6.0 in bitsandbytes' papers); 0 = plain vector-wise int8",
    )


Weights = Annotated[
    WeightsBF16 | WeightsFP16 | WeightsFP32 | WeightsFP8 | WeightsNF4 | WeightsInt8, Field(discriminator="kind")
]
Optimizer = Annotated[
    OptAdamW | OptAdamW8bit | OptAdamW4bit | OptAdafactor | OptCPUOffload, Field(discriminator="kind")
]
Activations = Annotated[ActNone | ActCheckpoint, Field(discriminator="kind")]
Offload = Annotated[OffloadNone | OffloadBlockSwap, Field(discriminator="kind")]
Engine = Annotated[EngineAuto | EngineSingle | EngineDDP | EngineDeepSpeed | EngineFSDP, Field(discriminator="kind")]


class MemoryConfig(Strict):
    weights: Weights = Field(default_factory=WeightsBF16, description="storage dtype of frozen base weights")
    optimizer: Optimizer = Field(default_factory=OptAdamW)
    activations: Activations = Field(default_factory=ActCheckpoint)
    offload: Offload = Field(default_factory=OffloadNone)
    engine: Engine = Field(default_factory=EngineAuto)
    fused_backward: bool = Field(
        default=False,
        description="step each parameter as soon as its gradient is ready and free the gradient (full fine-tuning)",
    )
    pinned_limit_gib: float | None = Field(
        default=None,
        gt=0,
        description="most host memory to pin (block swap, CPU-offload optimizer); past it, pageable copies. Windows "
        "(WDDM) limits what a process may pin: set it there if pinning fails",
    )
    expandable_segments: bool | None = Field(
        default=None,
        description="CUDA allocator segments that grow in place (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): "
        "less memory held by fragmentation, so a run near the card's limit fits. Unset: on under DeepSpeed ZeRO-3 "
        "(its gathered weights come and go: SDXL full with offload held 4.2 GiB reserved without, 3.4 with), "
        "off otherwise",
    )

    @property
    def expandable(self) -> bool:
        """Whether this run asks for expandable segments (what memory.expandable_segments means when unset)."""
        if self.expandable_segments is not None:
            return self.expandable_segments
        return isinstance(self.engine, EngineDeepSpeed) and self.engine.stage == 3


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


# ----------------------------------------------------------------- speed
class SpeedConfig(Strict):
    """How fast a step runs, not what it computes: compilation, attention and optimizer kernels, host syncs.
    Each option is measured in docs/benchmarks.md ("Speed"); `difftrain bench speed` measures a config."""

    compile: bool | Literal["auto"] = Field(
        default="auto",
        description="torch.compile each repeated block of the denoiser (regional compilation: one compiled "
        "block serves every repeat, so compiling takes seconds to a minute, not many); auto: on where it pays "
        "(a CUDA GPU with a working Triton, no debugger, enough planned steps to earn the compile time back), "
        "the reason printed at start",
    )
    compile_regions: list[str] | None = Field(
        default=None,
        description="class names of the denoiser's submodules compiled one by one (each a region of its own, "
        "what runs between them stays eager); null: the family's repeated blocks (SDXL: BasicTransformerBlock, "
        "ResnetBlock2D; SD3, Flux, CogVideoX: their transformer blocks). Larger regions (SDXL: Transformer2DModel) "
        "leave less eager work between them and take longer to compile",
    )
    compile_mode: Literal["default", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        default="default",
        description="max-autotune: inductor benchmarks more kernels (Triton matmul and convolution "
        "templates) for each block: a much longer first step (CogVideoX-2b 300 s, SDXL over 9 minutes on an H100) "
        "and measured no faster, since cuBLAS/cuDNN win the large shapes; CUDA graphs still follow "
        "speed.cuda_graphs (max-autotune-no-cudagraphs is the same choice, kept for torch's name)",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        default="auto",
        description="replay each compiled block as a CUDA graph (torch.compile's reduce-overhead): fewer "
        "launches; one graph per block and bucket shape, each shape recorded on its second step. auto: on with "
        "compile unless block swap, DeepSpeed, several processes or more than 16 bucket shapes stand in the way, "
        "or the recordings would not pay back in the planned steps",
    )
    dynamic: bool | None = Field(
        default=None,
        description="null: a dimension becomes dynamic once a second size is seen "
        "(a second bucket), so buckets do not each recompile; false: compile every shape",
    )
    compile_cache_dir: Path | None = Field(
        default=None,
        description="where compiled kernels are kept between runs (torch "
        "inductor's cache); default ~/.cache/difftrain/torch-compile",
    )
    attention: Literal["auto", "flash", "cudnn", "efficient", "math", "fa4"] = Field(
        default="auto",
        description="scaled-dot-product attention kernel; fa4: FlashAttention-4 (pip install flash-attn-4; "
        "compute capability 9.x or 10.x) for attention over 4,096 keys or more, torch's choice for the rest "
        "(measured on an H100: CogVideoX-2b LoRA steps 1.20x faster than with cuDNN's attention, SDXL LoRA at "
        "batch 4 1.04x); auto: fa4 where flash-attn-4 is installed and runs, else torch's choice for the device "
        "(cuDNN or flash on Hopper)",
    )
    geglu: Literal["auto", "triton", "torch"] = Field(
        default="auto",
        description="the backward of the GEGLU gates in SDXL's feed-forwards; triton: one difftrain kernel per "
        "gate (CUDA and Triton; 2x faster than inductor's fused kernel on an H100, the same numbers within bf16 "
        "rounding); torch: diffusers' ops as they are; auto: triton where CUDA and Triton are there",
    )
    optimizer_kernels: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        default="auto", description="torch AdamW's implementation; auto: fused on CUDA, foreach elsewhere"
    )
    channels_last: bool | Literal["auto"] = Field(
        default="auto",
        description="UNet convolutions in channels-last memory format (SDXL); auto: on for a compiled LoRA on a "
        "CUDA GPU (single process or DDP, not fp8 weights), where it was measured faster on an H100 (sdxl-lora-8gb "
        "1.11x, LoRA batch 1 without checkpointing 1.29x, batch 4 1.04x), off elsewhere",
    )
    lora_kernel: Literal["auto", "fused", "peft"] = Field(
        default="auto",
        description="how a LoRA Linear of the denoiser computes: fused: difftrain's forward and backward in fewer "
        "passes over the activations, an attention's q, k and v of one input as one call (difftrain.lora.fused; "
        "the same weights and files, bf16/fp16 autocast, one adapter without dropout, else peft's own); peft: "
        "peft's op by op; auto: fused on CUDA without gradient checkpointing (with it, sdxl-lora-8gb measured "
        "0.66 GiB more memory), peft elsewhere",
    )
    pin_memory: bool = Field(
        default=True, description="batches copied to the GPU from pinned host memory without waiting"
    )
    sync_seconds: float = Field(
        default=2.0,
        ge=0,
        description="the host reads losses back from the GPU at most this often "
        "(and before every checkpoint, validation and export), so it never waits on the GPU "
        "inside a step; 0: every step",
    )
    float8: bool = Field(
        default=False,
        description="full fine-tuning: the denoiser's Linear layers compute in fp8 through "
        "torchao's float8 training (CUDA, compute capability 8.9+: Ada, Hopper); with compile and "
        "cuda_graphs. Measured on an H100: SD3-medium 1.05x and 27 % less memory, SDXL 0.52x "
        "(its matmuls are too small for the scaling kernels to pay)",
    )


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


@dataclass(frozen=True)
class FamilyFacts:
    """What validating a config needs to know of a model family. The schema sits below the families and names
    none of them: ``difftrain.config.load`` passes the registry's facts as the validation context
    (``{"families": {name: FamilyFacts}}``), and a config validated without them (one read back from a run,
    already checked) is not checked against the registry again."""

    default_architecture: str  # model.config when it is not set
    channels_last: bool = False  # speed.channels_last has convolutions to act on


def _families(info: ValidationInfo) -> dict[str, FamilyFacts] | None:
    return (info.context or {}).get("families")


class Config(Strict):
    family: str = Field(min_length=1, description="the model family (`difftrain recipes list` shows each one's)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    text_encoders: TextEncodersConfig = Field(default_factory=TextEncodersConfig)
    dreambooth: DreamBoothConfig = Field(default_factory=DreamBoothConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    precompute: PrecomputeConfig = Field(default_factory=PrecomputeConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    full: FullConfig = Field(default_factory=FullConfig)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    save: SaveConfig = Field(default_factory=SaveConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    speed: SpeedConfig = Field(default_factory=SpeedConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)

    @field_validator("family")
    @classmethod
    def _registered(cls, v: str, info: ValidationInfo) -> str:
        families = _families(info)
        if families is not None and v not in families:
            raise ValueError(f"unknown model family {v!r}: one of {', '.join(families)}")
        return v

    @model_validator(mode="after")
    def _combinations(self, info: ValidationInfo):
        # the cross-field rules, by theme; where a config breaks several, the first in this order is the one reported
        facts = (_families(info) or {}).get(self.family)
        if self.model.config is None and facts is not None:
            self.model.config = facts.default_architecture
        self._schedule_and_precision()
        self._fused_backward()
        self._ddp()
        self._deepspeed()
        self._fsdp()
        self._offload()
        self._speed(facts)
        self._method()
        return self

    def _schedule_and_precision(self) -> None:
        """The learning-rate schedule, and the dtypes of weights and compute."""
        if self.train.warmup_steps and self.train.lr_scheduler == "constant":
            raise ValueError(
                "train.warmup_steps is set but train.lr_scheduler is 'constant', which ignores it: "
                "use lr_scheduler: constant_with_warmup (or linear/cosine)"
            )
        if self.train.mixed_precision == "fp16" and self.memory.weights.kind == "bf16":
            raise ValueError(
                "train.mixed_precision fp16 with memory.weights bf16 mixes two half types: "
                "set memory.weights.kind: fp16 or mixed_precision: bf16"
            )
        m, t = self.memory, self.train
        if m.weights.kind in ("fp8", "nf4", "int8") and t.method == "full":
            raise ValueError(
                f"memory.weights {m.weights.kind} with train.method full: {m.weights.kind} rounds a weight once, which suits "
                "frozen weights (LoRA) but would lose every update of a trained one; use memory.weights bf16 for full fine-tuning"
            )

    def _fused_backward(self) -> None:
        """memory.fused_backward: what stepping inside backward rules out."""
        m, t = self.memory, self.train
        if m.fused_backward:
            if t.method != "full":
                raise ValueError(
                    "memory.fused_backward is for train.method full (a LoRA's gradients are small): set it to false"
                )
            if t.grad_accum > 1:
                raise ValueError(
                    "memory.fused_backward steps inside backward, so gradients cannot accumulate: set train.grad_accum: 1"
                )
            if t.max_grad_norm:
                raise ValueError(
                    "memory.fused_backward frees each gradient at once, so the global norm is never known: "
                    "set train.max_grad_norm: null"
                )
            if t.mixed_precision == "fp16":
                raise ValueError(
                    "memory.fused_backward cannot skip a step on fp16 overflow: use train.mixed_precision bf16"
                )
            if m.optimizer.kind == "cpu_offload":
                raise ValueError(
                    "memory.fused_backward with optimizer cpu_offload: pick one (both free the gradients early)"
                )

    def _ddp(self) -> None:
        """memory.engine ddp: what must wait for gradients averaged across processes."""
        m = self.memory
        if m.engine.kind == "ddp":
            if m.fused_backward:
                raise ValueError(
                    "memory.engine ddp with memory.fused_backward: the step would run before the gradients are "
                    "averaged across processes; set fused_backward: false"
                )
            if m.optimizer.kind == "cpu_offload" and m.optimizer.offload_gradients:
                raise ValueError(
                    "memory.engine ddp with optimizer cpu_offload offload_gradients: gradients would leave the GPU "
                    "before they are averaged; set offload_gradients: false or use memory.engine deepspeed"
                )
            if m.engine.static_graph and self.train.grad_accum > 1:
                # found on 2 gloo processes (torch 2.13): "expect_autograd_hooks_ INTERNAL ASSERT FAILED" in DDP's
                # reducer on the first accumulated micro-batch
                raise ValueError(
                    "memory.engine.static_graph with train.grad_accum > 1: DDP's static graph does not take the "
                    "micro-batches that accumulate without averaging (no_sync); set static_graph: false"
                )

    def _fsdp(self) -> None:
        """memory.engine fsdp: a full fine-tune of the denoiser with torch's AdamW over sharded weights."""
        m, t = self.memory, self.train
        if m.engine.kind != "fsdp":
            return
        why = None
        if t.method != "full":
            why = "it shards full fine-tunes (a LoRA's frozen base and small adapter train faster under ddp)"
        elif self.full.train_text_encoder_1 or self.full.train_text_encoder_2:
            why = "it trains the denoiser only for now: set full.train_text_encoder_*: false"
        elif m.optimizer.kind != "adamw":
            why = f"memory.optimizer {m.optimizer.kind} does not step sharded (DTensor) weights: use adamw"
        elif m.fused_backward:
            why = "memory.fused_backward steps before the gradients are reduced: set it false"
        elif m.offload.kind != "none":
            why = "block swap moves whole weights; fsdp's offload_params keeps the shares in host RAM instead"
        elif m.weights.kind not in ("bf16", "fp32"):
            why = f"memory.weights {m.weights.kind}: the sharded master weights are fp32 (bf16 compute)"
        elif t.mixed_precision == "fp16":
            why = "train.mixed_precision fp16: use bf16 (or no)"
        elif self.ema.enabled:
            why = "ema reads whole weights, which no process holds: set ema.enabled: false"
        elif self.validation.prompts:
            why = "validation.prompts: the pipeline cannot run on sharded weights; leave it empty"
        elif self.speed.float8:
            why = "speed.float8 is not supported with it: set speed.float8: false"
        if why:
            raise ValueError(f"memory.engine fsdp: {why}")

    def _deepspeed(self) -> None:
        """memory.engine deepspeed: what DeepSpeed owns, and what ZeRO-3's partitioned weights rule out."""
        m, t = self.memory, self.train
        if m.engine.kind == "deepspeed":
            e = m.engine
            if e.offload_param_device != "none" and e.stage != 3:
                raise ValueError(
                    "memory.engine.offload_param_device needs ZeRO stage 3 (stage 2 keeps the weights whole on "
                    "the GPU): set memory.engine.stage: 3"
                )
            if m.optimizer.kind != "adamw":
                raise ValueError(
                    f"memory.engine deepspeed with memory.optimizer {m.optimizer.kind}: DeepSpeed brings its own "
                    "AdamW (on the CPU with offload_optimizer_device: cpu); set memory.optimizer.kind: adamw"
                )
            if m.fused_backward:
                raise ValueError(
                    "memory.engine deepspeed with memory.fused_backward: DeepSpeed steps the optimizer itself; "
                    "set fused_backward: false"
                )
            if m.offload.kind != "none":
                raise ValueError(
                    "memory.engine deepspeed with memory.offload block_swap: ZeRO-3's offload_param_device "
                    "is DeepSpeed's own way to keep weights in host RAM; pick one"
                )
            if m.weights.kind in ("fp8", "nf4", "int8", "fp16"):
                raise ValueError(
                    f"memory.engine deepspeed with memory.weights {m.weights.kind}: DeepSpeed casts every "
                    "parameter to its bf16 compute type; use memory.weights bf16"
                )
            if t.mixed_precision != "bf16":
                raise ValueError(
                    "memory.engine deepspeed needs train.mixed_precision bf16 (its bf16 mode keeps fp32 master "
                    "weights in the optimizer)"
                )
            if (t.method == "lora" and t.train_text_encoders) or (
                t.method == "full" and (self.full.train_text_encoder_1 or self.full.train_text_encoder_2)
            ):
                raise ValueError(
                    "memory.engine deepspeed trains the denoiser only for now: set train.train_text_encoders "
                    "false (full.train_text_encoder_*: false) or memory.engine.kind: single"
                )
            if self.validation.prompts and e.stage == 3:
                raise ValueError(
                    "validation.prompts with ZeRO stage 3: the pipeline cannot run on partitioned weights; "
                    "use stage 2 or leave validation.prompts empty"
                )
            if self.ema.enabled and e.stage == 3:
                raise ValueError(
                    "ema with ZeRO stage 3: the weights are partitioned, the average cannot read them; "
                    "use stage 2 or ema.enabled: false"
                )

    def _offload(self) -> None:
        """Block swap and the cpu_offload optimizer: what weights or gradients in host RAM rule out."""
        m, t = self.memory, self.train
        if m.offload.kind == "block_swap":
            if m.activations.kind != "checkpoint":
                raise ValueError(
                    "memory.offload block_swap with memory.activations none: without checkpointing autograd keeps "
                    "every layer's weight for backward, so the swapped blocks never leave the GPU (measured: "
                    "0.6 of 5 GiB saved); set memory.activations.kind: checkpoint"
                )
            if m.weights.kind in ("nf4", "int8"):
                raise ValueError(
                    f"memory.offload block_swap with memory.weights {m.weights.kind}: bitsandbytes' quantized "
                    "weights cannot be moved between devices layer by layer; use memory.weights fp8 or bf16"
                )
            on_host = m.optimizer.kind == "cpu_offload" and m.optimizer.offload_gradients
            in_backward = m.fused_backward and m.optimizer.kind == "adafactor"
            if t.method == "full" and not (on_host or in_backward):
                raise ValueError(
                    "memory.offload block_swap with train.method full: the swapped blocks' weights live in host "
                    "RAM, so their optimizer must step there: set memory.optimizer "
                    "{kind: cpu_offload, offload_gradients: true} (and train.max_grad_norm: null), or step them on "
                    "the GPU while they are there: memory.fused_backward: true with memory.optimizer.kind: adafactor "
                    "(its state is small enough to stay on the GPU)"
                )
            if t.method == "full" and self.ema.enabled and self.ema.device != "cpu":
                raise ValueError(
                    "memory.offload block_swap with ema on the GPU: the swapped weights live in host RAM; "
                    "set ema.device: cpu"
                )
        if m.optimizer.kind == "cpu_offload":
            if t.max_grad_norm:
                raise ValueError(
                    "memory.optimizer cpu_offload does not clip gradients (they are copied to the host as they are "
                    "produced, before any norm is known): set train.max_grad_norm: null or pick adamw8bit"
                )
            if m.optimizer.offload_gradients and t.grad_accum > 1:
                raise ValueError(
                    "memory.optimizer cpu_offload with offload_gradients cannot accumulate gradients: "
                    "set offload_gradients: false or train.grad_accum: 1"
                )

    def _method(self) -> None:
        """What train.method trains."""
        if self.train.method == "full":
            f = self.full
            if not (f.train_unet or f.train_text_encoder_1 or f.train_text_encoder_2):
                raise ValueError(
                    "train.method is full but full.train_unet and both full.train_text_encoder_* are false: nothing to train"
                )
            if self.memory.weights.kind == "fp16":
                raise ValueError(
                    "train.method full with memory.weights fp16: fp16 weights cannot take small updates and overflow; "
                    "use memory.weights bf16 (stochastic rounding) or fp32 with mixed_precision fp16"
                )
        elif self.train.train_text_encoders is False and (
            self.full.train_text_encoder_1 or self.full.train_text_encoder_2
        ):
            raise ValueError(
                "full.train_text_encoder_* apply to train.method full; for LoRA set train.train_text_encoders: true"
            )

    def _speed(self, facts: FamilyFacts | None) -> None:
        # only what is set explicitly is refused here; "auto" decides at start (difftrain.speed.decide) and says why
        sp, m, t = self.speed, self.memory, self.train
        if sp.cuda_graphs is True and sp.compile is False:
            raise ValueError("speed.cuda_graphs replays compiled blocks: set speed.compile: true (or auto)")
        # speed.cuda_graphs with block swap: the blocks then land in fixed GPU slots (memory/block_swap.py), the
        # addresses a graph recorded
        if sp.compile is True:
            if m.engine.kind == "deepspeed" and m.engine.stage == 3:
                raise ValueError(
                    "speed.compile with ZeRO stage 3: DeepSpeed gathers each weight in hooks around every "
                    "layer, which compiled blocks cannot trace; use stage 2 or speed.compile: false"
                )
            if m.weights.kind in ("nf4", "int8"):
                raise ValueError(
                    f"speed.compile with memory.weights {m.weights.kind}: bitsandbytes' quantized layers do "
                    "not compile; use memory.weights fp8 or bf16, or speed.compile: false"
                )
        if sp.compile_regions is not None:
            if not sp.compile_regions:
                raise ValueError("speed.compile_regions is empty: name classes to compile, or leave it null")
            # block swap's and FSDP's hooks move or gather the weights of exactly the family's blocks; a larger
            # region would trace through them
            if m.offload.kind == "block_swap" or m.engine.kind == "fsdp":
                what = "memory.offload block_swap" if m.offload.kind == "block_swap" else "memory.engine fsdp"
                raise ValueError(
                    f"speed.compile_regions with {what}: its hooks wrap the family's own blocks, which are the "
                    "compiled regions there; leave speed.compile_regions null"
                )
        if sp.float8:
            if t.method != "full":
                raise ValueError(
                    "speed.float8 trains Linear weights in fp8 compute (full fine-tuning); a LoRA's frozen "
                    "base gains nothing from it: set speed.float8: false or train.method: full"
                )
            if t.mixed_precision != "bf16" or m.weights.kind != "bf16":
                raise ValueError("speed.float8 needs train.mixed_precision bf16 and memory.weights bf16")
            if m.engine.kind == "deepspeed":
                raise ValueError("speed.float8 with memory.engine deepspeed is not supported: use single or ddp")
        if sp.channels_last is True and facts is not None and not facts.channels_last:
            raise ValueError(
                f"speed.channels_last is for the SDXL UNet's convolutions; {self.family}'s transformer has "
                "none to speed up: set speed.channels_last: false"
            )
