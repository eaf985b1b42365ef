"""Block swap: keep some of the denoiser's blocks in pinned host memory and stream them in.

The family names the denoiser's repeated units in forward order (transformer
blocks; for the SDXL UNet its resnets and transformer layers). The
``blocks_to_swap`` largest live in pinned host RAM; a unit's weights are
copied to the GPU on a side stream while the unit before it computes, used,
and dropped again, so at most ``prefetch + 1`` swapped units sit on the GPU.

Why our own and not accelerate's ``cpu_offload`` hooks or DeepSpeed's
parameter offload: accelerate's hooks copy synchronously on the compute stream
(no overlap) and are made for inference; ZeRO-3 offload partitions every
parameter and needs its engine. Peers that swap blocks (kohya's musubi-tuner
and sd-scripts for FLUX/SD3) swap weights between blocks of equal shape, which
a UNet does not have; this one copies into fresh buffers, so any unit shape works.

How backward finds its weights: autograd saves a frozen weight as the
parameter itself, so it reads whatever ``param.data`` holds when backward
runs. A hook on each unit's output fires as the unit's backward begins; it
brings the unit back (with gradient checkpointing, the recompute's forward
hook does the same) and drops units later in forward order, whose backward
is over. A weight used while evicted fails loudly (wrong device), never silently.

Trained weights in swapped units (full fine-tuning) live on the host too, and
either the optimizer steps them there (torchao's CPU-offload optimizer, with
gradient offload) or, with ``write_back`` (memory.fused_backward and
Adafactor, whose factored state is small enough for the GPU: sd-scripts'
blocks_to_swap with --fused_backward_pass), each is stepped on the GPU inside
backward while its unit is resident, and the unit is copied home when it is
dropped after its backward. The config validator requires one of the two.
LoRA weights stay on the GPU.

``fixed`` (with CUDA graphs): each swapped unit always lands at the same GPU addresses. A recorded graph replays
the addresses it read when it was recorded, so fresh buffers per fetch would make torch re-record every step.
``prefetch + 2`` slots, each as large as the largest swapped unit, are allocated once; the unit at position k
among the swapped ones always uses slot k mod slots, with the same views into it. A fetch is ordered after the
compute already queued (as without slots), so the unit that held the slot before is done with it.
"""

from __future__ import annotations

import torch

from .pinned import budget, host_like


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (so a forward now is a checkpoint's
    recompute). torch's own checkpoint asks the same (torch.utils.checkpoint); no public API says it."""
    return torch._C._current_graph_task_id() != -1


