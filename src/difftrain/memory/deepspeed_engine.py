"""DeepSpeed ZeRO 2/3 on one GPU (or, later, several), configured from the pydantic config.

``ds_config`` writes the DeepSpeed JSON a user would otherwise write by hand
(the keys accelerate's DeepSpeed plugin uses); ``memory.engine.config_file``
may add or override any key. ``initialize`` wraps the trained module in
DeepSpeed's engine: DeepSpeed then owns the optimizer (AdamW; DeepSpeedCPUAdam
when the optimizer state is offloaded), gradient accumulation, clipping and
the bf16 master weights. Single process: the distributed environment a
launcher would set is filled in (rank 0 of 1) when absent.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config.schema import Config, EngineDeepSpeed, OptAdamW
from ..errors import BackendUnavailable, ConfigError
from .planner import ZERO_BUCKET


def ds_config(cfg: Config, family_zero3: Mapping[str, Any] | None = None) -> dict:
    """The DeepSpeed configuration for ``cfg`` (memory.engine kind deepspeed), user file merged over it.
    ``family_zero3``: the model family's measured ZeRO-3 settings (its ``zero3_settings``; handed in by the
    trainer, since memory does not import families), merged under zero_optimization at stage 3 unless
    memory.engine.family_settings is false."""
    e, t, o = cfg.memory.engine, cfg.train, _adamw(cfg)
    assert isinstance(e, EngineDeepSpeed), "ds_config is for memory.engine deepspeed"
    zero: dict = {
        "stage": e.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": ZERO_BUCKET,
    }
    if e.offload_optimizer_device != "none":
        zero["offload_optimizer"] = {"device": e.offload_optimizer_device, "pin_memory": True}
    if e.stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": ZERO_BUCKET,
                "stage3_param_persistence_threshold": 1e5,
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
        if e.offload_param_device != "none":
            zero["offload_param"] = {"device": e.offload_param_device, "pin_memory": True}
        if e.family_settings and family_zero3:  # what was measured faster for this family's denoiser
            zero = _merge(zero, dict(family_zero3))
    out = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.max_grad_norm or 0.0,
        "bf16": {"enabled": t.mixed_precision == "bf16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if e.offload_optimizer_device != "none":
        # ZeRO-Offload steps with DeepSpeedCPUAdam, which DeepSpeed builds from this block (a C++ op it
        # compiles once, ~30 s); on the GPU a plain torch AdamW is handed in (no CUDA compiler needed)
        out["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": t.learning_rate, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
        }
    if e.config_file is not None:
        out = _merge(out, _read(Path(e.config_file)))
    return out


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"memory.engine.config_file {path} does not exist.", hint="Give the path of a DeepSpeed JSON file."
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"memory.engine.config_file {path} is not valid JSON: {err}.",
            hint="Fix the file, or drop config_file: difftrain writes the DeepSpeed config itself.",
        ) from None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _single_process_env() -> None:
    """What a launcher (deepspeed / torchrun) would set, for a run started as a plain process."""
    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
    }.items():
        os.environ.setdefault(k, v)


def _deepspeed():
    """DeepSpeed, imported, on a machine with CUDA, with the environment a launcher would set."""
    try:
        import deepspeed
    except ImportError:
        raise BackendUnavailable(
            "memory.engine deepspeed needs DeepSpeed, which is not installed.",
            hint="pip install 'difftrain[deepspeed]' (it builds from source: install torch first, "
            "then `pip install --no-build-isolation deepspeed`), or set memory.engine.kind: single",
        ) from None
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "memory.engine deepspeed runs on CUDA GPUs only.", hint="Set memory.engine.kind: single here."
        )
    _single_process_env()
    return deepspeed


def _adamw(cfg: Config) -> OptAdamW:
    """The AdamW settings DeepSpeed steps with (the config's validation allows only adamw with DeepSpeed)."""
    o = cfg.memory.optimizer
    if not isinstance(o, OptAdamW):
        raise ConfigError(f"memory.engine deepspeed with memory.optimizer {o.kind}: set memory.optimizer.kind: adamw")
    return o


#: Python's recursion limit while DeepCompile traces and compiles the model (see initialize)
DEEPCOMPILE_RECURSION = 200_000


def arch_list_for_deepspeed(env: Mapping[str, str]) -> dict[str, str]:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it (what to set; empty where nothing changes).
    DeepCompile JIT-builds a CUDA op, and DeepSpeed 0.19.8's builder reads each entry's minor version as a number:
    Hopper's arch-specific "9.0a", which the GPU machines' image sets, stopped it ("invalid literal for int() with
    base 10: '0a'", 2 H200s, 2026-11-26). Its ops use nothing arch-specific, so the plain target builds them."""
    arch = env.get("TORCH_CUDA_ARCH_LIST")
    if not arch:
        return {}
    plain = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", arch)
    return {"TORCH_CUDA_ARCH_LIST": plain} if plain != arch else {}


def initialize(
    cfg: Config,
    module: torch.nn.Module,
    params: list[torch.nn.Parameter],
    family_zero3: Mapping[str, Any] | None = None,
):
    """The DeepSpeed engine over ``module`` training ``params``; returns (engine, optimizer for lr schedules).
    ``family_zero3``: as :func:`ds_config`'s."""
    deepspeed = _deepspeed()
    conf = ds_config(cfg, family_zero3)
    client = None
    if "optimizer" not in conf:
        o = _adamw(cfg)
        client = torch.optim.AdamW(
            params, lr=cfg.train.learning_rate, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
    engine, optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=params, optimizer=client, config=conf)
    if (conf.get("compile") or {}).get("deepcompile"):
        # DeepCompile (a config_file's "compile": {"deepcompile": true}, DeepSpeed >= 0.16.6): ZeRO-3's gathers and
        # releases scheduled inside one compiled graph instead of hooks around each module, the host cost that keeps
        # ZeRO-3 at 0.48x DDP on SDXL (docs/benchmarks.md, issue 28). DeepSpeed compiles only when asked through its
        # engine, so the key alone would do nothing
        os.environ.update(arch_list_for_deepspeed(os.environ))
        # DeepCompile's scheduler walks the whole model's graph depth first, one Python frame a node
        # (deepspeed/compile/list_schedule.py get_node_requirements, 0.19.8): at Python's default depth (1,000)
        # SDXL's first step stopped with "RecursionError: maximum recursion depth exceeded" (2 H200s, 2026-11-26;
        # the likely place, the worker's traceback was not kept).
        # The chain can be as long as the graph (tens of thousands of nodes for a UNet's forward and backward);
        # Python 3.11+ keeps such frames off the C stack. Whether it is enough is not yet measured
        sys.setrecursionlimit(max(sys.getrecursionlimit(), DEEPCOMPILE_RECURSION))
        engine.compile()
    # ZeRO copies the weights into flat buffers: the blocks the originals held stay cached in torch's allocator (SDXL
    # full, ZeRO-2 offload: 15.5 GiB reserved for 9.6 allocated); hand them back so the reservation is training's
    torch.cuda.empty_cache()
    # DeepSpeed's ZeRO optimizer wraps a torch optimizer whose param groups carry the learning rate
    return engine, getattr(optimizer, "optimizer", optimizer)


def gathered(engine, params):
    """A context in which ZeRO-3's partitioned ``params`` are whole (a no-op for stage 2)."""
    import contextlib

    if engine is None or engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


# ------------------------------------------------------------------ ZeRO-3: build partitioned, fill from one reader
#: how many bytes of parameters one gather makes whole on each GPU while the weights are filled in
FILL_CHUNK_BYTES = 256 * 2**20


def fill_weights(
    target: torch.nn.Module, source: torch.nn.Module | None, gather, broadcast, chunk_bytes: int = FILL_CHUNK_BYTES
) -> int:
    """Copy ``source``'s weights into ``target``, a few hundred MB at a time; returns the bytes copied.

    ``source`` is given on one process only (the reader; None on the others).
    ``gather(params)`` is a context in which ``params`` are whole on every
    process and, on leaving it, the reader's values are what every process
    keeps (DeepSpeed's ``GatheredParameters(params, modifier_rank=0)``);
    ``broadcast(tensor)`` sends a buffer from the reader to the others (buffers
    are not partitioned). Names and shapes must match exactly: the first
    difference is raised (on the reader) before anything of it is copied.

    Why our own: diffusers' ``from_pretrained`` has no ZeRO-3 path (transformers'
    has, for its own models only), so every process would otherwise load the
    whole model into host RAM before DeepSpeed partitions it.
    """
    src = source_tensors(target, source) if source is not None else {}
    copied = 0
    seen: set[int] = set()
    chunk: list[tuple[str, torch.nn.Parameter]] = []
    size = 0

    def flush() -> None:
        nonlocal copied, size
        if not chunk:
            return
        with gather([p for _, p in chunk]):
            if source is not None:
                with torch.no_grad():
                    for name, p in chunk:
                        s = src[name]
                        if tuple(s.shape) != tuple(p.shape):
                            raise ValueError(
                                f"{name} has shape {tuple(s.shape)} in the weights, {tuple(p.shape)} in the model"
                            )
                        p.data.copy_(s)
                        copied += s.numel() * s.element_size()
        chunk.clear()
        size = 0

    for name, p in target.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # a tied weight: filled once
            continue
        seen.add(id(p))
        chunk.append((name, p))
        size += _full_numel(p) * p.element_size()
        if size >= chunk_bytes:
            flush()
    flush()
    for name, b in target.named_buffers(remove_duplicate=False):
        if source is not None:
            with torch.no_grad():
                b.copy_(src[name])
        broadcast(b)
    return copied


def source_tensors(target: torch.nn.Module, source: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``source``'s parameters and buffers by name, where their names are exactly ``target``'s (a partitioned or
    sharded build being filled); the first differences are raised as a ValueError."""
    src = {
        **dict(source.named_parameters(remove_duplicate=False)),
        **dict(source.named_buffers(remove_duplicate=False)),
    }
    want = {n for n, _ in target.named_parameters(remove_duplicate=False)} | {
        n for n, _ in target.named_buffers(remove_duplicate=False)
    }
    missing, extra = sorted(want - set(src)), sorted(set(src) - want)
    if missing or extra:
        raise ValueError(
            f"the weights do not fit the model built from its config: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    return src


def _full_numel(p: torch.Tensor) -> int:
    """A ZeRO-3 parameter's whole size (its ``numel()`` is its partition's)."""
    shape = getattr(p, "ds_shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def build_partitioned(
    cfg: Config, build, read, main: bool, family_zero3: Mapping[str, Any] | None = None
) -> torch.nn.Module:
    """A module built under ``deepspeed.zero.Init`` (each process allocates only its share of every weight) and
    filled from ``read()``, which only the main process calls: host RAM holds one copy of the weights on the
    node (the main process's, memory-mapped from the file), and no GPU ever holds the whole model."""
    import torch.distributed as dist

    deepspeed = _deepspeed()
    conf = ds_config(cfg, family_zero3)
    dtype = torch.bfloat16 if conf["bf16"]["enabled"] else torch.float32
    # mem_efficient_linear off: it swaps torch.nn.functional.linear for DeepSpeed's own autograd function
    with deepspeed.zero.Init(config_dict_or_path=conf, dtype=dtype, mem_efficient_linear=False):
        module = build()
    fill_weights(
        module,
        read() if main else None,
        lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0),
        lambda t: dist.broadcast(t, src=0) if dist.is_initialized() and dist.get_world_size() > 1 else None,
    )
    return module.requires_grad_(False).eval()
