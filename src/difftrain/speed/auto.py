"""speed auto: what each ``auto`` of the speed section becomes for a run. Compiling and CUDA graphs are decided
from what compiling a family costs and saves (measured), the platform and the run's length (``decide``); the
attention kernel, the GEGLU backward, channels-last, the LoRA kernel and the optimizer's kernels from what is
installed and was measured faster where it is on."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config.schema import Config, SpeedConfig
from ..errors import BackendUnavailable
from .attention import check_attention


@dataclass(frozen=True)
class CompileCost:
    """What compiling a family's denoiser costs and saves, measured on an H100 at the family's usual case (SDXL
    1024 batch 1, SD3-medium 1024 batch 1, CogVideoX-2b 49x480x720; docs/benchmarks.md "Speed"). On a slower GPU a
    step takes longer and compiling (mostly CPU work) about as long, so the H100's break-even is the cautious one."""

    cold_s: float  # the first step's extra time with an empty inductor cache (compiling; no graph recorded yet)
    warm_s: float  # the same with this config's kernels already in the cache
    saved_s: float  # seconds a step saves compiled with CUDA graphs
    saved_s_no_graphs: float  # ... compiled without them
    dynamic_s: float = 0.0  # once, at the second bucket shape: dynamo recompiles the blocks with symbolic shapes
    shape_s: float = 0.0  # each bucket shape past the first: new kernels, guards
    record_s: float = 0.0  # each bucket shape's CUDA graphs: torch's warm-up call, then the recording

    @property
    def graphs_faster(self) -> bool:
        """Whether CUDA graphs measured faster than the compiled blocks alone (not so on CogVideoX)."""
        return self.saved_s > self.saved_s_no_graphs


#: at least this many times the compile time must come back in saved step time (auto)
PAYBACK = 1.25


#: auto keeps CUDA graphs up to this many bucket shapes (a real aspect-bucketed dataset has 5 to 15). Measured on
#: an H100 (docs/benchmarks.md, "Fast by default", second pass): sdxl-lora-8gb over six SDXL buckets in random
#: order, compiled with CUDA graphs, 0.159 s/step once every shape was recorded (6.3x the plain eager loop),
#: compiled alone 0.614; torch's CUDA graph trees record each shape once (its second call, ~10 s each for SDXL)
#: and keep the shapes' graphs in one memory pool (+0.36 GiB reserved over compiled alone at six shapes). Past
#: this count the recordings and the pool are not measured, and auto compiles without graphs.
MAX_GRAPH_SHAPES = 16


@dataclass(frozen=True)
class Platform:
    """What the automatic choice reads of the machine (``platform_facts``); tests build their own."""

    device: str  # torch device type
    capability: tuple[int, int] | None = None  # CUDA compute capability
    triton: str | None = None  # Triton's version, None when it does not import
    triton_error: str = ""
    windows: bool = False
    tracer: str | None = None  # a debugger (or other sys.settrace/sys.monitoring tool) attached
    dynamo_disabled: bool = False  # TORCHDYNAMO_DISABLE=1


def platform_facts(device: torch.device) -> Platform:
    import sys

    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    triton, err = None, ""
    if device.type == "cuda":
        try:
            import triton as triton_mod

            triton = str(getattr(triton_mod, "__version__", "?"))
        except Exception as e:  # noqa: BLE001  # an ImportError, or a broken install raising anything on import
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    tracer = None
    if sys.gettrace() is not None:
        tracer = f"sys.settrace ({type(sys.gettrace()).__name__})"
    elif hasattr(sys, "monitoring") and sys.monitoring.get_tool(sys.monitoring.DEBUGGER_ID):
        tracer = f"sys.monitoring ({sys.monitoring.get_tool(sys.monitoring.DEBUGGER_ID)})"
    return Platform(
        device=device.type,
        capability=cap,
        triton=triton,
        triton_error=err,
        windows=sys.platform == "win32",
        tracer=tracer,
        dynamo_disabled=os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0"),
    )


