"""``memory``: the memory techniques, each a tagged union (``{kind: ...}``) so an error points at the chosen
option."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import Strict


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
    offload: bool = Field(
        default=False,
        description="keep each checkpointed block's input in pinned host RAM until backward needs it (the "
        "denoiser's blocks; diffusion-pipe's 'unsloth' checkpointing): for video at full size, where the "
        "checkpoints alone outgrow the card",
    )
    split: bool = Field(
        default=False,
        description="also run each block as checkpointed segments (its attentions and feed-forward with the norms "
        "and residuals around them, the feed-forward over token chunks; families that have one: Wan), so a block "
        "recomputed in backward holds one segment's tensors at a time: less memory at long token counts (video), "
        "the segments computed once more",
    )
    keep_on_gpu: int = Field(
        default=0,
        ge=0,
        description="with offload: the last this many blocks keep their inputs on the GPU (backward needs them "
        "first), the rest in host RAM: for a card with room for some of them when host RAM cannot hold them all "
        "(Wan 14B at 720x1280x81: 0.72 GiB a block, 28.8 GiB for its 40)",
    )

    save_attention: bool = Field(
        default=False,
        description="keep each checkpointed block's attention outputs (and their log-sum-exp) so backward recomputes "
        "the rest of the block but not its attentions (torchtitan's selective checkpointing): for long token counts "
        "(video), where the attention is most of a block's time; costs about one tensor of the block input's size "
        "per attention call per block. Not with offload or split (their own checkpoints)",
    )

    @model_validator(mode="after")
    def _keep_needs_offload(self) -> ActCheckpoint:
        if self.save_attention and (self.offload or self.split):
            raise ValueError(
                "save_attention keeps the attentions' outputs of torch's checkpoint; offload and split run their own "
                "checkpoints: set save_attention: false, or offload and split to false"
            )
        if self.keep_on_gpu and not self.offload:
            raise ValueError(
                "keep_on_gpu says how many blocks' inputs stay on the GPU when the others go to host RAM: it needs "
                "offload: true (without offload every input stays on the GPU)"
            )
        return self


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
    denoiser: each process keeps 1/N of every weight (the master copy, fp32 or bf16), gradient and AdamW state
    (torch's, or torchao's 8- or 4-bit, which step sharded weights); each of the
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
    master_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="the dtype of the sharded master weights and their gradients: bf16 halves both (sd-scripts' "
        "--full_bf16), and needs an optimizer that rounds bf16 updates stochastically (memory.optimizer adamw8bit "
        "with backend torchao, or adamw4bit)",
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


class WeightsInt4(Strict):
    """Frozen Linear weights as 4-bit integers in groups with a scale and a zero point (0.56 bytes a weight at group
    64; memory/int4.py); LoRA only. Unlike nf4 they are plain tensors: block swap moves them and speed.compile
    compiles them, on any device."""

    kind: Literal["int4"] = "int4"
    group_size: Literal[16, 32, 64, 128] = Field(
        default=64, description="input columns that share a scale and zero point (smaller: closer, larger)"
    )
    compute: Literal["bf16", "fp16", "fp32"] = Field(
        default="bf16", description="dtype of the dequantized weight, the scales and the other weights"
    )


#: the stored-rounded kinds: LoRA only, their own ``compute`` dtype (plan.py, planner.py and root.py read these)
QUANTIZED_WEIGHTS = (WeightsFP8, WeightsNF4, WeightsInt8, WeightsInt4)
QUANTIZED_KINDS = ("fp8", "nf4", "int8", "int4")

Weights = Annotated[
    WeightsBF16 | WeightsFP16 | WeightsFP32 | WeightsFP8 | WeightsNF4 | WeightsInt8 | WeightsInt4,
    Field(discriminator="kind"),
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
        description="most host memory to pin (block swap, CPU-offload optimizer, offloaded checkpoints); past it, pageable copies. Windows "
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
