"""One training step under torch.profiler on every rank, asked for by the environment (a developer's tool for
multi-GPU runs, where ``difftrain bench --profile`` does not reach: it trains one process).

    DIFFTRAIN_PROFILE_DIR=/tmp/prof DIFFTRAIN_PROFILE_STEP=6 difftrain train --gpus 2 ...

writes ``profile.rank<r>.txt`` (operators by self CPU time, then by self GPU time) and ``profile.rank<r>.json``
(the step's wall time, GPU busy time by kind: communication, compute, copies) into the folder.

With ``DIFFTRAIN_PROFILE_PYTHON=1`` the step is profiled by cProfile instead (the host's Python: hooks, the engine's
bookkeeping, where the host waits): ``profile.rank<r>.txt`` then holds the functions by own time and by cumulative
time, and the JSON the step's wall time (step 1: from the trainer's start, loading included).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

#: GPU kernels that move data between ranks (NCCL's collectives) or between host and GPU
COMM = ("nccl",)
COPIES = ("memcpy", "memset")
#: the profiler's rows of kernel launches from the host (runtime and driver calls), counted alike here and by bench
LAUNCH_KEYS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def python_wanted() -> bool:
    return os.environ.get("DIFFTRAIN_PROFILE_PYTHON", "") == "1"


def wanted() -> tuple[Path, int] | None:
    d = os.environ.get("DIFFTRAIN_PROFILE_DIR")
    return (Path(d), int(os.environ.get("DIFFTRAIN_PROFILE_STEP", "6"))) if d else None


class StepProfiler:
    """Profiles optimizer step ``step`` (1-based), the GPU synchronised at its edges; writes on leaving it."""

    def __init__(self, folder: Path, step: int, rank: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.folder, self.step, self.rank, self.seen = folder, step, rank, 0
        self.t0 = 0.0
        self.wall = 0.0
        self.python: Any = None
        if python_wanted():  # cProfile over the step alone, started when the step before it ends
            import cProfile

            self.python = cProfile.Profile()
            if step == 1:
                self.python.enable()
            return
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # wait until the step before the profiled one is done, warm the profiler up on it, record the next
        self.prof = profile(activities=acts, schedule=schedule(wait=max(step - 2, 0), warmup=1, active=1))
        self.prof.start()

    def after_step(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seen += 1
        if self.seen == self.step - 1:
            self.t0 = time.perf_counter()
        if self.seen == self.step:
            self.wall = time.perf_counter() - self.t0
        if self.python is not None:
            if self.seen == self.step - 1:
                self.python.enable()
            elif self.seen == self.step:
                self.python.disable()
                self.write_python()
            return
        self.prof.step()
        if self.seen == self.step:
            self.prof.stop()
            self.write()

    def write_python(self) -> None:
        import io
        import pstats

        self.folder.mkdir(parents=True, exist_ok=True)
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            text.write(f"===== by {key}\n")
            pstats.Stats(self.python, stream=text).sort_stats(key).print_stats(45)
        (self.folder / f"profile.rank{self.rank}.txt").write_text(text.getvalue())
        out = {"rank": self.rank, "step": self.step, "wall_ms": round(self.wall * 1e3, 1), "python": True}
        (self.folder / f"profile.rank{self.rank}.json").write_text(json.dumps(out, indent=1))

    def write(self) -> None:
        from torch.autograd import DeviceType

        ev = self.prof.key_averages()
        self.folder.mkdir(parents=True, exist_ok=True)
        text = ev.table(sort_by="self_cpu_time_total", row_limit=40)
        if torch.cuda.is_available():
            text += "\n\n" + ev.table(sort_by="self_device_time_total", row_limit=40)
        (self.folder / f"profile.rank{self.rank}.txt").write_text(text)
        kinds: dict[str, float] = {"communication": 0.0, "copies": 0.0, "compute": 0.0}
        for e in ev:
            if e.device_type != DeviceType.CUDA or e.key.startswith(("ProfilerStep", "## ")):
                continue
            low = e.key.lower()
            kind = (
                "communication"
                if any(m in low for m in COMM)
                else "copies"
                if any(m in low for m in COPIES)
                else "compute"
            )
            kinds[kind] += e.self_device_time_total / 1e3
        launches = sum(e.count for e in ev if e.key in LAUNCH_KEYS)
        out: dict[str, Any] = {
            "rank": self.rank,
            "step": self.step,
            "wall_ms": round(self.wall * 1e3, 1),
            "gpu_ms": {k: round(v, 1) for k, v in kinds.items()},
            "kernel_launches": launches,
            "cpu_ops": len(ev),
        }
        (self.folder / f"profile.rank{self.rank}.json").write_text(json.dumps(out, indent=1))
