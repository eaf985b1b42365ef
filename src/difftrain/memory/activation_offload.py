"""Checkpointing with the checkpoints in host RAM (memory.activations: {kind: checkpoint, offload: true}).

Gradient checkpointing keeps one tensor per block alive until backward: the block's input hidden states. For a
video DiT at its training size they are most of the activations (Wan2.1-14B, 81 frames of 480x832: 32 760 tokens
x 5 120 x 2 bytes = 0.31 GiB a block, 12.5 GiB for its 40 blocks). Here each checkpointed block's large inputs go
to pinned host memory as the forward passes it and come back when backward reaches it; the block runs without
autograd in the forward and again with it in the backward, as checkpointing does. What diffusion-pipe calls
"unsloth" checkpointing and OneTrainer "CPU offloaded" checkpointing.

Why our own: torch's non-reentrant checkpoint keeps the block's inputs by reference (its recompute closure), so
``torch.autograd.graph.save_on_cpu`` around it moves nothing, and neither diffusers nor accelerate offers an
offloaded checkpoint. The copies run on the compute stream: in order with the kernels around them, so a tensor
is on the host before its GPU memory is reused, and back before the recompute reads it (a block's compute at
these sizes takes far longer than its input's copy: 0.31 GiB at ~25 GB/s is 13 ms).

Used as diffusers' ``gradient_checkpointing_func`` (``ModelMixin.enable_gradient_checkpointing``): the model
calls ``func(block, *args)`` for each checkpointed block.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..console import warn
from . import pinned
from .pinned import ALIGN  # every host copy starts on the boundary block swap's pinned slabs use

#: inputs smaller than this stay where they are (the timestep embedding is small)
MIN_OFFLOAD_BYTES = 1 << 20


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _pin_exact(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """``nbytes`` of page-locked host memory and how to give it back. torch's pinned allocator rounds every buffer up
    to a power of two (a 14B block's 320 MiB input would take 512 MiB: 20 GiB for 40 blocks where 12.5 are used), and
    keeps what is freed for reuse; so on Linux the slab is an anonymous mapping of its own pages (no other allocation
    shares a page the registration covers: the driver refuses a range that overlaps a registered one), registered
    with the driver, exactly its size. The returned ``free`` unregisters it; the pages go back to the system when the
    last tensor viewing them is gone (so they are never unmapped while registered). Elsewhere (Windows limits what a
    process may pin; pinned.py) and where registering fails, torch's pinned allocator (rounded) is used."""
    if sys.platform == "linux":
        import mmap

        buf = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]  # keeps the mapping alive
        err: int | None
        try:
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0))
        except (AttributeError, RuntimeError, AssertionError):  # no binding in this build: torch's allocator
            err = None
        if err == 0:
            ptr = buf.data_ptr()
            return buf, lambda: cudart.cudaHostUnregister(ptr)
        if err is not None:
            _clear_cuda_error()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), lambda: None


