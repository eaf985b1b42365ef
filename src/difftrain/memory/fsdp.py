"""torch's own sharding (FSDP2, ``torch.distributed.fsdp.fully_shard``) behind ``memory.engine: fsdp``.

Each of the denoiser's blocks (the units block swap moves, ``family.swap_blocks``) becomes one FSDP unit and
the rest of the denoiser the root unit: every process keeps 1/N of each weight (fp32, the master copy), of its
gradient and of the optimizer state; a unit's weights are gathered (in bf16 under ``train.mixed_precision:
bf16``) for its forward and again for its backward, gradients are reduce-scattered in fp32.

Loading is RAM-safe and GPU-safe as ZeRO-3's partitioned build is: the denoiser is built on the meta device,
sharded, given storage for its own shares only, and filled tensor by tensor from the main process's
memory-mapped read of the file (:func:`fill`); no process holds the whole model in host RAM or on its GPU.

In a checkpoint each process writes its own shares of the trained weights and of their optimizer state
(:func:`save_shares`, safetensors, one tensor at a time), and a resume on any number of processes reads only the
rows each now holds from them (:func:`load_shares`); not torch.distributed.checkpoint's files, whose metadata is a
pickle, which difftrain does not read from a user's folder by default. The export gathers the whole weights on
the main process one tensor at a time (:func:`full_model_state`).

Why our own glue around torch's: accelerate's FSDP2 path loads the whole model on every process (or on the main
one, in host RAM), and neither accelerate nor torch reads difftrain's families or safetensors trees.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
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
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
    for unit in units:
        fully_shard(unit, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)
        unit.register_forward_hook(_no_view_outputs, prepend=True)
    # the root's weights are gathered first in forward and needed last in backward: kept whole in between
    fully_shard(module, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    module.register_forward_hook(_no_view_outputs, prepend=True)
    return module


def _no_view_outputs(module: torch.nn.Module, args, output):
    """A sharded unit's outputs that are views of another tensor, copied (before FSDP's own post-forward hook, which
    this one precedes). FSDP2 hangs its pre-backward hook (the all-gather of the unit's weights for backward) on the
    outputs' autograd nodes; an in-place op on a view output replaces that node and drops the hook, so backward
    would run without the weights gathered (torch warns: "returned a view tensor"). diffusers' blocks return views
    (Flux's single blocks split text and image tokens by slicing; the models return reshaped outputs). A copy of a
    block's output is cheap beside the block; tensors that are not views pass unchanged."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._is_view() else None
    if isinstance(output, tuple) and any(isinstance(o, torch.Tensor) and o._is_view() for o in output):
        return type(output)(o.clone() if isinstance(o, torch.Tensor) and o._is_view() else o for o in output)
    sample = getattr(output, "sample", None)  # a diffusers output dataclass (return_dict=True)
    if hasattr(output, "to_tuple") and isinstance(sample, torch.Tensor) and sample._is_view():
        output.sample = sample.clone()
    return None


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fill(target: torch.nn.Module, source: torch.nn.Module | None, device: torch.device, main: bool) -> int:
    """Copy ``source``'s weights (given on the main process only) into the sharded ``target``, one tensor at a time:
    each process keeps its share of every weight, and every buffer whole. Returns the bytes the main process read.
    Names and shapes must match exactly; the first difference is raised on the main process before it sends."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from .deepspeed_engine import source_tensors

    dist = _dist()
    src: dict[str, torch.Tensor] = {}
    problem = ""
    if main:
        assert source is not None
        try:
            src = source_tensors(target, source)
        except ValueError as e:
            problem = str(e)
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


def full_model_state(module: torch.nn.Module, main: bool, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The whole weights on the main process's CPU, gathered one tensor at a time and cast to ``dtype`` there
    (floating tensors; None: as trained), so its host RAM holds the model once at the export's precision, never
    an fp32 copy beside it. Collective: every process calls it; the others get {}."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for name, t in module.state_dict().items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t  # the all-gather: every process takes part
        if main:
            out[name] = whole.detach().to("cpu", dtype if dtype is not None and whole.is_floating_point() else None)
        del whole
    return out


# ------------------------------------------------------------------ checkpoints: each process its own shares
#: the file each process writes its shares into, in a checkpoint's fsdp/ folder
SHARD_FILE = "rank{rank:05d}.safetensors"


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of a dim-0 size ``n`` that ``rank`` of ``world`` holds (torch.chunk's cut, which FSDP2
    and DTensor's Shard(0) use: ceil(n / world) rows each, the last ones fewer or none)."""
    per = -(-n // world) if n else 0
    start = min(rank * per, n)
    return start, min(start + per, n)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


#: torchao's quantized optimizer states, the only tensor classes a share file's metadata (and a checkpoint's optimizer
#: tree, trainers/state.py) may name
QUANTIZED = {
    "torchao.optim.subclass_8bit.OptimState8bit",
    "torchao.optim.subclass_4bit.OptimState4bit",
    "torchao.optim.subclass_fp8.OptimStateFp8",
}
#: torchao's AdamW moments: the first is signed, the second (and AMSGrad's max) not
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}


def _flatten(t: torch.Tensor, key: str, tensors: dict[str, torch.Tensor]) -> dict:
    """A quantized state (a tensor subclass) as its inner tensors, put in ``tensors`` under ``key#part``, and what
    rebuilds it (class, attributes) as JSON."""
    cls = f"{type(t).__module__}.{type(t).__qualname__}"
    if cls not in QUANTIZED:
        raise TypeError(f"cannot store optimizer state of class {cls} ({key})")
    parts, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]  # tensor subclasses' protocol
    for part in parts:
        tensors[f"{key}#{part}"] = getattr(t, part)
    attrs = [
        {"dtype": str(c).removeprefix("torch.")} if isinstance(c, torch.dtype)
        else {"size": list(c)} if isinstance(c, (tuple, torch.Size)) else c
        for c in ctx
    ]  # fmt: skip
    return {"class": cls, "parts": list(parts), "attrs": attrs}


def _unflatten(info: dict, read) -> torch.Tensor:
    """What :func:`_flatten` described, rebuilt from ``read(part)`` (each inner tensor, on its device)."""
    import importlib

    if info.get("class") not in QUANTIZED:
        raise ValueError(f"the shares name an unknown tensor class {info.get('class')!r}; it is not loaded")
    module, _, name = info["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    attrs = [
        getattr(torch, a["dtype"]) if isinstance(a, dict) and "dtype" in a
        else tuple(a["size"]) if isinstance(a, dict) and "size" in a else a
        for a in info["attrs"]
    ]  # fmt: skip
    return cls.__tensor_unflatten__({p: read(p) for p in info["parts"]}, attrs, None, None)


def save_shares(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, rank: int, world: int) -> None:
    """This process's shares of the trained weights and of their optimizer state, written to ``folder`` (every
    process its own file, one tensor at a time: host RAM holds one tensor, never the model). torchao's quantized
    moments are written as their parts (codes and scales: what the optimizer holds, no bigger). The param groups
    (learning rates, betas) go beside them as JSON, from the first process."""
    from ..utils import atomic_write_text, stream_save_safetensors

    names = {id(p): n for n, p in module.named_parameters()}
    sd = optimizer.state_dict()
    by_index = [p for g in optimizer.param_groups for p in g["params"]]
    tensors: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            tensors[f"w:{name}"] = _local(p.detach())
    quantized: dict[str, dict] = {}
    for i, state in sd["state"].items():
        name = names[id(by_index[i])]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local = _local(value)
                if hasattr(type(local), "__tensor_flatten__"):  # torchao's 8/4-bit moments: their parts, exactly
                    quantized[f"o:{name}:{key}"] = _flatten(local, f"o:{name}:{key}", tensors)
                else:
                    tensors[f"o:{name}:{key}"] = local
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"world": str(world), "rank": str(rank)}
    if quantized:
        meta["quantized"] = json.dumps(quantized)
    stream_save_safetensors(folder / SHARD_FILE.format(rank=rank), tensors, metadata=meta)
    if rank == 0:
        groups = [
            {
                **{k: v.item() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"},
                "params": [names[id(by_index[i])] for i in g["params"]],
            }
            for g in sd["param_groups"]
        ]
        atomic_write_text(folder / "param_groups.json", json.dumps(groups, indent=1))


def load_shares(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, rank: int, world: int) -> None:
    """What :func:`save_shares` wrote, on ``world`` processes whatever the count that wrote it: each process reads
    only the rows it holds now, from the files that hold them (memory-mapped slices), into its shares; the
    optimizer state is rebuilt around them. torchao's quantized moments come back exactly on as many processes as
    wrote them; on another count each old share is dequantized, its rows taken, and quantized again as this
    process's share (the optimizer's own buffer). Raises ValueError naming what does not fit."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard

    files = sorted(folder.glob("rank*.safetensors"))
    if not files:
        raise ValueError(f"no FSDP shares in {folder}")
    with safe_open(str(files[0]), framework="pt") as f:
        old = int((f.metadata() or {}).get("world", len(files)))
    if len(files) != old:
        raise ValueError(f"{folder} holds {len(files)} share files of a run on {old} processes")
    handles = [safe_open(str(p), framework="pt") for p in files]
    quantized = [json.loads((h.metadata() or {}).get("quantized", "{}")) for h in handles]
    keys = {k.split("#", 1)[0] for h in handles for k in h.keys()}  # noqa: SIM118 - a safetensors handle

    def old_share(r: int, key: str) -> torch.Tensor:
        """Old process ``r``'s whole share of ``key``, as floats where it was quantized."""
        if key in quantized[r]:
            return _unflatten(quantized[r][key], lambda part: handles[r].get_tensor(f"{key}#{part}")).dequantize()
        return handles[r].get_tensor(key)

    def old_rows(r: int, key: str) -> int:
        """How many rows of ``key`` old process ``r`` held (4-bit codes are packed: their shape is an attribute)."""
        q = quantized[r].get(key)
        sizes = [a["size"] for a in (q or {}).get("attrs", []) if isinstance(a, dict) and "size" in a]
        shape = sizes[0] if sizes else handles[r].get_slice(f"{key}#codes" if q else key).get_shape()
        return shape[0] if shape else 0

    def whole_rows(key: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the saved tensor ``key``, from the old processes' files that hold them."""
        total = sum(old_rows(r, key) for r in range(old))  # the old shares cut the whole
        pieces = []
        for r, h in enumerate(handles):
            a, b = _rows(total, old, r)
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                pieces.append(
                    old_share(r, key)[lo - a : hi - a] if key in quantized[r] else h.get_slice(key)[lo - a : hi - a]
                )
        if not pieces:
            return old_share(0, key)[0:0]
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def share(key: str, like: torch.Tensor) -> torch.Tensor:
        """This process's share of saved ``key``, laid out as ``like`` (a sharded parameter or a plain tensor)."""
        if key not in keys:
            raise ValueError(f"{key.split(':', 2)[1]} is not in the checkpoint's shares")
        if isinstance(like, DTensor):
            if tuple(like.placements) != (Shard(0),):
                raise ValueError(f"placements {like.placements} are not FSDP's Shard(0)")
            start, end = _rows(like.shape[0], world, rank)
            return whole_rows(key, start, end)
        return old_share(0, key)

    names = {id(p): n for n, p in module.named_parameters()}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad:
                local = _local(p)
                got = share(f"w:{name}", p)
                if tuple(got.shape) != tuple(local.shape):
                    raise ValueError(f"{name}: saved share {tuple(got.shape)}, this process holds {tuple(local.shape)}")
                local.copy_(got)
    groups = json.loads((folder / "param_groups.json").read_text(encoding="utf-8"))
    by_index = [p for g in optimizer.param_groups for p in g["params"]]
    index = {names[id(p)]: i for i, p in enumerate(by_index)}
    new_buffer = getattr(optimizer, "_new_buffer", None)  # torchao's low-bit AdamW: its quantized zeros for p
    local_states = getattr(optimizer, "local_states", False)  # memory/optimizers.py local_shares: no DTensor moments
    tensor_lr = [isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups]
    state: dict[int, dict] = {}
    for key in sorted(k for k in keys if k.startswith("o:")):
        _, name, what = key.split(":", 2)
        if name not in index:
            raise ValueError(f"{name} has optimizer state in the checkpoint but does not train here")
        p = by_index[index[name]]
        mine = quantized[rank].get(key) if old == world else None
        if mine is not None:  # this process's own quantized share, as it was
            dev = _local(p).device
            local = _unflatten(mine, lambda part, key=key, dev=dev: handles[rank].get_tensor(f"{key}#{part}").to(dev))
            tensor = local if local_states or not isinstance(p, DTensor) else DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )  # fmt: skip
        elif key not in quantized[0] and not handles[0].get_slice(key).get_shape():  # AdamW's step: the same on all
            tensor = handles[0].get_tensor(key)
        elif not isinstance(p, DTensor):
            tensor = old_share(0, key).to(p.device)
        else:  # a moment: this process's rows, laid out as its parameter's share
            value = share(key, p)
            if new_buffer is not None and what in SIGNED:  # quantized (or not) as the optimizer holds this share
                tensor = new_buffer(p, SIGNED[what])
                _local(tensor).copy_(value.to(_local(tensor).device))
            else:
                local = value.to(_local(p).device, _local(p).dtype if value.is_floating_point() else value.dtype)
                tensor = DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
        state.setdefault(index[name], {})[what] = tensor
    saved_groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": saved_groups})
    for g, was_tensor in zip(optimizer.param_groups, tensor_lr):
        if was_tensor and not isinstance(g["lr"], torch.Tensor):  # torchao steps only with lr as a tensor
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32)


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


#: whether this process made its own group of one (:func:`ensure_group`), to be released when its run ends
_OWN_GROUP = False


def with_index(device: torch.device) -> torch.device:
    """NCCL's group wants the GPU by number ("Please use a device_id with index"): train.device=cuda means
    the current one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def ensure_group(device: torch.device) -> None:
    """fully_shard needs a process group: a run on one process gets its own group of one (no launcher, no port),
    which :func:`release_group` ends with the run."""
    global _OWN_GROUP
    dist = _dist()
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    kwargs = {"device_id": with_index(device)} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    _OWN_GROUP = True


def release_group() -> None:
    """End the group of one :func:`ensure_group` made (nothing otherwise): the process is single again."""
    global _OWN_GROUP
    if _OWN_GROUP:
        _dist().destroy_process_group()
        _OWN_GROUP = False