def choose_swapped(sizes: list[int], blocks_to_swap: int) -> list[int]:
    """The units that live in host RAM: the ``blocks_to_swap`` largest (of equal ones, the later in forward order),
    in forward order. The streaming load (memory/placement.py) and the planner choose with it too."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], -i))
    return sorted(order[: min(blocks_to_swap, len(sizes))])


class BlockSwap:
    def __init__(
        self,
        root: torch.nn.Module,
        units: list[torch.nn.Module],
        blocks_to_swap: int,
        device: torch.device,
        prefetch: int = 1,
        swap_trainable: bool = False,
        poison: bool = False,
        write_back: bool = False,
        fixed: bool = False,
        swapped: list[int] | None = None,
    ):
        """Place ``root`` (which may sit on the CPU) on ``device`` except the swapped units' weights.

        ``write_back``: units dropped after their backward are copied home first (their weights were stepped on
        the GPU). ``poison`` (tests on CPU): evicted tensors become empty, so a use while evicted raises.
        ``fixed``: every fetch of a unit lands in the same slot, at the same addresses (for CUDA graphs).
        ``swapped``: the units to swap, as the streaming load chose them and put their weights in host RAM
        (default: :func:`choose_swapped` over the units' sizes now).
        """
        self.units = units
        self.write_back = write_back
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.poison = poison
        self.cuda = self.device.type == "cuda"
        sizes = [
            sum(p.numel() * p.element_size() for p in u.parameters() if swap_trainable or not p.requires_grad)
            for u in units
        ]
        self.swapped = sorted(swapped) if swapped is not None else choose_swapped(sizes, blocks_to_swap)
        self.index = {i: k for k, i in enumerate(self.swapped)}  # unit index -> position among swapped
        self.swapped_bytes = sum(sizes[i] for i in self.swapped)
        self.params: dict[int, list[torch.nn.Parameter]] = {}
        self.home: dict[int, list[torch.Tensor]] = {}
        self.resident: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}  # None: not CUDA
        self.backward = False
        self.written = False  # a write-back was queued since the last end_backward
        self.peak_resident = 0  # most swapped units on the device at once (tests, benchmarks)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._handles = []
        swapped_ids: set[int] = set()
        for i in self.swapped:
            ps = [p for p in units[i].parameters() if swap_trainable or not p.requires_grad]
            self.params[i] = ps
            self.home[i] = []
            for p in ps:  # one tensor at a time: host RAM holds one extra tensor at most
                self.home[i].append(self._to_host(p.data))
                p.data = self.home[i][-1]
            swapped_ids.update(id(p) for p in ps)
            self._evict(i)
        with torch.no_grad():
            for t in [*root.parameters(), *root.buffers()]:
                if id(t) not in swapped_ids and t.device != self.device:
                    t.data = t.data.to(self.device)
        self.slots: list[torch.Tensor] = []
        self.slot_views: dict[int, list[torch.Tensor]] = {}
        self.slot_conflicts = 0  # fetches that found their slot's unit still resident (tests: none expected)
        if fixed and self.swapped:
            self._make_slots(prefetch + 2)
        for i in self.swapped:
            u = units[i]
            self._handles.append(u.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(u.register_forward_hook(self._post_hook(i)))

    def _make_slots(self, n: int) -> None:
        """``n`` flat byte buffers on the device, each as large as the largest swapped unit, and each unit's fixed
        views into its own slot (tensors start on 256-byte boundaries, as the caching allocator's blocks do)."""
        layouts, need = {}, 0
        for i in self.swapped:
            off, lay = 0, []
            for h in self.home[i]:
                lay.append(off)
                off += -(-h.nbytes // 256) * 256
            layouts[i], need = lay, max(need, off)
        n = min(n, len(self.swapped))
        self.slots = [torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(n)]
        for i in self.swapped:
            buf = self.slots[self.index[i] % n]
            self.slot_views[i] = [
                buf[o : o + h.nbytes].view(h.dtype).view(h.shape) for o, h in zip(layouts[i], self.home[i])
            ]

    @property
    def slot_bytes(self) -> int:
        """GPU bytes the fixed slots hold (0 without them)."""
        return sum(b.numel() for b in self.slots)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        # pinned (page-locked) memory: the copy to the GPU can run on a side stream, overlapped; pageable past
        # memory.pinned_limit_gib or when the driver refuses (pinned.py). A weight the streaming load already put
        # in the pinned store stays where it is: a second copy would double the RAM.
        if budget().holds(t):
            return t
        return host_like(t, pinned=self.cuda)

    # ------------------------------------------------------------ moves
    def _fetch_async(self, i: int) -> None:
        if i in self.resident:
            return
        home = self.home[i]
        if self.stream is None:  # not CUDA (the side stream exists on CUDA only)
            if self.slots:
                bufs = self._slot_for(i)
                for b, h in zip(bufs, home):
                    b.copy_(h)
                self.resident[i] = (bufs, None)
            else:
                self.resident[i] = ([h.clone() for h in home], None)
            self.peak_resident = max(self.peak_resident, len(self.resident))
            return
        compute = torch.cuda.current_stream(self.device)
        # allocate on the compute stream, so the allocator orders reuse of the memory with its kernels; fixed
        # slots: the copy below waits for every kernel queued so far, the slot's last user's included
        bufs = self._slot_for(i) if self.slots else [torch.empty_like(h, device=self.device) for h in home]
        ready = torch.cuda.Event()
        ready.record(compute)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for b, h in zip(bufs, home):
                b.copy_(h, non_blocking=True)
            done.record(self.stream)
        self.resident[i] = (bufs, done)
        self.peak_resident = max(self.peak_resident, len(self.resident))

    def _slot_for(self, i: int) -> list[torch.Tensor]:
        """Unit ``i``'s fixed views, its slot taken over: a unit still resident there goes home first (the hooks'
        order never leaves one there with ``prefetch + 2`` slots; counted, so the tests see it)."""
        n = len(self.slots)
        for held in [j for j in self.resident if j != i and self.index[j] % n == self.index[i] % n]:
            self.slot_conflicts += 1
            self._evict(held, stepped=self.backward and held > i)
        return self.slot_views[i]

    def _ensure(self, i: int) -> None:
        self._fetch_async(i)
        bufs, done = self.resident[i]
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        for p, b in zip(self.params[i], bufs):
            p.data = b

    def _evict(self, i: int, stepped: bool = False) -> None:
        """Send unit ``i`` home; ``stepped``: its backward is over, and with write_back its weights changed."""
        entry = self.resident.pop(i, None)
        if entry is not None and entry[1] is not None:
            torch.cuda.current_stream(self.device).wait_event(entry[1])  # a prefetch never used: let it land first
        if entry is not None and stepped and self.write_back:
            self._write_home(i, entry[0])
        for p, h in zip(self.params[i], self.home[i]):
            p.data = torch.empty(0, dtype=h.dtype) if self.poison else h

    def _write_home(self, i: int, bufs: list[torch.Tensor]) -> None:
        """Copy a unit's stepped weights home: on the side stream after the compute stream's optimizer kernels, so
        the next fetch (same stream) reads them; the GPU buffers are not reused before the copy has read them."""
        if self.stream is None:
            for h, b in zip(self.home[i], bufs):
                h.copy_(b)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for h, b in zip(self.home[i], bufs):
                h.copy_(b, non_blocking=True)
                b.record_stream(self.stream)
        self.written = True

    def _prefetch_after(self, i: int, forward: bool) -> None:
        k = self.index[i]
        step = 1 if forward else -1
        for j in range(1, self.prefetch + 1):
            n = k + step * j
            if 0 <= n < len(self.swapped):
                self._fetch_async(self.swapped[n])

    # ------------------------------------------------------------ hooks
    def _pre_hook(self, i: int):
        def hook(module, args):
            if not self.backward and _in_backward():  # an offloaded checkpoint's first recompute: see _post_hook
                self.backward = True
            if self.backward:  # a recompute starts once the unit's output gradient is whole: later units are done
                for j in [j for j in self.resident if j > i]:
                    self._evict(j, stepped=True)
            self._ensure(i)
            self._prefetch_after(i, forward=not self.backward)

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            # The hook on the output fires as this unit's backward begins and sends later units home. Registered in
            # a recompute too: an offloaded checkpoint (memory.activations.offload) runs the forward without
            # autograd, so the recompute's output is the first one backward passes through; without it every unit
            # recomputed stayed on the GPU until the step's end (Wan 14B: 30 swapped blocks, 9.8 GiB).
            if torch.is_grad_enabled():
                outs = output if isinstance(output, (tuple, list)) else (output,)
                for t in outs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._grad_hook(i))
            if self.backward:  # a checkpoint recompute: this unit's backward runs next
                return
            self._evict(i)

        return hook

    def _grad_hook(self, i: int):
        def hook(grad):
            self.backward = True
            for j in [j for j in self.resident if j > i]:
                self._evict(j, stepped=True)
            self._ensure(i)
            self._prefetch_after(i, forward=False)

        return hook

    def end_backward(self) -> None:
        """After each backward: every swapped unit goes home; the next forward starts afresh. Written-back weights
        have landed when this returns (a checkpoint, EMA or validation may read them on the host)."""
        for i in list(self.resident):
            self._evict(i, stepped=self.backward)
        if self.written and self.stream is not None:
            self.stream.synchronize()
        self.written = False
        self.backward = False

    def remove(self) -> None:
        self.end_backward()
        for h in self._handles:
            h.remove()