@dataclass(frozen=True)
class SpeedChoice:
    compile: bool
    cuda_graphs: bool
    reason: str  # one line: what was chosen and why
    compile_s: float = 0.0  # the expected first step's compile time (0: eager); other shapes compile later

    def line(self) -> str:
        what = "compiled + CUDA graphs" if self.cuda_graphs else "compiled" if self.compile else "eager"
        return f"speed: {what}: {self.reason}"


@dataclass(frozen=True)
class RunFacts:
    """What the automatic choice reads of the run: planned steps, bucket shapes, processes, the warm cache."""

    steps: int
    shapes: int = 1
    processes: int = 1
    warm: bool = False
    block_swap_trained: bool = False  # block swap of trained weights (a full fine-tune's), not only frozen ones
    deepspeed_stage: int | None = None  # None: not DeepSpeed
    quantized: str | None = None  # bitsandbytes weights (nf4, int8): nothing compiles
    fp8_weights: bool = False  # memory.weights fp8 or int4 (our storage, dequantized in each layer)
    fsdp: bool = False  # memory.engine fsdp: the denoiser's blocks are FSDP2 units


def run_facts(cfg: Config, steps: int, shapes: int = 1, processes: int = 1, warm: bool = False) -> RunFacts:
    """What the config tells the automatic choice (block swap, DeepSpeed, quantized weights), with the run's counts."""
    m = cfg.memory
    return RunFacts(
        steps=steps,
        shapes=shapes,
        processes=processes,
        warm=warm,
        block_swap_trained=m.offload.kind == "block_swap" and cfg.train.method == "full",
        deepspeed_stage=m.engine.stage if m.engine.kind == "deepspeed" else None,
        quantized=m.weights.kind if m.weights.kind in ("nf4", "int8") else None,
        fp8_weights=m.weights.kind in ("fp8", "int4"),
        fsdp=m.engine.kind == "fsdp",
    )


def graphs_possible(cfg: Config, cost: CompileCost | None = None) -> bool:
    """Whether the run may record CUDA graphs as far as the config tells before the device and the step count are
    known (the memory plan counts their pool): named, or auto where nothing in the config rules them out (auto may
    still stay eager on the device or for a short run, and the plan then holds a little more than the run uses).
    ``cost``: the family's measured compile figures; where graphs saved nothing over compiled blocks alone
    (CogVideoX), auto never records them."""
    sp = cfg.speed
    if sp.cuda_graphs is True:
        return True
    if sp.cuda_graphs is False or sp.compile is False:
        return False
    if cost is not None and not cost.graphs_faster:
        return False
    platform = Platform(device="cpu" if cfg.train.device == "cpu" else "cuda", triton="?")
    run = run_facts(cfg, steps=0)
    return _stay_eager(platform, run) is None and _graphs_off(sp, platform, run) is None


def _stay_eager(p: Platform, run: RunFacts) -> str | None:
    """Why compiling would not work or not pay here, whatever the step count; None when nothing stands in the way."""
    if p.device != "cuda":
        return f"the device is {p.device}: compiled kernels pay on CUDA GPUs"
    if p.dynamo_disabled:
        return "TORCHDYNAMO_DISABLE is set"
    if p.tracer:
        return f"a debugger or tracer is attached ({p.tracer}): compiled blocks cannot be stepped through"
    if p.triton is None:
        if p.windows:
            return "Windows without Triton: torch.compile's GPU kernels need it (pip install triton-windows)"
        return f"Triton does not import ({p.triton_error or 'not installed'}): torch.compile's GPU kernels need it"
    if p.capability is not None and p.capability < (7, 0):
        return f"compute capability {p.capability[0]}.{p.capability[1]}: Triton needs 7.0 (Volta) or newer"
    if run.quantized:
        return f"memory.weights {run.quantized}: bitsandbytes' quantized layers do not compile"
    if run.deepspeed_stage == 3:
        # tried 2026-11-26 with SDXL's leaf modules (the blocks' forward compiled inside them, DeepSpeed's hooks
        # around): 1.034 against 1.169 s/step eager on 2 H200s after ~6 min of compiling, and on the tiny UNet the
        # transformer blocks' norm biases got no update on the GPU (not on the CPU): reverted (docs/benchmarks.md)
        return "ZeRO-3 gathers each weight in hooks inside every layer, which compiled blocks cannot trace"
    return None


