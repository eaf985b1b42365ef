"""What stops a run or drops a step: non-finite losses and gradients, Ctrl+C, replicas that drifted apart.

A NaN/inf loss stops the run with the step, the likely cause and the last good checkpoint
(``train.nonfinite: stop``), or drops that step's update (``skip``, at most five in a row). The first Ctrl+C asks
the loop to stop after the step under way, with a checkpoint; a second one stops at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import torch

from ..config.schema import Config
from ..console import warn
from ..errors import DifftrainError, LossNotFinite
from ..runtime import distributed as dist_
from . import checkpoint as ckpt

#: train.nonfinite skip: this many dropped updates in a row stop the run
MAX_SKIPPED_IN_A_ROW = 5


class Guards:
    """The run's stop flag and its record of dropped steps."""

    def __init__(self, cfg: Config, out: Path, world: dist_.World) -> None:
        self.cfg, self.out, self.world = cfg, out, world
        self.interrupt = False  # Ctrl+C: stop after this step
        self.nonfinite_skipped = 0  # train.nonfinite skip: steps whose update was dropped
        self.skipped: set[int] = set()  # ... which ones
        self.skipped_run = 0  # ... how many in a row, up to now
        self.fp16_skipped = 0  # steps the fp16 grad scaler skipped (an overflow; it then lowers its scale)
        self.scaler_skipped: set[int] = set()  # ... which ones
        self.inputs_finite: torch.Tensor | None = None  # the last step's batches held only finite numbers

    def diverged(self, step: int, loss: float, gnorm: float, inputs_ok: bool, prefix: str = "") -> NoReturn:
        """Stop the run at a NaN/inf loss or gradient norm: the step, the likely cause, the last good checkpoint."""
        t = self.cfg.train
        what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {gnorm}"
        if not inputs_ok:
            cause = (
                "that step's batch holds NaN/inf in its cached latents or text embeddings: a damaged or stale cache, "
                "or latents encoded by a VAE in fp16 (SDXL's overflows)"
            )
            fix = "Run `difftrain precompute` again (precompute.vae_dtype fp32 or bf16) into a fresh data.cache_dir."
        elif t.mixed_precision == "fp16" or self.cfg.memory.weights.kind == "fp16":
            cause = "fp16 overflowed (its largest number is 65504)"
            fix = "Use train.mixed_precision bf16 with memory.weights bf16."
        else:
            cause = f"the learning rate ({t.learning_rate:g}) may be too high for this run"
            fix = (
                "Lower train.learning_rate"
                + ("" if t.max_grad_norm else " or set train.max_grad_norm (e.g. 1.0)")
                + "; train.nonfinite: skip drops such steps instead of stopping."
            )
        good = [c for c in ckpt.list_checkpoints(self.out) if int(c.name.rsplit("-", 1)[-1]) < step]
        where = (
            f"The last good checkpoint is {good[-1]} (--resume it)." if good else "No checkpoint was saved before it."
        )
        raise LossNotFinite(f"{prefix}At step {step} {what}: {cause}. {where}", hint=fix)

    def unchecked(self, step: int) -> bool:
        """A step whose update skip mode dropped: its numbers are logged, not checked."""
        return step in self.skipped

    def skip(self, step: int, loss: float, norm: float) -> bool:
        """train.nonfinite skip: record that ``step``'s update is dropped (weights and optimizer state unchanged);
        True when that makes too many in a row (the caller then stops the run with :meth:`diverged`)."""
        self.nonfinite_skipped += 1
        self.skipped_run += 1
        self.skipped.add(step)
        warn(f"step {step}: loss {loss}, gradient norm {norm}: the update is skipped ({self.nonfinite_skipped} so far)")
        return self.skipped_run >= MAX_SKIPPED_IN_A_ROW

    def stepped(self, step: int, scaler_skipped: bool) -> None:
        """An update was applied at ``step`` (``scaler_skipped``: the fp16 scaler found an overflow and skipped it)."""
        self.skipped_run = 0
        if scaler_skipped:
            self.fp16_skipped += 1
            self.scaler_skipped.add(step)

    @contextmanager
    def ctrl_c(self) -> Iterator[None]:
        """The first Ctrl+C (SIGINT) asks the loop to stop after the step under way, with a checkpoint: a save
        in progress completes first. A second one stops at once (the last complete checkpoint stays)."""
        import signal
        import threading

        self.interrupt = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            self.interrupt = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if self.world.main:
                warn(
                    "Ctrl+C: stopping after this step with a checkpoint (press it again to stop at once, "
                    "without saving)"
                )

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def check_replicas(params: Sequence[torch.Tensor], world: dist_.World, device: torch.device) -> None:
    """Several DDP processes must end with the same weights, bit for bit: compare checksums, and stop
    with the reason if they drifted apart (a nondeterministic kernel, a rank that skipped a step)."""
    import torch.distributed as dist

    from ..console import info

    dev = device if device.type == "cuda" else torch.device("cpu")
    mine = torch.zeros(2, dtype=torch.float64, device=dev)
    for p in params:
        d = p.detach().to(dev, torch.float64)
        mine[0] += d.sum()
        mine[1] += (d * d).sum()
    every = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine)
    if any(not torch.equal(every[0], e) for e in every[1:]):
        raise DifftrainError(
            f"The {world.size} processes ended with different weights (checksums "
            f"{[tuple(round(x, 6) for x in e.tolist()) for e in every]}).",
            hint="Report it with the config; a run on one process is unaffected.",
        )
    info(f"the {world.size} processes' trained weights agree (checksum {every[0][0].item():.6f})")
