"""Step numbers read back from the device in batches: losses, gradient norms, the input check, the stop flag.

Between two flushes nothing in the loop waits for the GPU, so the host queues the next steps while it computes.
A flush reads the pending steps' numbers in one transfer (one all-reduce across processes), checks them
(:class:`~difftrain.trainers.guards.Guards`), logs them and moves the progress bar. The next flush is set a
whole number of steps ahead (``speed.sync_seconds`` at the measured step time, as the first process measured
it), so all processes flush at the same steps.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.schema import Config
from ..runtime import distributed as dist_
from .guards import Guards


def rss_peak_gib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU"
    return f"{rss_peak_gib():.2f} GiB RSS"


@dataclass
class Pending:
    """One optimizer step's numbers, still on the device."""

    step: int
    epoch: int
    loss: Any  # a device tensor, or a float
    grad_norm: Any  # None where none was computed
    prior_loss: Any  # None without prior preservation
    inputs_finite: Any  # a device flag
    lr: Any  # torchao keeps it as a tensor


@dataclass
class Sink:
    """Where flushed numbers go: the metric sinks, the result's loss list, the progress bar."""

    metrics: Any
    losses: list[float]
    bar: Any
    task: Any
    t0: float


@dataclass
class Readback:
    cfg: Config
    world: dist_.World
    device: torch.device
    guards: Guards
    total_steps: int
    flush_times: dict[int, float] = field(default_factory=dict)  # step -> time its numbers were back on the host
    pending: list[Pending] = field(default_factory=list)
    flush_at: int = 0
    last_flush: tuple[float, int] = (0.0, 0)

    def start(self, step: int) -> None:
        self.pending = []
        self.flush_at, self.last_flush = step + 1, (time.time(), step)
        self.flush_times[step] = self.last_flush[0]

    def _every(self, step: int, now: float) -> int:
        """Steps until the next flush, from this process's measured step time (the first process's is used)."""
        if not self.cfg.speed.sync_seconds:
            return 1
        t_last, step_last = self.last_flush
        per_step = (now - t_last) / max(1, step - step_last)
        return max(1, min(1000, int(self.cfg.speed.sync_seconds / max(per_step, 1e-6))))

    def _transfer(self, pend: list[Pending], every: int) -> list[float]:
        """The pending numbers, the stop flag and the flush interval in one tensor, summed over the processes."""
        row = [
            (1.0 if k == "inputs_finite" else float("nan")) if getattr(pe, k) is None else getattr(pe, k)
            for pe in pend
            for k in ("loss", "grad_norm", "prior_loss", "inputs_finite")
        ]
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        flat = (
            torch.stack([torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(()) for x in row])
            if row
            else torch.zeros(0, dtype=torch.float64, device=dev)
        )
        stop_local = 1.0 if self.guards.interrupt else 0.0
        extra = torch.tensor([stop_local, every if self.world.main else 0], dtype=torch.float64, device=dev)
        flat = torch.cat([flat, extra])
        if self.world.distributed:
            import torch.distributed as dist

            dist.all_reduce(flat)
        return flat.tolist()

    def flush(self, step: int, sink: Sink) -> bool:
        """Read, check and log the pending steps; returns whether any process asked to stop."""
        pend, self.pending = self.pending, []
        now = time.time()
        values = self._transfer(pend, self._every(step, now))
        stop, every = values[-2] > 0, int(values[-1])
        n = self.world.size
        self.flush_at, self.last_flush = step + every, (time.time(), step)
        self.flush_times[step] = self.last_flush[0]
        g = self.guards
        for i, pe in enumerate(pend):
            loss, gnorm, prior, inputs_ok = values[i * 4 : (i + 1) * 4]
            # the processes' scaled shares sum to the global batch's mean; the gradient norm is the same on each
            loss, prior, gnorm = loss / n, prior / n, gnorm / n
            # a step skip mode dropped is not checked; one the fp16 scaler skipped has an overflowing norm by design
            norm_ok = pe.grad_norm is None or math.isfinite(gnorm) or pe.step in g.scaler_skipped
            if not g.unchecked(pe.step) and not (math.isfinite(loss) and norm_ok):
                g.diverged(pe.step, loss, gnorm, inputs_ok >= n)
            sink.losses.append(loss)
            if pe.step % self.cfg.train.log_every == 0 or pe.step == self.total_steps:
                sink.metrics.log(self._record(pe, loss, gnorm, prior, now - sink.t0))
        if pend:
            sink.bar.update(sink.task, completed=step, loss=sink.losses[-1], mem=peak_memory(self.device))
        return stop

    def _record(self, pe: Pending, loss: float, gnorm: float, prior: float, elapsed: float) -> dict:
        rec = {"step": pe.step, "epoch": pe.epoch, "loss": loss, "lr": float(pe.lr), "time": round(elapsed, 4)}
        if pe.grad_norm is not None:
            rec["grad_norm"] = gnorm
        if pe.prior_loss is not None:
            rec["prior_loss"] = prior
        if pe.step in self.guards.skipped or pe.step in self.guards.scaler_skipped:
            rec["skipped"] = True
        if self.device.type == "cuda":
            rec["gpu_peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
        return rec
