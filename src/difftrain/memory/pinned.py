"""Pinned host memory under a cap: block swap's host copies and the CPU-offload optimizer's host buffers.

Pinned (page-locked) memory lets a copy to or from the GPU run on a side stream, overlapped with compute. An OS
may limit it: Windows under WDDM lets a process pin only part of the RAM, and there a large block swap or CPU
optimizer fails when its buffers are pinned. With ``memory.pinned_limit_gib`` set, the buffers are pinned while
the cap lasts and the rest are ordinary pageable memory (correct, but their copies wait instead of overlapping);
a pin the driver refuses falls back the same way. Either way it is said once.

The budget is per process (one trainer): ``configure`` sets it before the techniques are applied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..console import warn

GIB = 2**30


def _pin_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="cpu", pin_memory=True)


class PinnedBudget:
    def __init__(self, limit_gib: float | None, pin: Callable[[torch.Tensor], torch.Tensor] = _pin_like):
        """``pin``: how a pinned buffer is made (tests on CPU pass a stand-in)."""
        self.limit = None if limit_gib is None else int(limit_gib * GIB)
        self.pin = pin
        self.pinned_bytes = 0
        self.pageable_bytes = 0
        self.warnings: list[str] = []

    def _fallback(self, why: str) -> None:
        if not self.warnings:  # once a process
            msg = (
                f"{why}: the remaining host copies of block swap and the CPU-offload optimizer use pageable memory "
                "(correct, but their copies to the GPU wait instead of overlapping the compute)."
            )
            self.warnings.append(msg)
            warn(msg)

    def empty_like(self, t: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        """An uninitialised host tensor like ``t``: pinned (when asked: a CUDA run) while the cap lasts, else
        pageable."""
        nbytes = t.numel() * t.element_size()
        if pinned:
            if self.limit is not None and self.pinned_bytes + nbytes > self.limit:
                self._fallback(f"pinned host memory reached memory.pinned_limit_gib ({self.limit / GIB:g} GiB)")
            else:
                try:
                    out = self.pin(t)
                except RuntimeError as e:  # the driver refused (WDDM's limit, or the RAM is gone)
                    self._fallback(
                        f"the driver refused to pin {nbytes / 2**20:.0f} MiB more ({str(e).splitlines()[0]})"
                    )
                else:
                    self.pinned_bytes += nbytes
                    return out
        self.pageable_bytes += nbytes
        return torch.empty_like(t, device="cpu")


_budget = PinnedBudget(None)


def configure(limit_gib: float | None, pin: Callable[[torch.Tensor], torch.Tensor] = _pin_like) -> None:
    """A fresh budget for this process's run (memory.pinned_limit_gib)."""
    global _budget
    _budget = PinnedBudget(limit_gib, pin)


def budget() -> PinnedBudget:
    return _budget


def host_like(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host copy of ``t`` from the process's budget (``pinned``: wanted pinned, for a CUDA run)."""
    return _budget.empty_like(t, pinned).copy_(t.detach())


class _TorchInModule:
    """``torch`` as a module that pins through the budget sees it: only ``empty_like(..., pin_memory=True)`` differs."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty_like(t: torch.Tensor, *args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        if pin_memory and kwargs.get("device", "cpu") in ("cpu", torch.device("cpu")) and not args:
            return _budget.empty_like(t)
        return torch.empty_like(t, *args, pin_memory=pin_memory, **kwargs)


@contextlib.contextmanager
def pinning_through_budget(module: Any) -> Iterator[None]:
    """While a library's ``module`` builds its buffers, its ``torch.empty_like(pin_memory=True)`` goes through the
    budget. Why: torchao's CPUOffloadOptimizer pins every host buffer unconditionally and has no option for a cap
    (torchao 0.18); this touches that one module's name ``torch`` for the duration of the constructor only."""
    saved = module.torch
    module.torch = _TorchInModule()
    try:
        yield
    finally:
        module.torch = saved
