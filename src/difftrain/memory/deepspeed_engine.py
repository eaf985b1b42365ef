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
from pathlib import Path

import torch

from ..config.schema import Config
from ..errors import BackendUnavailable, ConfigError


def ds_config(cfg: Config) -> dict:
    """The DeepSpeed configuration for ``cfg`` (memory.engine kind deepspeed), user file merged over it."""
    e, t, o = cfg.memory.engine, cfg.train, cfg.memory.optimizer
    zero: dict = {
        "stage": e.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
    }
    if e.offload_optimizer_device != "none":
        zero["offload_optimizer"] = {"device": e.offload_optimizer_device, "pin_memory": True}
    if e.stage == 3:
        zero.update({"stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                     "stage3_gather_16bit_weights_on_model_save": False})
        if e.offload_param_device != "none":
            zero["offload_param"] = {"device": e.offload_param_device, "pin_memory": True}
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
        out["optimizer"] = {"type": "AdamW", "params": {"lr": t.learning_rate, "betas": list(o.betas), "eps": o.eps,
                                                        "weight_decay": o.weight_decay}}
    if e.config_file is not None:
        out = _merge(out, _read(Path(e.config_file)))
    return out


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"memory.engine.config_file {path} does not exist.", hint="Give the path of a DeepSpeed JSON file.") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"memory.engine.config_file {path} is not valid JSON: {err}.",
                          hint="Fix the file, or drop config_file: difftrain writes the DeepSpeed config itself.") from None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _single_process_env() -> None:
    """What a launcher (deepspeed / torchrun) would set, for a run started as a plain process."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)


def initialize(cfg: Config, module: torch.nn.Module, params: list[torch.nn.Parameter]):
    """The DeepSpeed engine over ``module`` training ``params``; returns (engine, optimizer for lr schedules)."""
    try:
        import deepspeed
    except ImportError:
        raise BackendUnavailable("memory.engine deepspeed needs DeepSpeed, which is not installed.",
                                 hint="pip install 'difftrain[deepspeed]' (it builds from source: install torch first, "
                                 "then `pip install --no-build-isolation deepspeed`), or set memory.engine.kind: single") from None
    if not torch.cuda.is_available():
        raise BackendUnavailable("memory.engine deepspeed runs on CUDA GPUs only.", hint="Set memory.engine.kind: single here.")
    _single_process_env()
    conf = ds_config(cfg)
    client = None
    if "optimizer" not in conf:
        o = cfg.memory.optimizer
        client = torch.optim.AdamW(params, lr=cfg.train.learning_rate, betas=tuple(o.betas), eps=o.eps,
                                   weight_decay=o.weight_decay)
    engine, optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=params, optimizer=client, config=conf)
    # DeepSpeed's ZeRO optimizer wraps a torch optimizer whose param groups carry the learning rate
    return engine, getattr(optimizer, "optimizer", optimizer)


def gathered(engine, params):
    """A context in which ZeRO-3's partitioned ``params`` are whole (a no-op for stage 2)."""
    import contextlib

    if engine is None or engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)
