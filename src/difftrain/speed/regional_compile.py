"""Regional compilation (speed.compile) and its CUDA graphs (speed.cuda_graphs: torch.compile's reduce-overhead
mode): every repeated block compiled in place, gradient checkpointing moved inside the compiled blocks, inductor's
lasting caches and whether they already hold a run's blocks, and dynamo's recompile limit watched.

Regional compilation follows diffusers' ``ModelMixin.compile_repeated_blocks`` (``submodule.compile()`` on every
block of a repeated class), with the block classes given by the family: diffusers lists only the UNet's
transformer block and nothing for SD3's or CogVideoX's transformers.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..config.schema import SpeedConfig
from ..errors import ConfigError, DifftrainError


def compile_cache_dir(speed: SpeedConfig) -> Path:
    return Path(speed.compile_cache_dir or Path.home() / ".cache" / "difftrain" / "torch-compile").expanduser()


class _RecompileLimitWatch(logging.Handler):
    """Dynamo answers a block past its recompile limit by running it eagerly from then on, with one log warning
    among many: this names it as difftrain's own warning, once per function, and keeps the count."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "hit config." not in msg or "recompile_limit" not in msg:
            return
        lines = msg.splitlines()
        func = next((ln.split("function:", 1)[1].strip() for ln in lines if "function:" in ln), "?")
        self.hits.append(func)
        from ..console import warn

        warn(
            f"torch.compile reached its recompile limit ({lines[0].split('(')[-1].rstrip(')')}) for {func}: "
            "that block now runs eagerly (slower, same result). Many bucket shapes or changing options cause it; "
            "set speed.dynamic: true, or report it with TORCH_LOGS=recompiles"
        )


_WATCH = _RecompileLimitWatch()


def recompile_limit_hits() -> list[str]:
    """The functions that dynamo left eager at its recompile limit in this process (``configure_compile`` on)."""
    return list(_WATCH.hits)