def _graphs_off(speed: SpeedConfig, platform: Platform, run: RunFacts) -> str | None:
    """Why CUDA graphs stay off beside compile (auto), or None."""
    if speed.cuda_graphs is False:
        return "speed.cuda_graphs: false"
    if platform.device != "cuda":
        return f"no CUDA graphs on {platform.device}"
    if run.block_swap_trained:
        # a full fine-tune's swapped blocks are stepped inside backward and copied home (write-back) or stepped on the
        # host: neither was measured with recorded graphs
        return "no CUDA graphs: not measured with block swap of trained weights (LoRA's block swap records them)"
    # LoRA's block swap records them too: the swapped blocks land in fixed GPU slots
    # (memory/block_swap.py), which the planner counts wherever graphs are possible. Measured, sdxl-lora-4gb (60 of
    # 87 blocks swapped), six buckets, H100, 2026-11-26: compiled 0.436 s/step without graphs, 0.207 with; 2.59 GiB
    # reserved, fitting its 4 GB card (docs/benchmarks.md)
    if run.fp8_weights:
        # measured: FLUX.1 [dev] LoRA, fp8 weights, 1024 px, one shape, H100 (2026-11-25): 10.2 s/step compiled with
        # CUDA graphs against 1.43 eager; compiled without them (block swap) 0.80
        # int4 storage dequantizes per layer as fp8 does: treated alike (not measured with graphs)
        return (
            "no CUDA graphs: with fp8-stored weights they made the step several times slower (measured on Flux; "
            "int4 storage dequantizes the same way)"
        )
    if run.deepspeed_stage is not None:
        return "no CUDA graphs: not measured under DeepSpeed's hooks"
    if run.fsdp:
        # compiled blocks inside FSDP's hooks were measured (SDXL full, 2 H200s, 2026-11-26: 0.62 s/step against 0.97
        # eager, docs/benchmarks.md); graphs around the hooks' gathers were not
        return "no CUDA graphs: not measured under FSDP's hooks"
    # several processes under DDP (what is left here): its reducer averages each gradient outside the recorded
    # graphs. Measured, SDXL full on 2 H200s, 2026-11-26: compiled blocks 0.593 s/step without graphs, 0.404 with
    # (one GPU compiled with graphs 0.401), the same losses (docs/benchmarks.md)
    if run.shapes > MAX_GRAPH_SHAPES:
        return (
            f"no CUDA graphs: {run.shapes} bucket shapes (auto records graphs for up to {MAX_GRAPH_SHAPES}; "
            "more are not measured)"
        )
    return None


def compile_seconds(cost: CompileCost, run: RunFacts, graphs: bool) -> float:
    """The expected extra time of compiling (and recording CUDA graphs) over the whole run: the first shape's
    compile, the dynamic recompile at the second shape, each further shape's kernels, and with graphs one recording
    per shape."""
    shapes = max(1, run.shapes)
    base = cost.warm_s if run.warm else cost.cold_s
    dynamic = cost.dynamic_s if shapes > 1 else 0.0
    return base + dynamic + (shapes - 1) * cost.shape_s + (shapes * cost.record_s if graphs else 0.0)


