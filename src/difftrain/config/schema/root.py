"""The whole config: its sections, the family facts validation may be given, and the cross-section rules."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .base import Strict
from .data import DataConfig, DreamBoothConfig, PrecomputeConfig, TextEncodersConfig
from .lora import LoraConfig
from .memory import QUANTIZED_KINDS, MemoryConfig, WeightsFP8
from .model import ModelConfig
from .speed import SpeedConfig
from .training import EMAConfig, FlowConfig, FullConfig, ReportConfig, SaveConfig, TrainConfig, ValidationConfig


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
        if m.weights.kind in QUANTIZED_KINDS and t.method == "full":
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
        """memory.engine fsdp: a full fine-tune of the denoiser with torch's AdamW, or torchao's 8- or 4-bit one, over
        sharded weights."""
        m, t = self.memory, self.train
        if m.engine.kind != "fsdp":
            return
        why = None
        if t.method != "full":
            why = "it shards full fine-tunes (a LoRA's frozen base and small adapter train faster under ddp)"
        elif self.full.train_text_encoder_1 or self.full.train_text_encoder_2:
            why = "it trains the denoiser only for now: set full.train_text_encoder_*: false"
        elif m.optimizer.kind not in ("adamw", "adamw8bit", "adamw4bit"):
            why = (
                f"memory.optimizer {m.optimizer.kind} does not step sharded (DTensor) weights: use adamw, or "
                "adamw8bit with backend torchao"
            )
        elif m.optimizer.kind == "adamw8bit" and m.optimizer.backend != "torchao":
            why = (
                "bitsandbytes' 8-bit AdamW does not step sharded (DTensor) weights: set memory.optimizer.backend: "
                "torchao (its 8-bit AdamW does)"
            )
        elif m.engine.master_dtype == "bf16" and m.optimizer.kind == "adamw":
            why = (
                "master_dtype bf16 with torch's AdamW would lose every update smaller than bf16's step: use "
                "memory.optimizer adamw8bit (backend torchao) or adamw4bit, which round bf16 stochastically"
            )
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
            if m.weights.kind in (*QUANTIZED_KINDS, "fp16"):
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
        kind = self.memory.weights.kind
        if self.train.method == "lora" and self.lora.use_dora and kind in ("fp8", "int4"):
            raise ValueError(
                f"lora.use_dora with memory.weights {kind}: DoRA divides by the norm of each row of the base weight, "
                f"which peft computes from the stored {kind} tensor (without its scales, in a type torch cannot "
                "multiply); use memory.weights bf16 (or nf4 / int8, which peft dequantizes) for DoRA"
            )
        if self.train.method == "lora" and self.lora.type != "lora" and kind == "int4":
            raise ValueError(
                f"lora.type {self.lora.type} with memory.weights int4: peft's LoHa and LoKr take a layer's size from "
                "its weight, which int4 stores packed (two to a byte); use memory.weights fp8 or bf16 (or lora.type "
                "lora)"
            )
        if self.train.method == "lora" and self.lora.type != "lora" and kind in ("nf4", "int8"):
            raise ValueError(
                f"lora.type {self.lora.type} with memory.weights {kind}: peft's LoHa and LoKr have no bitsandbytes "
                "layers (its LoRA has) and take a layer's size from its weight, which nf4 stores packed; use "
                "memory.weights fp8 or bf16 (or lora.type lora)"
            )

    def _speed(self, facts: FamilyFacts | None) -> None:
        # only what is set explicitly is refused here; "auto" decides at start (difftrain.speed.auto.decide) and says why
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
        if sp.fp8_matmul:
            w = m.weights
            if not isinstance(w, WeightsFP8) or w.scale != "tensor":
                raise ValueError(
                    "speed.fp8_matmul multiplies by the stored fp8 weights: it needs memory.weights "
                    "{kind: fp8, scale: tensor} (a per-channel scale lies along the input gradient's inner "
                    "dimension, which rowwise fp8 matmuls cannot scale)"
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
