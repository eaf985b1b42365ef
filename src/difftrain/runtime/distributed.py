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


def engine_problem(cfg: Any, processes: int) -> str | None:
    """What in ``cfg`` cannot train on ``processes`` processes under DDP, as a sentence (None: nothing). The config
    validator refuses these with ``memory.engine: ddp`` named; a plain config launched on several processes runs as
    DDP too, which is checked here: by the launcher before any process starts, and by each process (torchrun started
    directly)."""
    m = cfg.memory
    if processes < 2 or m.engine.kind not in ("auto", "single", "ddp"):  # auto: as DDP would run it
        return None
    if m.fused_backward:
        # found on 2 gloo processes: the run trained to its end and then stopped on "different weights"
        return (
            f"memory.fused_backward on {processes} processes: it steps each weight inside the backward pass, before "
            "DDP has averaged that weight's gradient over the processes, so their weights drift apart."
        )
    if m.optimizer.kind == "cpu_offload" and getattr(m.optimizer, "offload_gradients", False):
        return (
            f"memory.optimizer cpu_offload with offload_gradients on {processes} processes: each gradient leaves the "
            "GPU before DDP has averaged it over the processes."
        )
    return None


ENGINE_HINT = (
    "Set memory.fused_backward: false / memory.optimizer.offload_gradients: false (with a memory.optimizer whose "
    "state fits without it, e.g. adamw8bit), or memory.engine: {kind: deepspeed, stage: 2}, which shards the "
    "optimizer state over the processes instead; `difftrain plan --gpus N --vram XGiB` searches what fits."
)


def backend_for(device: torch.device) -> str:
    """nccl for CUDA where this torch has it, else gloo."""
    import torch.distributed as dist

    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    if not dist.is_gloo_available():
        from ..errors import BackendUnavailable

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
    timeout = datetime.timedelta(minutes=PG_TIMEOUT_MINUTES)
    store = attempt_store(world, timeout)
    if store is not None:
        kwargs.update(store=store, rank=world.rank, world_size=world.size)
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


def attempt_store(world: World, timeout, env=os.environ) -> Any:
    """The process group's store under torchrun's agent, with this attempt's own key prefix; None elsewhere.

    The agent keeps one store for the group across its restarts (its c10d rendezvous shares the store's server,
    TORCHELASTIC_USE_AGENT_STORE), and torch's env:// rendezvous puts the process group's keys in it without a
    prefix per attempt: a restarted group read the dead group's addresses (gloo: "connectFullMesh failed ...
    Connection refused", measured on torch 2.13 CPU) and failed every restart. Keys under
    ``difftrain/attempt_<TORCHELASTIC_RESTART_COUNT>`` keep each attempt's apart."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or "MASTER_ADDR" not in env:
        return None
    import torch.distributed as dist

    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world.size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"difftrain/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()


def broadcast_object(obj: Any, world: World) -> Any:
    """The first process's ``obj`` on every process (torch's pickled broadcast: objects difftrain made, between its
    own processes)."""
    if not world.distributed:
        return obj
    import torch.distributed as dist

    box = [obj if world.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    "--max-restarts": True,
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
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's arguments for ``python -m difftrain <argv>`` on ``nproc`` processes per node.

    Several machines meet at a c10d rendezvous (``--rdzv-endpoint``, or ``--master-addr:--master-port``), hosted by
    the machine with ``--node-rank 0``: with it, the agents of all machines restart the group together when a
    process dies on any of them (a static rendezvous restarts only the machine that lost it, and the others wait
    at their collective until it times out)."""
    args = [f"--nproc-per-node={nproc}", f"--nnodes={nodes}", f"--max-restarts={max_restarts}"]
    if nodes > 1 and not rdzv_endpoint:
        rdzv_endpoint = f"{master_addr or '127.0.0.1'}:{master_port or 29500}"
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=difftrain"]
        if nodes > 1:
            args += [f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}"]
    elif master_addr:
        args += [
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port or 29500}",
        ]
    else:
        args += ["--standalone"]  # one node: a free port, no address to give
    return args + ["--module", "difftrain", *argv]


def failure_cause(exitcode: int, message: str = "") -> str:
    """What ended a process, in words: a signal by name (SIGKILL: the out-of-memory killer or a kill -9), or its
    exit code."""
    import signal

    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = {
            "SIGKILL": " (the out-of-memory killer, or kill -9)",
            "SIGSEGV": " (a crash in native code)",
            "SIGABRT": " (aborted: often a CUDA or NCCL error)",
        }
        return f"killed by {name}{why.get(name, '')}"
    return f"exit code {exitcode}" + (f": {message}" if message and not message.startswith("To enable") else "")


#: what gloo and NCCL say when another process of the group died
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "remote process exited",
    "Broken pipe",
)
#: what a failure of the group's communication says (NCCL's watchdog, a store or rendezvous that timed out)
COMM_FAILED = ("NCCL", "ProcessGroup", "timed out", "Timeout", "watchdog", "rendezvous")


def restart_may_help(e: BaseException) -> bool:
    """Whether a restart of the group could get past ``e``: a lost process or a failure of the group's
    communication (a torch.distributed error, or one whose message names the peers or NCCL), or a CUDA error (a
    GPU fault may not repeat). Any other exception raised by the training code before its first step (a shape that
    does not match, a library's own bug) meets the same inputs again after a restart."""
    import torch.distributed as tdist

    if isinstance(e, getattr(tdist, "DistError", ())):
        return True
    text = str(e)
    return any(m in text for m in PEER_LOST + COMM_FAILED) or "CUDA error" in text


def launch(nproc: int, argv: list[str], failure_note=None, **where) -> None:
    """Run ``difftrain <argv>`` on ``nproc`` processes through torchrun's elastic agent (``max_restarts`` restarts
    of the group after a process dies); every worker's own error is printed by the worker (``rank N: error:
    ...``); a failure here, the restarts used up, names each failed rank and what ended it. ``failure_note``: the
    file a worker leaves when it ended with a user error (see ``trainers.run_folder.note_failure``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from ..errors import DifftrainError
    from ..utils import read_json_object

    env = launcher_env(dict(os.environ))
    os.environ.update(env)
    try:
        run(get_args_parser().parse_args(torchrun_args(nproc, worker_argv(argv), **where)))
    except ChildFailedError as e:
        ranks = sorted(e.failures)
        causes = "; ".join(
            f"rank {r}: {failure_cause(e.failures[r].exitcode, str(e.failures[r].message))}" for r in ranks
        )
        restarts = where.get("max_restarts", 0)
        after = f", after {restarts} restart{'s' if restarts != 1 else ''} of the group" if restarts else ""
        note = read_json_object(failure_note) if failure_note is not None else {}
        tail = ""
        if note and restarts:  # a user error: each restart ended at once with it, nothing was loaded again
            after, tail = "", ": an error a restart would meet again, so the group's restarts ended at once"
        hint = "Each process's own error is printed above it (rank N: error: ...)."
        if note:
            hint = f"The error: {note.get('message', '?')}" + (f"\n{note['hint']}" if note.get("hint") else "")
        raise DifftrainError(
            f"{argv[0] if argv else 'the command'} failed in {len(ranks)} of the processes{after} ({causes}){tail}.",
            hint=hint,
        ) from None