def _clear_cuda_error() -> None:
    """A refused cudaHostRegister leaves its error as the runtime's last one, which torch would report at its next
    kernel launch: read it once so it is cleared (best effort, through the libcudart torch loaded)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        with open("/proc/self/maps") as f:
            path = next((ln.split()[-1] for ln in f if "libcudart.so" in ln), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()


class HostArena:
    """Host memory for the offloaded checkpoints, reused step after step.

    The forward takes copies in order (views into slabs); when the last of them is released (each block's backward
    drops its own), the arena starts over at the first slab. A round that needed more than one slab is followed by
    one slab of the whole round's size, made at the next round's first copy (after the GPU finished reading the old
    ones), so a steady run holds one slab of exactly the most a step offloaded. A tensor given to several blocks in
    one round (Wan's rotary tables and text) is copied once. ``pin`` makes a slab (tests on CPU pass a stand-in).
    The slabs count against memory.pinned_limit_gib (the process's ``pinned.budget()``, shared with block swap and
    the CPU-offload optimizer): past it a slab is pageable memory, said once.
    """

    def __init__(self, pin: Callable[[int], tuple[torch.Tensor, Callable[[], None]]] = _pin_exact) -> None:
        self.pin = pin
        self.slabs: list[tuple[torch.Tensor, Callable[[], None]]] = []
        self.slab = 0  # the slab copies are taken from, and where in it
        self.offset = 0
        self.used = 0  # bytes taken this round, and the most a round took
        self.high = 0
        self.live = 0  # copies not yet released
        self.regroup = False
        self.shared: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self.lock = threading.Lock()  # backward (which releases) runs on autograd's thread

    @property
    def held_bytes(self) -> int:
        return sum(int(b.numel()) for b, _ in self.slabs)

    def store(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (copied on the current stream, not waited for)."""
        with self.lock:
            hit = self.shared.get(id(t))
            if hit is not None:
                src, version, held = hit
                host = held()
                if src() is t and t._version == version and host is not None:
                    return host
            if self.regroup:
                self._regroup()
            n = t.numel() * t.element_size()
            raw = self._take(n)
            self.live += 1
        host = raw[:n].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        weakref.finalize(host, self._release)
        with self.lock:
            self.shared[id(t)] = (weakref.ref(t), t._version, weakref.ref(host))
        return host

    def _take(self, n: int) -> torch.Tensor:
        a = _align(n)
        while self.slab < len(self.slabs):
            buf = self.slabs[self.slab][0]
            if self.offset + a <= buf.numel():
                view = buf[self.offset : self.offset + a]
                self.offset += a
                self.used += a
                return view
            self.slab, self.offset = self.slab + 1, 0
        if self.slabs:
            self.regroup = True  # this round outgrew the slabs: one slab of its size next round
        size = max(a, self.high - self.used) if not self.slabs else a
        self.slabs.append(self._new_slab(size))
        self.slab, self.offset = len(self.slabs) - 1, a
        self.used += a
        return self.slabs[-1][0][:a]

    def _new_slab(self, size: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A slab pinned while the process's pinned budget has room (its bytes given back when it is freed), else
        pageable (correct; its copies wait). Elsewhere than Linux torch's allocator pins it, rounded up to a power
        of two: that is what it counts."""
        budget = pinned.budget()
        cost = size if sys.platform == "linux" else pinned._pow2(size)
        if not budget.take(cost):
            return torch.empty(size, dtype=torch.uint8), lambda: None
        try:
            buf, free = self.pin(size)
        except BaseException:
            budget.give_back(cost)
            raise

        def unpin() -> None:
            free()
            budget.give_back(cost)

        return buf, unpin

    def _release(self) -> None:
        with self.lock:
            self.live -= 1
            if self.live == 0:
                self.high = max(self.high, self.used)
                self.slab = self.offset = self.used = 0
                self.shared.clear()

    def _regroup(self) -> None:
        """The previous round's slabs replaced by one of its size (nothing of theirs is live: a new round)."""
        if self.live or self.slab or self.offset:
            return  # only at a round's first copy
        self._free_slabs()
        self.regroup = False

    def _free_slabs(self) -> None:
        if self.slabs and torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies out of the slabs are done before they are unregistered
        slabs, self.slabs = self.slabs, []
        for _, free in slabs:
            free()

    def close(self) -> None:
        """Every slab given back (unregistered before its memory can be freed: a registration left on freed memory
        makes the driver refuse, or misdirect, the next registration of those addresses). Copies still held stay
        readable, as ordinary memory."""
        with self.lock:
            self._free_slabs()
            self.slab = self.offset = self.used = 0
            self.shared.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the driver may be gone already
            self.close()


_ARENA: HostArena | None = None


def arena() -> HostArena:
    global _ARENA
    if _ARENA is None:
        _ARENA = HostArena()
    return _ARENA


def reset_arena() -> None:
    """The process's arena closed (its slabs unregistered) and a fresh one made at the next offload."""
    global _ARENA
    if _ARENA is not None:
        _ARENA.close()
    _ARENA = None


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    try:
        return arena().store(t)
    except RuntimeError as e:  # the driver refused: pageable memory (correct, the copies wait); said once
        if not _REFUSED:
            _REFUSED.append(str(e).splitlines()[0])
            warn(f"memory.activations.offload: host memory could not be pinned ({_REFUSED[0]}): pageable copies")
        return t.to("cpu")


_REFUSED: list[str] = []  # the first refusal to pin, once said


class _Offloaded(torch.autograd.Function):
    """forward(ctx, block, spec, dummy, *tensors): ``tensors`` are the block's tensor arguments, ``spec`` how to
    put the call back together; ``dummy`` requires grad, so backward runs even when no input does (a LoRA
    block's input comes from frozen layers: its trainable parameters are not inputs of this function)."""

    @staticmethod
    def forward(ctx, block, spec, dummy, *tensors):
        ctx.block, ctx.spec = block, spec
        ctx.devices = [t.device for t in tensors]
        ctx.grads = [t.requires_grad for t in tensors]
        keep = id(block) in _KEPT
        ctx.stored = [
            _to_host(t)
            if not keep and t.is_floating_point() and t.numel() * t.element_size() >= MIN_OFFLOAD_BYTES
            else t
            for t in tensors
        ]
        with torch.no_grad():
            return block(*_rebuild(spec, tensors))

    @staticmethod
    def backward(ctx, *grads):
        inputs = [
            s.to(d, non_blocking=True).detach().requires_grad_(g) for s, d, g in zip(ctx.stored, ctx.devices, ctx.grads)
        ]
        ctx.stored = None
        with torch.enable_grad():
            out = ctx.block(*_rebuild(ctx.spec, inputs))
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [
            (o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[i.grad if i.requires_grad else None for i in inputs])


def _flatten(args: tuple) -> tuple[list[torch.Tensor], Any]:
    """The tensors of ``args`` (nested in tuples and lists one level down too: rotary tables) and how to put
    ``args`` back together from them."""
    tensors: list[torch.Tensor] = []
    spec: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            spec.append(("t", len(tensors)))
            tensors.append(a)
        elif isinstance(a, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in a):
            inner = []
            for x in a:
                if isinstance(x, torch.Tensor):
                    inner.append(("t", len(tensors)))
                    tensors.append(x)
                else:
                    inner.append(("v", x))
            spec.append(("seq", type(a), inner))
        else:
            spec.append(("v", a))
    return tensors, spec


def _rebuild(spec: list[Any], tensors) -> list[Any]:
    out: list[Any] = []
    for s in spec:
        if s[0] == "t":
            out.append(tensors[s[1]])
        elif s[0] == "seq":
            out.append(s[1](tensors[i[1]] if i[0] == "t" else i[1] for i in s[2]))
        else:
            out.append(s[1])
    return out


#: ids of the blocks whose inputs stay on the GPU (memory.activations.keep_on_gpu), set by :func:`keep_on_gpu`. By id:
#: diffusers calls the checkpoint function with the block itself, and the blocks live as long as the model.
_KEPT: set[int] = set()


def keep_on_gpu(blocks: list[torch.nn.Module], n: int) -> None:
    """The last ``n`` of ``blocks`` (forward order) keep their checkpointed inputs on the GPU: backward reaches them
    first, so their memory is the first given back, and their copies would wait at backward's start."""
    _KEPT.clear()
    _KEPT.update(id(b) for b in blocks[len(blocks) - n :] if n)


def offloaded_checkpoint(block: torch.nn.Module, *args) -> Any:
    """Run ``block(*args)`` checkpointed, its large tensor inputs kept in host RAM until backward (on the GPU for
    the blocks :func:`keep_on_gpu` named)."""
    if not torch.is_grad_enabled():
        return block(*args)
    tensors, spec = _flatten(args)
    dummy = torch.empty(0, requires_grad=True)
    return _Offloaded.apply(block, spec, dummy, *tensors)
