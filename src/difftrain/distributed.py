"""Several processes, one per GPU: torch's launcher, the process group, and how a global batch is shared.

Launch. ``difftrain train --gpus N`` (``--nodes``, ``--node-rank``, ``--master-addr``,
``--master-port`` or ``--rdzv-endpoint`` for several machines) re-runs the same
command under torchrun's elastic agent (``torch.distributed.run``), one process
per GPU; ``torchrun ... -m difftrain train ...`` and ``accelerate launch -m
difftrain train ...`` work as well: every process reads RANK, WORLD_SIZE and
LOCAL_RANK from the environment they set.

Batches. ``train.batch_size`` is per process, as in the diffusers scripts and
sd-scripts: the global batch is ``batch_size x world``. The sampler cuts global
batches (one bucket each); process ``r`` takes an even slice of each, and the
random draws of a step (noise, timesteps, dropout) are made for the whole global
batch on every process from the shared seed and sliced the same way. Each
process's loss is scaled by ``world x local / global``, so the averaged gradient
is the gradient of the global batch's mean loss: N processes train exactly as one
process with the global batch would (up to float summation order). A global
batch with fewer items than processes (the tail of a small bucket) is skipped.

Platforms. NCCL on CUDA where it exists, gloo otherwise (CPU, Windows, macOS).
torch builds for Windows have no libuv, but torchrun's agent asks for a libuv TCP
store unless ``USE_LIBUV=0``: the launcher sets it there. DDP's gradient buckets
are given explicit caps, so that no bucket holds 2^31 elements or more (the
"negative dimension" error of a 2.57-billion-parameter SDXL full fine-tune on
gloo).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

#: the largest element count a 32-bit index holds
INT32_MAX = 2**31 - 1
#: how long a process waits at a collective for the others (validation and checkpoint writes run on one)
PG_TIMEOUT_MINUTES = int(os.environ.get("DIFFTRAIN_PG_TIMEOUT_MINUTES", "60"))


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world_from_env(env=os.environ) -> World:
    """RANK / WORLD_SIZE / LOCAL_RANK as torchrun (or accelerate) set them; one process otherwise."""
    size = int(env.get("WORLD_SIZE", "1") or 1)
    rank = int(env.get("RANK", "0") or 0)
    return World(rank=rank, size=size, local_rank=int(env.get("LOCAL_RANK", str(rank)) or 0))


def backend_for(device: torch.device) -> str:
    """nccl for CUDA where this torch has it, else gloo."""
    import torch.distributed as dist

    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    if not dist.is_gloo_available():
        from .errors import BackendUnavailable

        raise BackendUnavailable(
            "This torch build has neither NCCL (for CUDA) nor gloo: it cannot run several processes.",
            hint="Install an official torch build (they have gloo on every platform).",
        )
    return "gloo"


def has_libuv(platform: str = sys.platform) -> bool:
    """Whether torch's TCP store can use libuv here: torch builds for Windows have none."""
    return platform != "win32"


def launcher_env(env: dict, platform: str = sys.platform) -> dict:
    """The environment for torchrun's agent and its workers: USE_LIBUV=0 where torch has no libuv."""
    out = dict(env)
    if not has_libuv(platform):
        out.setdefault("USE_LIBUV", "0")
    return out


def init(world: World, device: torch.device) -> None:
    """Join the process group (once)."""
    import torch.distributed as dist

    if not world.distributed or dist.is_initialized():
        return
    import datetime

    backend = backend_for(device)
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    # the other processes wait at their next collective while the first one alone samples validation videos or
    # writes a full checkpoint: minutes, past NCCL's default 10-minute watchdog
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=PG_TIMEOUT_MINUTES), **kwargs)


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()


def shutdown(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def local_slice(n_global: int, world: World) -> slice:
    """Process ``rank``'s part of a global batch of ``n_global`` items: even slices, the first ones one larger."""
    base, extra = divmod(n_global, world.size)
    start = world.rank * base + min(world.rank, extra)
    return slice(start, start + base + (1 if world.rank < extra else 0))


def ddp_options(n_trainable: int, backend: str, bucket_cap_mb: float = 25.0, element_bytes: int = 4) -> dict:
    """DistributedDataParallel keyword arguments with every bucket under 2^31 elements.

    DDP sizes a bucket's flat gradient by its byte cap; a cap (or a single bucket
    holding everything, as when buckets are disabled) past 2^31 elements overflows
    the 32-bit size some backends use, and gloo on Windows fails with "Trying to
    create tensor with negative dimension". difftrain passes explicit caps: the
    default 25 MB, and never more than ``INT32_MAX`` elements.
    """
    cap_elements = bucket_cap_mb * 2**20 / element_bytes
    if cap_elements >= INT32_MAX:
        bucket_cap_mb = (INT32_MAX - 1) * element_bytes / 2**20 / 2  # well under the limit
    opts = {"bucket_cap_mb": bucket_cap_mb, "broadcast_buffers": False}
    if backend == "gloo" and n_trainable > INT32_MAX:
        # gloo all-reduces each bucket as one tensor: keep them small, and do not alias gradients to buckets
        opts.update(bucket_cap_mb=min(bucket_cap_mb, 25.0), gradient_as_bucket_view=False)
    return opts


#: the train command's launcher options, with whether each takes a value: removed from the workers' command line
LAUNCH_OPTIONS = {
    "--gpus": True,
    "--nodes": True,
    "--node-rank": True,
    "--master-addr": True,
    "--master-port": True,
    "--rdzv-endpoint": True,
}


def worker_argv(argv: list[str]) -> list[str]:
    """The command line every worker runs: the user's, without the launcher options."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in LAUNCH_OPTIONS:
            skip = "=" not in a and LAUNCH_OPTIONS[name]
            continue
        out.append(a)
    return out


def torchrun_args(
    nproc: int,
    argv: list[str],
    nodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """torchrun's arguments for ``python -m difftrain <argv>`` on ``nproc`` processes per node."""
    args = [f"--nproc-per-node={nproc}", f"--nnodes={nodes}"]
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=difftrain"]
    elif nodes > 1 or master_addr:
        args += [
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr or '127.0.0.1'}",
            f"--master-port={master_port or 29500}",
        ]
    else:
        args += ["--standalone"]  # one node: a free port, no address to give
    return args + ["--module", "difftrain", *argv]


def launch(nproc: int, argv: list[str], **where) -> None:
    """Run ``difftrain <argv>`` on ``nproc`` processes through torchrun's elastic agent; every worker's
    own error is printed by the worker (``rank N: error: ...``); a failure here names the ranks."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from .errors import DifftrainError

    env = launcher_env(dict(os.environ))
    os.environ.update(env)
    try:
        run(get_args_parser().parse_args(torchrun_args(nproc, worker_argv(argv), **where)))
    except ChildFailedError as e:
        ranks = sorted(e.failures)
        raise DifftrainError(
            f"{argv[0] if argv else 'the command'} failed in {len(ranks)} of the processes (global ranks {', '.join(map(str, ranks))}).",
            hint="Each process's own error is printed above it (rank N: error: ...).",
        ) from None