def decide(speed: SpeedConfig, cost: CompileCost, platform: Platform, run: RunFacts) -> SpeedChoice:
    """speed.compile / speed.cuda_graphs as this run uses them: explicit values stand; ``auto`` compiles where the
    platform can and the planned steps earn the compile time back (``PAYBACK`` times), with CUDA graphs unless
    something in ``_graphs_off`` stands in the way."""
    if speed.compile is not True and speed.compile is not False:  # auto
        graphs_reason = None if speed.cuda_graphs is True else _graphs_off(speed, platform, run)
        graphs = graphs_reason is None
        why_not = _stay_eager(platform, run)
        if why_not is None:
            # compiled with graphs where they may be used, else (or where their recordings do not pay) without
            options = [(True, cost.saved_s)] if graphs else []
            if speed.cuda_graphs is not True:  # graphs named by hand stay
                options.append((False, cost.saved_s_no_graphs))
            cache = "cache warm" if run.warm else "cold cache"
            net = [(run.steps * sv - PAYBACK * compile_seconds(cost, run, g), g, sv) for g, sv in options]
            gain, use_graphs, saved_s = max(net, key=lambda n: n[0])
            cost_s = compile_seconds(cost, run, use_graphs)
            saved = run.steps * saved_s
            if gain < 0:
                why_not = (
                    f"{run.steps} steps would save ~{saved:.0f} s for ~{cost_s:.0f} s of compiling ({cache}); "
                    "set speed.compile: true to compile anyway"
                )
            else:
                where = (
                    f"CUDA {platform.capability[0]}.{platform.capability[1]}, " if platform.capability else ""
                ) + f"Triton {platform.triton}"
                if graphs and not use_graphs:
                    n = max(1, run.shapes)
                    graphs_reason = (
                        "no CUDA graphs: measured no faster than compiled alone on this model"
                        if not cost.graphs_faster
                        else f"no CUDA graphs: recording {n} bucket shape{'s' * (n > 1)} would not pay back in "
                        f"{run.steps} steps"
                    )
                return SpeedChoice(
                    True,
                    use_graphs,
                    f"auto ({where}); ~{cost_s:.0f} s compiling"
                    + (" and recording" if use_graphs else "")
                    + f" over the first steps ({cache}) to save ~{saved:.0f} s over {run.steps} steps"
                    + (f"; {graphs_reason}" if graphs_reason else ""),
                    compile_s=cost.warm_s if run.warm else cost.cold_s,
                )
        if speed.cuda_graphs is True:
            raise BackendUnavailable(
                f"speed.cuda_graphs: true replays compiled blocks, and speed.compile auto stays eager here: {why_not}.",
                hint="Set speed.compile: true as well, or speed.cuda_graphs: auto.",
            )
        return SpeedChoice(False, False, f"auto: {why_not}")
    if not speed.compile:
        return SpeedChoice(False, False, "speed.compile: false")
    if speed.cuda_graphs is True:
        return SpeedChoice(True, True, "speed.compile and speed.cuda_graphs: true", compile_s=cost.cold_s)
    reason = _graphs_off(speed, platform, run)
    if speed.cuda_graphs is False or reason is not None:
        return SpeedChoice(True, False, f"speed.compile: true; {reason}", compile_s=cost.cold_s)
    return SpeedChoice(True, True, "speed.compile: true; CUDA graphs auto", compile_s=cost.cold_s)


def resolve_attention(cfg: Config, device: torch.device) -> tuple[Config, str | None]:
    """speed.attention as this run uses it, and the line that says so (None: nothing to say). ``auto`` takes
    FlashAttention-4 for the long attention where flash-attn-4 is installed and runs on this GPU (measured a
    whole step faster on an H100: CogVideoX-2b LoRA 1.20x, SDXL LoRA at batch 4 1.04x, docs/benchmarks.md),
    torch's SDPA otherwise; an explicit kernel is checked on the device before the model loads."""
    speed = cfg.speed
    if speed.attention != "auto":
        check_attention(speed, device)
        return cfg, None
    from . import fa4

    why_not = fa4.unavailable(device)
    if why_not is None:
        try:
            fa4.check(device)
        except BackendUnavailable as e:
            why_not = e.message
    if why_not is not None:
        return cfg, (f"speed.attention auto: torch's SDPA ({why_not})" if fa4.installed() else None)
    chosen = cfg.model_copy(update={"speed": speed.model_copy(update={"attention": "fa4"})})
    return chosen, (
        f"speed.attention auto: FlashAttention-4 (flash-attn-4 installed) for attention over {fa4.MIN_KEYS:,} keys "
        "or more, torch's SDPA for the rest (speed.attention: cudnn or flash keeps every call on SDPA)"
    )


