"""Pinned host memory under a cap: block swap's host copies, the CPU-offload optimizer's host buffers and the offloaded
checkpoints' arena (activation_offload.py, which pins its own slabs and takes their bytes from the budget: ``take``).

Pinned (page-locked) memory lets a copy to or from the GPU run on a side stream, overlapped with compute. An OS
may limit it: Windows under WDDM lets a process pin only part of the RAM, and there a large block swap or CPU
optimizer fails when its buffers are pinned. With ``memory.pinned_limit_gib`` set, the buffers are pinned while
the cap lasts and the rest are ordinary pageable memory (correct, but their copies wait instead of overlapping);
a pin the driver refuses falls back the same way. Either way it is said once.

Packing: torch's pinned allocator rounds every buffer up to a power of two (a 75 MB CogVideoX weight takes
128 MiB; SDXL's 87 block-swap units took 6.15 GiB for 4.68 of weights on the H100). The budget pins slabs of
256 MiB (a larger power of two for a larger tensor) and hands out aligned views into them, so the waste is the
free tail of the slabs (first fit fills it), not up to half of every buffer. We pack ourselves because neither
torch (its ``pinned_reserve_segment_size_mb`` serves small blocks only) nor torchao's CPU-offload optimizer
(one ``empty_like`` per tensor) offers it.

The budget is per process (one trainer): ``configure`` sets it before the techniques are applied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..console import warn

GIB = 2**30


SLAB = 256 * 2**20  # bytes a slab holds at least: a tensor larger than a quarter of it gets a slab of its own size
ALIGN = 512  # every view starts on this boundary (any dtype; the copy engines like aligned rows)


def _pin_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class PinnedBudget:
    def __init__(self, limit_gib: float | None, pin: Callable[[int], torch.Tensor] = _pin_bytes):
        """``pin``: makes a pinned uint8 buffer of so many bytes (tests on CPU pass a stand-in)."""
        self.limit = None if limit_gib is None else int(limit_gib * GIB)
        self.pin = pin
        self.pinned_bytes = 0  # what the slabs pin (the views in them take less: ``used_bytes``)
        self.taken_bytes = 0  # what others pin against the cap: the offloaded checkpoints' arena (``take``)
        self.used_bytes = 0
        self.pageable_bytes = 0
        self.warnings: list[str] = []
        self.slabs: list[list] = []  # [buffer, bytes used]

    def _fallback(self, why: str) -> None:
        if not self.warnings:  # once a process
            msg = (
                f"{why}: the remaining host copies of block swap, the CPU-offload optimizer and the offloaded "
                "checkpoints use pageable memory (correct, but their copies to the GPU wait instead of overlapping "
                "the compute)."
            )
            self.warnings.append(msg)
            warn(msg)

    def _new_slab(self, nbytes: int) -> list | None:
        size = max(SLAB, _pow2(nbytes))
        if self.limit is not None:
            room = self.limit - self.pinned_bytes - self.taken_bytes
            while size > nbytes and size > room:  # a smaller power of two that still holds the tensor
                size //= 2
            if size < nbytes or size > room:
                self._capped()
                return None
        try:
            buf = self.pin(size)
        except RuntimeError as e:  # the driver refused (WDDM's limit, or the RAM is gone)
            self._fallback(f"the driver refused to pin {size / 2**20:.0f} MiB more ({str(e).splitlines()[0]})")
            return None
        self.pinned_bytes += size
        slab = [buf, 0]
        self.slabs.append(slab)
        return slab

    def _capped(self) -> None:
        assert self.limit is not None
        self._fallback(f"pinned host memory reached memory.pinned_limit_gib ({self.limit / GIB:g} GiB)")

    def take(self, nbytes: int) -> bool:
        """Whether ``nbytes`` that the caller pins itself fit under the cap; if so they count until ``give_back``.
        If not, the caller uses pageable memory (said once, as for the budget's own slabs)."""
        if self.limit is not None and self.pinned_bytes + self.taken_bytes + nbytes > self.limit:
            self._capped()
            return False
        self.taken_bytes += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        """Bytes ``take`` counted, unpinned by their owner."""
        self.taken_bytes -= nbytes

    def _carve(self, t: torch.Tensor, nbytes: int) -> torch.Tensor | None:
        slab = next((s for s in self.slabs if s[1] + nbytes <= s[0].numel()), None) or self._new_slab(nbytes)
        if slab is None:
            return None
        buf, start = slab
        slab[1] = start + nbytes + (-nbytes % ALIGN)
        self.used_bytes += nbytes
        flat = buf[start : start + nbytes].view(t.dtype)
        if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
            return flat.as_strided(t.shape, t.stride())  # keep a channels-last weight channels-last
        return flat.view(t.shape)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in one of this budget's slabs (a copy the streaming load already made)."""
        p = t.data_ptr()
        return t.device.type == "cpu" and any(b.data_ptr() <= p < b.data_ptr() + b.numel() for b, _ in self.slabs)

    def empty_like(self, t: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        """An uninitialised host tensor like ``t``: a view into a pinned slab (when asked: a CUDA run) while the cap
        lasts, else pageable memory of its own."""
        nbytes = t.numel() * t.element_size()
        if pinned and nbytes:
            out = self._carve(t, nbytes)
            if out is not None:
                return out
        self.pageable_bytes += nbytes
        return torch.empty_like(t, device="cpu")


_budget = PinnedBudget(None)


def configure(limit_gib: float | None, pin: Callable[[int], torch.Tensor] = _pin_bytes) -> None:
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
