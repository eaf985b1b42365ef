"""Building what training runs: the model parts with every memory technique applied in its fixed order, the
optimizer (or DeepSpeed's engine), the DDP wrappers and the EMA, returned as one typed :class:`Parts`.

The order of the techniques is :data:`TECHNIQUES`, applied to each loaded part in turn: storage that adapters
must see first, float8 compute, the adapters (LoRA, or the whole part trainable), activation checkpointing, the
weights' placement and precision, fp8 matmuls over the stored fp8 weights, block swap, and the speed section. A
technique that needs another's result comes after it in that list and nowhere else.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..config.schema import Config, EngineFSDP
from ..console import info, warn
from ..errors import BackendUnavailable, ConfigError, DifftrainError, ModelLoadError
from ..families import streaming
from ..families.base import ModelFamily, stage_precisions
from ..families.common import mapped_reads
from ..families.registry import row
from ..lora.adapters import adapter_metadata, add_lora
from ..memory import bnb_weights
from ..memory import pinned as pinned_
from ..memory.checkpoint_policy import checkpoint_function
from ..memory.placement import WeightPlacement
from ..memory.plan import (
    apply_activations,
    apply_offload,
    apply_weights,
    apply_weights_before_adapters,
    load_device,
    make_optimizer,
    weights_dtype,
)
from ..runtime import distributed as dist_
from ..speed import auto as speed_auto
from ..speed import float8 as speed_float8
from ..speed import geglu as geglu_
from ..speed import lora_kernel, memory_format, regional_compile
from ..utils import cap_gpu_memory, fix_malloc_mmap_threshold, gpu_index_gib, pick_device, stored_float_dtype
from .ema import EMA
from .parts import DDP, Parts


def training_device(cfg: Config, world: dist_.World) -> torch.device:
    """train.device; on several processes each takes the GPU of its local rank."""
    device = pick_device(cfg.train.device)
    if world.distributed and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", world.local_rank)  # one GPU per process
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def prepare_process(cfg: Config, world: dist_.World, device: torch.device) -> None:
    """The process group, the GPU memory cap, and the seeds, before anything random happens (the LoRA init
    draws from the global RNG)."""
    t = cfg.train
    problem = dist_.engine_problem(cfg, world.size) if cfg.memory.engine.kind != "auto" else None  # auto: chosen later
    if problem:
        raise ConfigError(problem, hint=dist_.ENGINE_HINT)
    dist_.init(world, device)
    pinned_.configure(cfg.memory.pinned_limit_gib)  # this run's pinned host memory starts at zero
    # freed host blocks above 1 MiB go back to the system: the host copy a load or block swap lets go of leaves the
    # RSS instead of staying in the C heap (measured: +0.7-1.6 GiB on the block swap recipes without it)
    fix_malloc_mmap_threshold()
    if cfg.memory.expandable and device.type == "cuda":
        # the allocator reads PYTORCH_CUDA_ALLOC_CONF once, at its first use, which may be behind us (a context
        # made earlier in this process); torch's setter applies to the segments made from now on
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    cap_gpu_memory(device, t.gpu_memory_limit_gib)
    random.seed(t.seed)
    torch.manual_seed(t.seed)


@dataclass
class Build:
    """What applying the techniques needs and collects, part by part."""

    cfg: Config
    family: ModelFamily
    device: torch.device
    lrs: dict[str, float]  # trained part -> learning rate
    prebuilt: bool  # the denoiser was built partitioned (ZeRO-3) or sharded (FSDP2): its shares are placed
    init: tuple[dict, dict] | None  # lora.init_weights as read: (layers per part, alphas per part)
    trained: dict[str, torch.nn.Module] = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)
    block_swap: Any = None
    placed: set[str] = field(default_factory=set)  # parts the streaming load stored and placed (memory/placement.py)
    swapped: list[int] | None = None  # the denoiser's units the streaming load put in host RAM

    def keep(self, part: str) -> tuple[str, ...]:
        return self.family.high_precision_modules.get(part, ())


#: a technique applied to one loaded part
Technique = Callable[[Build, str, torch.nn.Module], None]


def _weights_before_adapters(b: Build, part: str, module: torch.nn.Module) -> None:
    """Storage that adapters must be added over (bitsandbytes' quantized layers)."""
    apply_weights_before_adapters(b.cfg.memory, module, b.device, keep=b.keep(part))


def _float8(b: Build, part: str, module: torch.nn.Module) -> None:
    """speed.float8: torchao float8 training of the trained denoiser's Linear layers (full fine-tunes)."""
    if b.cfg.speed.float8 and part == b.family.denoiser and part in b.lrs:
        n = speed_float8.float8_training(module, b.device)
        info(f"speed.float8: {n} Linear layers of {part} compute in fp8 (torchao float8 training)")


def _fp8_matmul(b: Build, part: str, module: torch.nn.Module) -> None:
    """speed.fp8_matmul: the denoiser's fp8-stored Linear layers compute as fp8 matmuls (after _weights stored them)."""
    if not (b.cfg.speed.fp8_matmul and part == b.family.denoiser):
        return
    if b.device.type == "cuda" and torch.cuda.get_device_capability(b.device) < (8, 9):
        raise BackendUnavailable(
            "speed.fp8_matmul needs fp8 matmuls: a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper).",
            hint="Set speed.fp8_matmul: false on this GPU.",
        )
    from ..memory.fp8 import fp8_matmul_ok

    layers = [m for m in module.modules() if fp8_matmul_ok(m)]
    for m in layers:
        m.fp8_matmul = True  # type: ignore[assignment]  # Fp8Linear's class attribute, set per layer
    info(f"speed.fp8_matmul: {len(layers)} fp8 Linear layers of {part} compute as fp8 matmuls")


def _adapters(b: Build, part: str, module: torch.nn.Module) -> None:
    """A trained part gets its LoRA adapter (or is trainable whole) and its optimizer group."""
    if part not in b.lrs:
        return
    cfg = b.cfg
    if cfg.train.method == "lora":
        targets = cfg.lora.targets if part == b.family.denoiser else b.family.text_encoder_lora_targets
        try:
            params = add_lora(module, cfg.lora, targets)
        except ValueError as e:
            raise DifftrainError(f"LoRA: {e}.", hint="Check lora.targets against the model's module names.") from None
        if b.init is not None:
            _init_lora(cfg, part, module, b.init)
        if not cfg.lora.plain and part == b.family.denoiser:
            kind = "DoRA" if cfg.lora.use_dora else {"loha": "LoHa", "lokr": "LoKr"}[cfg.lora.type]
            kept = "" if cfg.lora.use_dora else ", and keeps it for the backward"
            info(
                f"lora: {kind} (peft) builds each adapted layer's whole weight change in the forward{kept}: more "
                "memory than a LoRA of its rank, which is what the memory plan counts"
            )
    else:
        module.requires_grad_(True)
        if part == b.family.denoiser:  # what no gradient reaches stays frozen (DDP refuses it trained)
            frozen = set(b.family.unused_parameters(module))
            for name, p in module.named_parameters():
                if name in frozen:
                    p.requires_grad_(False)
        params = [p for p in module.parameters() if p.requires_grad]
    module.train()
    b.trained[part] = module
    b.groups.append({"params": params, "lr": b.lrs[part]})


def _activations(b: Build, part: str, module: torch.nn.Module) -> None:
    """Checkpointing pays on every module that backward runs through."""
    act = b.cfg.memory.activations
    if part in b.lrs or part == b.family.denoiser:
        keep = act.keep_on_gpu if act.kind == "checkpoint" and part == b.family.denoiser else 0
        blocks = b.family.swap_blocks(module) if keep else None
        if blocks is not None and keep > len(blocks):
            warn(
                f"memory.activations.keep_on_gpu: {keep} asked, {part} has {len(blocks)} blocks: all of their inputs "
                "stay on the GPU"
            )
        apply_activations(b.cfg.memory, module, blocks)
    if part == b.family.denoiser and act.kind == "checkpoint" and act.split:
        if n := b.family.split_blocks(b.family.swap_blocks(module)):
            info(f"memory.activations.split: {n} blocks of {part} run as checkpointed segments")
        else:
            warn(
                f"memory.activations.split: {b.family.name} has no segmented forward for its blocks; split does nothing"
            )


def _swapped(b: Build, part: str) -> bool:
    return part == b.family.denoiser and b.cfg.memory.offload.kind == "block_swap"


def _weights(b: Build, part: str, module: torch.nn.Module) -> None:
    """Placement and storage precision (fp8, nf4 ...) of the frozen weights."""
    if not (b.prebuilt and part == b.family.denoiser):  # ZeRO-3 / FSDP placed each share where it belongs
        placed = part in b.placed
        apply_weights(b.cfg.memory, module, b.device, keep=b.keep(part), swapped=_swapped(b, part), placed=placed)


def _offload(b: Build, part: str, module: torch.nn.Module) -> None:
    """Block swap: the denoiser's blocks that do not fit live in host RAM and stream in as they run."""
    if not _swapped(b, part):
        return
    if b.device.type != "cuda":
        warn("block swap on the CPU only copies weights around: it saves memory on a GPU")
    full = part in b.lrs and b.cfg.train.method == "full"
    graphs = b.cfg.speed.cuda_graphs is True  # resolved before the parts are built (choose_speed)
    units = b.family.swap_blocks(module)
    swapped = b.swapped if part in b.placed else None
    b.block_swap = apply_offload(b.cfg.memory, module, units, b.device, full=full, fixed=graphs, swapped=swapped)
    swap = b.block_swap
    info(
        f"block swap: {len(swap.swapped)} of {len(swap.units)} blocks of {part} "
        f"({swap.swapped_bytes / 2**30:.2f} GiB) live in host RAM"
        + (
            f"; CUDA graphs: they land in {len(swap.slots)} fixed GPU slots ({swap.slot_bytes / 2**30:.2f} GiB)"
            * graphs
        )
    )


def _speed(b: Build, part: str, module: torch.nn.Module) -> None:
    """The speed section's changes to the denoiser, after the memory plan placed it (``b.cfg.speed`` as
    :func:`choose_speed` resolved it: no ``auto`` left)."""
    if part != b.family.denoiser:
        return
    sp = b.cfg.speed
    _geglu(b, part, module)
    if sp.lora_kernel == "fused" and b.cfg.train.method == "lora" and (n := lora_kernel.use_fused(module)):
        info(
            f"speed.lora_kernel: {n} LoRA Linears of {part} take difftrain's fused forward and backward; "
            f"{lora_kernel.fused_attentions(module)} attentions run q, k and v of one input as one call"
        )
    if sp.channels_last is True and b.cfg.memory.engine.kind == "fsdp":
        warn("speed.channels_last is not applied to FSDP's sharded weights (not measured there)")
    elif sp.channels_last is True:
        memory_format.channels_last(module)
        info(f"speed.channels_last: the convolutions of {part} run in channels-last memory format")
    if sp.compile:
        act = b.cfg.memory.activations
        # offloaded checkpoints stay diffusers' (around the compiled blocks): the host copies cannot be traced
        every = act.every if act.kind == "checkpoint" and not act.offload else 0
        keep_attention = act.kind == "checkpoint" and bool(every) and act.save_attention
        # block swap's and FSDP's hooks run around each block (moving or gathering its weights): only the block's
        # forward is compiled, the hooks stay eager
        hooks = "block swap" if b.block_swap is not None else "FSDP" if b.cfg.memory.engine.kind == "fsdp" else ""
        hooks_outside = bool(hooks)
        regions = tuple(sp.compile_regions or b.family.repeated_blocks)
        n = regional_compile.compile_blocks(
            module,
            regions,
            sp,
            checkpoint_every=every,
            hooks_outside=hooks_outside,
            checkpoint=checkpoint_function(keep_attention),
        )
        info(
            f"speed.compile: {n} blocks of {part} compile on their first step"
            f"{', checkpointed inside the compiled region' if every else ''}"
            f"{' (the attentions kept)' if keep_attention else ''}"
            f"{' (their forward only: ' + hooks + ' hooks around them)' if hooks_outside else ''}"
            f" (cache: {regional_compile.compile_cache_dir(sp)})"
        )


def _geglu(b: Build, part: str, module: torch.nn.Module) -> None:
    """speed.geglu triton (as :func:`speed.resolve_geglu` resolved it): difftrain's Triton backward for diffusers'
    GEGLU gates (SDXL's feed-forwards)."""
    if b.cfg.speed.geglu == "triton" and (n := geglu_.use_fused(module)):
        info(f"speed.geglu: {n} GEGLU gates of {part} take difftrain's Triton backward")


def choose_engine(cfg: Config, world: dist_.World, device: torch.device, resume: Path | None) -> Config:
    """memory.engine ``auto`` resolved for this run (planning.choose_engine; the same choice on every process: the
    first one reads the resumed checkpoint's engine and shares it), said in one line; what the chosen engine cannot
    train on these processes is refused before anything loads."""
    from ..planning.engines import choose_engine as choose
    from .checkpoint import Checkpointer

    if cfg.memory.engine.kind != "auto":
        return cfg
    recorded = Checkpointer.recorded_engine(resume) if world.main and resume is not None else None
    if world.distributed:
        recorded = dist_.broadcast_object(recorded, world)
    gpu_gib = None
    if device.type == "cuda":
        gpu_gib = cfg.train.gpu_memory_limit_gib or gpu_index_gib(device)[1]
    chosen, line = choose(cfg, world.size, gpu_gib, recorded)
    problem = dist_.engine_problem(chosen, world.size)
    if problem:
        raise ConfigError(problem, hint=dist_.ENGINE_HINT)
    if line and world.main:
        info(line)
    return chosen


def choose_speed(
    cfg: Config, family: ModelFamily, world: dist_.World, device: torch.device, steps: int, shapes: int
) -> tuple[Config, speed_auto.SpeedChoice]:
    """speed.compile and speed.cuda_graphs decided for this run (``auto`` resolved, explicit values kept), and
    the config with them set: everything after this reads plain booleans."""
    warm = regional_compile.is_warm(cfg.speed, regional_compile.warm_key(cfg))
    run = speed_auto.run_facts(cfg, steps, shapes=shapes, processes=world.size, warm=warm)
    choice = speed_auto.decide(
        cfg.speed, speed_auto.CompileCost(**family.compile_cost), speed_auto.platform_facts(device), run
    )
    resolved = cfg.speed.model_copy(
        update={
            "compile": choice.compile,
            "cuda_graphs": choice.cuda_graphs,
            "channels_last": speed_auto.channels_last_auto(cfg, row(cfg.family).channels_last, choice.compile, device),
            "lora_kernel": speed_auto.lora_kernel_auto(cfg, device),
        }
    )
    return cfg.model_copy(update={"speed": resolved}), choice


#: the techniques in the order they apply to each part (see the module's docstring)
TECHNIQUES: tuple[Technique, ...] = (
    _weights_before_adapters,
    _float8,
    _adapters,
    _activations,
    _weights,
    _fp8_matmul,
    _offload,
    _speed,
)


def _init_lora(cfg: Config, part: str, module: torch.nn.Module, init: tuple[dict, dict]) -> None:
    """lora.init_weights: continue from a LoRA file (diffusers or kohya layout; ``init`` as read) of this part."""
    from ..lora import files as lora_files

    src = Path(cfg.lora.init_weights)  # type: ignore[arg-type]  # set whenever init is
    layers, file_alphas = init
    if part not in layers:
        raise ConfigError(
            f"lora.init_weights {src.name} has no {part} layers.",
            hint="Train only the parts the file adapts, or give the LoRA that has them.",
        )
    lora_files.load_into(module, part, layers[part], file_alphas.get(part, {}), adapter_metadata(module), src)
    info(f"{part}: LoRA weights taken from {src}")


def _fsdp_builds_denoiser(cfg: Config, family: ModelFamily, parts: list[str]) -> bool:
    """memory.engine fsdp (full fine-tunes, the validator checks): the denoiser is built sharded."""
    return cfg.memory.engine.kind == "fsdp" and family.denoiser in parts


def _sharded_denoiser(cfg: Config, family: ModelFamily, world: dist_.World, device: torch.device) -> torch.nn.Module:
    """FSDP2: the denoiser built on the meta device, each block sharded (memory.fsdp.shard), storage made for this
    process's shares only, then filled from the main process's memory-mapped read, one tensor at a time."""
    from ..memory import fsdp

    den = family.denoiser
    e = cfg.memory.engine
    assert isinstance(e, EngineFSDP), "built sharded for memory.engine fsdp only"
    fsdp.ensure_group(device)
    with torch.device("meta"):
        module = family.empty_part(cfg.model, den)
    if e.master_dtype == "bf16":  # the shares (and their gradients) in bf16; fill converts the file's tensors
        module.to(torch.bfloat16)
    compute = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else None
    fsdp.shard(module, family.swap_blocks(module), compute, e.reshard_after_forward, e.offload_params)
    module.to_empty(device="cpu" if e.offload_params else device)
    try:
        fsdp.fill(module, _mapped_denoiser(cfg, family) if world.main else None, device, world.main)
    except ValueError as err:
        raise ModelLoadError(
            f"The {den} weights of {cfg.model.path} do not fit its config: {err}.",
            hint="Check model.config (single files) or the folder's config.json.",
        ) from None
    return module.requires_grad_(False).eval()


def _mapped_denoiser(cfg: Config, family: ModelFamily) -> torch.nn.Module:
    """The denoiser read in the dtype the file stores, its pages memory-mapped (no private copy): the copy to each
    process's share converts; a dtype conversion here would hold a second, private copy of the model."""
    den = family.denoiser
    p = Path(cfg.model.path)  # type: ignore[arg-type]  # the model was loaded from it
    files = [p] if p.is_file() else sorted((p / den).glob("*.safetensors"))
    dtype = stored_float_dtype(files) or weights_dtype(cfg.memory)  # None: not safetensors
    with mapped_reads():  # from_pretrained's mapped pages, not difftrain's private reads (common.mapped_reads)
        return family.load(cfg.model, [den], dtype=dtype, device="cpu")[den]


def _zero3_builds_denoiser(cfg: Config, family: ModelFamily, parts: list[str]) -> bool:
    """A full fine-tune under ZeRO-3 builds the denoiser partitioned. Not with LoRA: peft reads the whole shape
    of each adapted weight, which a partitioned one no longer has (its frozen base is then loaded by every
    process from the same memory-mapped pages, one copy in host RAM, before DeepSpeed partitions it).
    DIFFTRAIN_ZERO3_INIT=0 takes that path for full fine-tunes too (for comparison in benchmarks/multi_gpu.py)."""
    e = cfg.memory.engine
    return (
        e.kind == "deepspeed"
        and e.stage == 3
        and family.denoiser in parts
        and cfg.train.method == "full"
        and os.environ.get("DIFFTRAIN_ZERO3_INIT") != "0"
    )


def _partitioned_denoiser(cfg: Config, family: ModelFamily, world: dist_.World) -> torch.nn.Module:
    """ZeRO-3: the denoiser built partitioned on every process (none holds it whole, on the GPU or in host
    RAM) and filled by the main process alone, from its memory-mapped weights, a few hundred MB at a time."""
    from ..memory.deepspeed_engine import build_partitioned

    den = family.denoiser

    try:
        return build_partitioned(
            cfg,
            lambda: family.empty_part(cfg.model, den),
            lambda: _mapped_denoiser(cfg, family),
            world.main,
            family.zero3_settings,
        )
    except ValueError as err:
        raise ModelLoadError(
            f"The {den} weights of {cfg.model.path} do not fit its config: {err}.",
            hint="Check model.config (single files) or the folder's config.json.",
        ) from None


def _placement(
    cfg: Config, family: ModelFamily, device: torch.device, loaded: list[str], lrs: dict[str, float]
) -> WeightPlacement:
    """The streaming load's placement (memory/placement.py): fp8 storage and block swap's host copies made as each
    tensor is read, so the part is never whole in host memory (issue 50). Parts it does not take load as before.
    DIFFTRAIN_STREAMING_LOAD=0 takes none (the load before issue 50, for comparison in benchmarks and tests)."""
    full = [part for part in lrs if cfg.train.method == "full"]
    if cfg.memory.weights.kind in ("nf4", "int8"):  # bitsandbytes and a GPU, said before anything loads
        bnb_weights.require(cfg.memory.weights.kind, device)
    return WeightPlacement(
        cfg.memory,
        device,
        weights_dtype(cfg.memory),
        loaded if os.environ.get("DIFFTRAIN_STREAMING_LOAD") != "0" else [],
        family.denoiser,
        full_trained=full,
        keep=family.high_precision_modules,
        units=family.swap_blocks if cfg.memory.offload.kind == "block_swap" else None,
    )


def build_parts(
    cfg: Config,
    family: ModelFamily,
    world: dist_.World,
    device: torch.device,
    parts: list[str],
    lrs: dict[str, float],
    live: list[str],
    init: tuple[dict, dict] | None,
) -> Parts:
    """Load ``parts`` and apply :data:`TECHNIQUES` to each; then the optimizer, DDP and the EMA."""
    den = family.denoiser
    sharded = _fsdp_builds_denoiser(cfg, family, parts)
    zero3 = _zero3_builds_denoiser(cfg, family, parts)
    loaded = [part for part in parts if not ((zero3 or sharded) and part == den)]
    precision = stage_precisions(family, cfg.text_encoders, live)
    placement = _placement(cfg, family, device, loaded, lrs)
    with streaming.placing(placement) as placed:
        comps = (
            family.load(
                cfg.model,
                loaded,
                dtype=weights_dtype(cfg.memory),
                device=load_device(cfg.memory, device),
                precision=precision,
            )
            if loaded
            else {}
        )
    if sharded:
        comps[den] = _sharded_denoiser(cfg, family, world, device)
    elif zero3:
        comps[den] = _partitioned_denoiser(cfg, family, world)
    b = Build(cfg, family, device, lrs, zero3 or sharded, init, placed=set(placed), swapped=placement.swapped)
    for part in parts:
        for technique in TECHNIQUES:
            technique(b, part, comps[part])
    out = Parts(comps, b.trained, [p for g in b.groups for p in g["params"]], b.groups, block_swap=b.block_swap)
    out.fsdp = sharded
    _optimizer(cfg, family, out)
    if world.distributed and cfg.memory.engine.kind in ("auto", "single", "ddp"):
        _wrap_ddp(cfg, world, device, out)
    e = cfg.memory.engine
    if (
        world.distributed
        and ((e.kind == "deepspeed" and e.stage == 3) or e.kind == "fsdp")
        and (cfg.validation.prompts or cfg.validation.loss_items)
    ):
        raise ConfigError(
            f"validation with {'FSDP' if e.kind == 'fsdp' else 'DeepSpeed ZeRO-3'} on several processes is not "
            "supported yet (the first "
            "process alone cannot run a model whose weights are spread over all of them).",
            hint="Drop validation.prompts / validation.loss_items for this run, or use ZeRO-2.",
        )
    if cfg.ema.enabled:
        named = {
            f"{part}.{n}": p for part, m in out.trained.items() for n, p in m.named_parameters() if p.requires_grad
        }
        out.ema = EMA(named, cfg.ema.decay, cfg.ema.update_every, cfg.ema.device)
    return out


def _optimizer(cfg: Config, family: ModelFamily, parts: Parts) -> None:
    """The optimizer over the trained parameters (or DeepSpeed's engine, which then owns it)."""
    if cfg.memory.engine.kind == "deepspeed":
        from ..memory.deepspeed_engine import initialize

        # the validator allows the denoiser as the only trained part
        parts.engine, parts.optimizer = initialize(
            cfg, parts.trained[family.denoiser], parts.params, family.zero3_settings
        )
    else:
        kernels = speed_auto.optimizer_kernels(cfg.speed, parts.params)
        parts.optimizer = make_optimizer(
            cfg.memory, parts.groups, cfg.train.learning_rate, seed=cfg.train.seed, kernels=kernels
        )
    o = cfg.memory.optimizer
    if o.kind == "adamw8bit" and o.backend == "bnb" and any(p.dtype == torch.bfloat16 for p in parts.params):
        warn(
            "adamw8bit updates bf16 weights with round-to-nearest (no stochastic rounding): "
            "very small updates are lost; memory.optimizer.kind adamw rounds stochastically"
        )


def _wrap_ddp(cfg: Config, world: dist_.World, device: torch.device, parts: Parts) -> None:
    """DistributedDataParallel around each trained part (its gradients averaged in buckets during backward).
    The wrappers serve the forward passes only: state dicts, exports and validation use the parts
    themselves. Attribute reads fall through to the part, so family code that reads ``.config`` works."""
    import inspect

    e = cfg.memory.engine
    cap = getattr(e, "bucket_cap_mb", 25.0)
    n = sum(p.numel() for p in parts.params)
    opts = dist_.ddp_options(n, dist_.backend_for(device), cap)
    opts["find_unused_parameters"] = getattr(e, "find_unused_parameters", False)
    opts["static_graph"] = getattr(e, "static_graph", False)
    if getattr(e, "gradient_as_bucket_view", False) and "gradient_as_bucket_view" not in opts:
        opts["gradient_as_bucket_view"] = True  # ddp_options keeps it off where gloo needs it off
    params = inspect.signature(DistributedDataParallel).parameters
    if "init_sync" in params:
        opts["init_sync"] = False  # every process loaded the same weights and drew the same LoRA init
    if "forward_sync_buffers" in params:  # torch >= 2.13 names it so (broadcast_buffers is deprecated)
        opts["forward_sync_buffers"] = opts.pop("broadcast_buffers")
    ids = [device.index] if device.type == "cuda" else None
    for part, module in parts.trained.items():
        parts.wrapped[part] = DDP(module, device_ids=ids, **opts)
    if cfg.memory.engine.kind == "single":
        info(f"{world.size} processes: gradients averaged with DDP (memory.engine ddp)")