def configure_compile(speed: SpeedConfig) -> None:
    """Point inductor's on-disk caches (FX graphs, AOT autograd) at a lasting folder, so a second run of the same
    config reuses the compiled kernels; allow enough recompiles for every block shape of a model."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir(speed)))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    import torch._dynamo

    cfg = torch._dynamo.config
    # SDXL's ResnetBlock2D comes in ~10 shapes and layouts (with and without a shortcut); torch's default of 8
    # compiled versions per block class would silently leave the rest eager
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(64, getattr(cfg, name)))
    # ... and each shape of each of them once more for every bucket (dynamic after the second): the limit over
    # all blocks together (256 by default) would leave the blocks seen last eager, silently
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(4096, cfg.accumulated_recompile_limit)
    log = logging.getLogger("torch._dynamo.convert_frame")  # where dynamo reports a recompile limit hit
    if _WATCH not in log.handlers:
        log.addHandler(_WATCH)
    import torch._inductor.config as inductor_cfg

    # CUDA graphs record one graph per block shape and bucket: a warning past 8 sizes per block is noise here
    if hasattr(inductor_cfg.triton, "cudagraph_dynamic_shape_warn_limit"):
        inductor_cfg.triton.cudagraph_dynamic_shape_warn_limit = None


def compile_blocks(
    module: torch.nn.Module,
    block_classes: tuple[str, ...],
    speed: SpeedConfig,
    checkpoint_every: int = 0,
    hooks_outside: bool = False,
    checkpoint: Callable | None = None,
) -> int:
    """Compile, in place, every submodule whose class is one of ``block_classes``; returns how many.

    ``Module.compile`` keeps the module's parameters and state-dict names (no ``_orig_mod`` wrapper), so
    checkpoints, LoRA export and EMA see the same module. With ``checkpoint_every`` k > 0 (gradient
    checkpointing), every k-th block is checkpointed *inside* its compiled region instead of by diffusers around
    it (see ``checkpoint_inside``). ``hooks_outside``: only each block's ``forward`` is compiled, so the module
    hooks around it (block swap's, which move weights) run eagerly; the compiled forward reads the parameters
    as inputs (dynamo lifts them), so a weight that block swap brought back to a new address needs no recompile.
    """
    configure_compile(speed)
    mode = compile_mode(speed)
    # by the class or one it derives from: FSDP2 turns each sharded block into a subclass of its own
    # (FSDPBasicTransformerBlock)
    blocks = [sub for sub in module.modules() if any(c.__name__ in block_classes for c in type(sub).__mro__)]
    if speed.compile_regions:
        found = {c.__name__ for sub in blocks for c in type(sub).__mro__}
        missing = [name for name in speed.compile_regions if name not in found]
        if missing:
            raise ConfigError(
                f"speed.compile_regions names {', '.join(missing)}, which this model has no submodule of.",
                hint=f"Name classes of {type(module).__name__}'s submodules, or leave speed.compile_regions null.",
            )
    # a region inside another compiled one is compiled as part of it
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}
    blocks = [b for b in blocks if id(b) not in inner]
    if checkpoint_every:
        checkpoint_inside(module, blocks[::checkpoint_every], checkpoint)
    for sub in blocks:
        if hooks_outside:
            sub.forward = torch.compile(sub.forward, mode=mode, dynamic=speed.dynamic)
        else:
            sub.compile(mode=mode, dynamic=speed.dynamic)
    return len(blocks)


def warm_key(cfg) -> str:
    """What decides whether inductor's cache holds this run's compiled blocks: the model, what is trained and
    how the blocks compute (an estimate for ``auto``: inductor's own cache keys on the graphs themselves)."""
    import hashlib
    import json

    m, sp = cfg.memory, cfg.speed
    parts = {
        "family": cfg.family,
        "architecture": cfg.model.config,
        "torch": torch.__version__,
        "method": cfg.train.method,
        "lora": [cfg.lora.rank, list(cfg.lora.targets or [])] if cfg.train.method == "lora" else None,
        # another adapter computes another graph (a plain LoRA's key stays as it was)
        **({"adapter": cfg.lora.model_dump(mode="json", exclude={"init_weights"})} if not cfg.lora.plain else {}),
        "weights": m.weights.kind,
        "activations": m.activations.kind,
        "mode": sp.compile_mode,
        "regions": sp.compile_regions,
        "geglu": sp.geglu,
        "channels_last": sp.channels_last,
        "lora_kernel": sp.lora_kernel,
        "precision": cfg.train.mixed_precision,
        "hooks_outside": m.offload.kind == "block_swap",  # only the blocks' forward compiles
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


_WARM_FILE = "difftrain-compiled.json"


def is_warm(speed: SpeedConfig, key: str) -> bool:
    """Whether a run with this ``warm_key`` compiled into this cache before (``mark_warm``)."""
    from ..utils import read_json_object

    return key in read_json_object(compile_cache_dir(speed) / _WARM_FILE)  # {} when missing or damaged


def mark_warm(speed: SpeedConfig, key: str) -> None:
    """Record that the blocks of a run with this key compiled into the cache (after its first step)."""
    from ..utils import atomic_write_text, read_json_object

    path = compile_cache_dir(speed) / _WARM_FILE
    try:
        seen = read_json_object(path)
        seen[key] = time.strftime("%Y-%m-%d %H:%M:%S")
        path.parent.mkdir(parents=True, exist_ok=True)
        import json

        atomic_write_text(path, json.dumps(seen, indent=1) + "\n")
    except (OSError, ValueError, DifftrainError) as e:  # a marker that cannot be written is only a guess lost
        from ..console import warn

        warn(f"could not note the compiled blocks in {path}: {e}")


def compile_mode(speed: SpeedConfig) -> str | None:
    """torch.compile's mode for the speed section: CUDA graphs (reduce-overhead) and autotuning chosen apart."""
    autotune = speed.compile_mode != "default"
    if speed.cuda_graphs:
        return "max-autotune" if autotune else "reduce-overhead"
    return "max-autotune-no-cudagraphs" if autotune else None


def checkpoint_inside(
    module: torch.nn.Module, blocks: list[torch.nn.Module], checkpoint: Callable | None = None
) -> None:
    """Gradient checkpointing moved into the compiled blocks (the way torchtitan pairs the two).

    diffusers checkpoints a block by calling it through ``torch.utils.checkpoint`` from its parent, so the
    compiled block's forward runs again, eagerly re-entered, inside backward: twice the launches, and CUDA graphs
    replay over outputs still in use (measured: SDXL fails). Here the checkpoint call sits inside the traced
    forward: dynamo captures it as one region, and AOT autograd's partitioner saves only the block's inputs and
    recomputes the rest inside the compiled backward graph - the same memory as diffusers' checkpointing, one
    forward and one backward graph per block. ``checkpoint``: what a block is called through (the trainer passes
    memory/checkpoint_policy.py's, which keeps the attentions' outputs with memory.activations.save_attention);
    torch's non-reentrant checkpoint by default.
    """
    if checkpoint is None:
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        checkpoint = functools.partial(torch_checkpoint, use_reentrant=False)

    for m in module.modules():  # diffusers' own switches off: the blocks checkpoint themselves
        if isinstance(getattr(m, "gradient_checkpointing", None), bool):
            m.gradient_checkpointing = False  # type: ignore[assignment]  # diffusers' bool; torch: Tensor | Module
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, **kwargs)

        block.forward = forward
