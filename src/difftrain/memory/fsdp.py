"""torch's own sharding (FSDP2, ``torch.distributed.fsdp.fully_shard``) behind ``memory.engine: fsdp``.

Each of the denoiser's blocks (the units block swap moves, ``family.swap_blocks``) becomes one FSDP unit and
the rest of the denoiser the root unit: every process keeps 1/N of each weight (fp32, the master copy), of its
gradient and of the optimizer state; a unit's weights are gathered (in bf16 under ``train.mixed_precision:
bf16``) for its forward and again for its backward, gradients are reduce-scattered in fp32.

Loading is RAM-safe and GPU-safe as ZeRO-3's partitioned build is: the denoiser is built on the meta device,
sharded, given storage for its own shares only, and filled tensor by tensor from the main process's
memory-mapped read of the file (:func:`fill`); no process holds the whole model in host RAM or on its GPU.

Checkpoints hold whole tensors in difftrain's safetensors trees, not torch.distributed.checkpoint's files (their
metadata is a pickle, which difftrain does not read from a user's folder by default): the main process gathers
the weights and the optimizer state (:func:`full_model_state`, :func:`full_optimizer_state`) and a resume hands
them out again (:func:`load_model_state`, :func:`load_optimizer_state`), cut for however many processes resume.

Why our own glue around torch's: accelerate's FSDP2 path loads the whole model on every process (or on the main
one, in host RAM), and neither accelerate nor torch reads difftrain's families or safetensors trees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _dist():
    import torch.distributed as dist

    return dist


def shard(
    module: torch.nn.Module,
    units: list[torch.nn.Module],
    compute_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    offload_params: bool,
) -> torch.nn.Module:
    """``fully_shard`` each of ``units`` (in forward order), then ``module`` itself (the weights outside them)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if offload_params else OffloadPolicy()
    for unit in units:
        fully_shard(unit, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    # the root's weights are gathered first in forward and needed last in backward: kept whole in between
    fully_shard(module, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    return module


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fill(target: torch.nn.Module, source: torch.nn.Module | None, device: torch.device, main: bool) -> int:
    """Copy ``source``'s weights (given on the main process only) into the sharded ``target``, one tensor at a time:
    each process keeps its share of every weight, and every buffer whole. Returns the bytes the main process read.
    Names and shapes must match exactly; the first difference is raised on the main process before it sends."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    dist = _dist()
    src: dict[str, torch.Tensor] = {}
    if main:
        assert source is not None
        src = {
            **dict(source.named_parameters(remove_duplicate=False)),
            **dict(source.named_buffers(remove_duplicate=False)),
        }
        want = {n for n, _ in target.named_parameters(remove_duplicate=False)} | {
            n for n, _ in target.named_buffers(remove_duplicate=False)
        }
        missing, extra = sorted(want - set(src)), sorted(set(src) - want)
        problem = (
            f"the weights do not fit the model built from its config: missing {missing[:3]}, unexpected {extra[:3]}"
            if missing or extra
            else ""
        )
    else:
        problem = ""
    box = [problem]
    dist.broadcast_object_list(box, src=0)  # every process stops alike, before any tensor is sent
    if box[0]:
        raise ValueError(box[0])
    copied = 0
    with torch.no_grad():
        for name, p in target.named_parameters():
            if not isinstance(p, DTensor):
                raise TypeError(f"{name} is not sharded: fully_shard the module before filling it")
            full = torch.empty(p.shape, dtype=p.dtype, device=device)
            if main:
                s = src[name]
                if tuple(s.shape) != tuple(p.shape):
                    raise ValueError(f"{name} has shape {tuple(s.shape)} in the weights, {tuple(p.shape)} in the model")
                full.copy_(s)
                copied += s.numel() * s.element_size()
            # the main process's whole tensor, scattered: each process keeps the share its placement names
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0).to_local())
            del full
        for name, b in target.named_buffers():
            if main:
                b.copy_(src[name])
            dist.broadcast(b, src=0)
    return copied


def full_model_state(module: torch.nn.Module) -> dict[str, Any]:
    """The whole weights on the main process's CPU (collective: every process calls it; the others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_model_state(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Whole weights (read by the main process only; {} on the others) handed out as each process's shares."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole optimizer state, keyed by parameter name, on the main process's CPU (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A whole optimizer state (the main process's; {} on the others) handed out as each process's shares."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        module, optimizer, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


@contextlib.contextmanager
def no_sync(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Micro-batches before the last of an accumulation: gradients stay unreduced (FSDP2's gradient sync off)."""
    sharded = [m for m in modules if is_sharded(m)]
    for m in sharded:
        m.set_requires_gradient_sync(False)  # type: ignore[operator]  # FSDPModule's method
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True)  # type: ignore[operator]


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_ over sharded gradients returns a DTensor: its whole value, as a plain tensor."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def ensure_group(device: torch.device) -> None:
    """fully_shard needs a process group: a run on one process gets its own group of one (no launcher, no port)."""
    dist = _dist()
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