def channels_last_auto(cfg: Config, convolutions: bool, compiled: bool, device: torch.device) -> bool:
    """speed.channels_last as this run uses it: explicit values stand; ``auto`` is on for a compiled LoRA of a UNet
    family (SDXL) on a CUDA GPU, trained by one process or DDP. Measured there on an H100 (docs/benchmarks.md, "Fast
    by default"): sdxl-lora-8gb as shipped 0.127 against 0.142 s/step, LoRA batch 1 without checkpointing 0.119
    against 0.153, batch 4 0.191 against 0.199; the tier recipes still fit their cards. Not measured, so off: eager
    steps, full fine-tunes, FSDP and DeepSpeed (sharded or flattened weights). ``convolutions``: the family's
    denoiser is a UNet (its registry row says so)."""
    if cfg.speed.channels_last != "auto":
        return bool(cfg.speed.channels_last)
    return (
        convolutions
        and compiled
        and device.type == "cuda"
        and cfg.train.method == "lora"
        and cfg.memory.engine.kind in ("single", "ddp", "auto")
        and cfg.memory.weights.kind != "fp8"  # fp8-stored convolutions in channels-last: not measured
    )


def lora_kernel_auto(cfg: Config, device: torch.device) -> str:
    """speed.lora_kernel as this run uses it: ``auto`` is difftrain's fused LoRA Linear (speed/lora_kernel.py) on CUDA
    without gradient checkpointing, where it was measured (SDXL LoRA batch 4 as shipped, with channels-last: 0.1830
    against 0.1962 s/step with neither, 40.3 % MFU, 0.64 GiB less memory, H100), peft's own elsewhere. With checkpointing inside compiled blocks
    sdxl-lora-8gb peaked at 6.43 GiB allocated against peft's 5.77 and no longer fit its card (H200, 2026-11-26;
    why is not known: on the CPU the checkpointed blocks save the same tensors either way)."""
    if cfg.speed.lora_kernel != "auto":
        return cfg.speed.lora_kernel
    if not cfg.lora.plain:  # DoRA, LoHa and LoKr have no fused kernel: peft's own layers
        return "peft"
    return "fused" if device.type == "cuda" and cfg.memory.activations.kind == "none" else "peft"


def resolve_geglu(cfg: Config, device: torch.device) -> Config:
    """speed.geglu as this run uses it: ``auto`` is difftrain's Triton backward where CUDA and Triton are there
    (geglu.py), diffusers' ops elsewhere; ``triton`` where they are not is refused before the model loads."""
    from . import geglu

    problem = geglu.available(device)
    if cfg.speed.geglu == "triton" and problem:
        raise BackendUnavailable(
            f"speed.geglu triton needs a CUDA GPU and Triton: {problem} here.",
            hint="Use speed.geglu: auto (Triton where it runs, diffusers' ops elsewhere) or torch.",
        )
    if cfg.speed.geglu != "auto":
        return cfg
    kind = "torch" if problem else "triton"
    return cfg.model_copy(update={"speed": cfg.speed.model_copy(update={"geglu": kind})})


def optimizer_kernels(speed: SpeedConfig, params: Sequence[torch.Tensor]) -> dict:
    """torch AdamW's implementation switches for these parameters."""
    kind = speed.optimizer_kernels
    if kind == "auto":
        kind = "fused" if params and all(p.is_cuda for p in params) else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[kind]
