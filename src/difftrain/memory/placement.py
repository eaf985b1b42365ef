"""The memory plan's storage and placement of frozen weights, applied as the load reads each tensor (issue 50).

Before, a part stored in fp8 or swapped block by block was first loaded whole into host memory (the compute
dtype), and the techniques then made each layer's fp8 copy and each swapped block's pinned copy from it: FLUX.1's
transformer took 24 GiB of host RAM on every recipe, the 24 GB-card one included. Here the load hands each
tensor over as it is read (``families.streaming``): an fp8-stored weight is quantized on the training device and
kept there, or in the pinned block-swap store when its block is swapped; every other tensor goes to the device
or, in a swapped block, to the pinned store. The host then holds one tensor of the model at a time, beyond what
block swap keeps there by design.

The same rules as the techniques that run after the adapters (``memory.plan.apply_weights``, ``BlockSwap``):
which layers become fp8 (``fp8.convertible``, the family's high-precision modules kept) and which blocks are
swapped (``block_swap.choose_swapped`` over the sizes the blocks will have), so a streamed part ends as the
techniques would have left it. bitsandbytes' nf4 / int8 weights stream too: each Linear becomes its bitsandbytes
layer, quantized on the device, as its weight is read (``bnb_weights.make_layer``, the layer ``bnb_weights.convert``
would have made from the loaded model; it then leaves these as they are). Block swap is not allowed with them
(config rule), so nothing of theirs goes to the host store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..config.schema import MemoryConfig, OffloadBlockSwap, WeightsInt4
from ..utils import set_tensor
from . import bnb_weights, fp8, int4
from .block_swap import choose_swapped
from .pinned import host_like

Units = Callable[[torch.nn.Module], list[torch.nn.Module]]
#: families.streaming's Put: sets one tensor of a part, by its name, into the part's module
Put = Callable[[torch.nn.Module, str, torch.Tensor], None]


class WeightPlacement:
    """A ``families.streaming.Placement`` for the trainer's parts (``streaming.placing(...)`` around the load; the
    shape only: memory and families do not import each other)."""

    def __init__(
        self,
        mem: MemoryConfig,
        device: torch.device,
        dtype: torch.dtype,
        parts: Sequence[str],
        denoiser: str,
        full_trained: Sequence[str] = (),
        keep: Mapping[str, tuple[str, ...]] | None = None,
        units: Units | None = None,
    ):
        """``parts``: those the load reads; ``full_trained``: parts trained whole (never fp8); ``keep``: each part's
        modules that stay in high precision; ``units``: the denoiser's block-swap units (the family's
        swap_blocks); ``dtype``: the compute dtype the weights are loaded in."""
        self.mem = mem
        self.device = torch.device(device)
        self.dtype = dtype
        self.denoiser = denoiser
        self.full_trained = set(full_trained)
        self.keep = dict(keep or {})
        self.units = units
        self.fp8 = mem.weights.kind == "fp8"
        self.int4 = mem.weights.group_size if isinstance(mem.weights, WeightsInt4) else 0  # its group size
        self.bnb = mem.weights.kind if mem.weights.kind in ("nf4", "int8") else None
        self.swap = mem.offload.kind == "block_swap" and units is not None
        self.parts = {
            p
            for p in parts
            if ((self.fp8 or self.int4 or self.bnb) and p not in self.full_trained) or (self.swap and p == denoiser)
        }
        self.swapped: list[int] | None = None  # the denoiser's swapped units, once it is placed
        self.pinned = self.device.type == "cuda"

    def takes(self, part: str) -> bool:
        return part in self.parts

    def _fp8(self, part: str) -> bool:
        return self.fp8 and part not in self.full_trained

    def put_for(self, part: str, module: torch.nn.Module) -> Put:
        modules = dict(module.named_modules())
        keep = self.keep.get(part, ())
        use_fp8 = self._fp8(part)
        fp8_names = {
            f"{name}.weight" if name else "weight"
            for name, m in modules.items()
            if use_fp8 and fp8.convertible(m, name, keep) is not None
        }
        use_int4 = self.int4 and part not in self.full_trained
        int4_names = {
            f"{name}.weight" if name else "weight"
            for name, m in modules.items()
            if use_int4 and int4.convertible(m, name, self.int4, keep)
        }
        bnb_layers = {
            name
            for name, m in modules.items()
            if name
            and self.bnb
            and part not in self.full_trained
            and bnb_weights.quantizable(name, m, keep, frozen=False)
        }
        host: set[str] = set()
        if self.swap and part == self.denoiser:
            assert self.units is not None
            units = self.units(module)
            names = {id(m): n for n, m in modules.items()}
            itemsize = self.dtype.itemsize

            def size(u: torch.nn.Module) -> int:  # the bytes the unit will have in host RAM (block_swap's sizes)
                pre = names[id(u)]

                def nbytes(n: str, p: torch.Tensor) -> float:
                    if f"{pre}.{n}" in fp8_names:
                        return p.numel()
                    if f"{pre}.{n}" in int4_names:
                        return p.numel() / 2  # the packed weight (its scales stay on the GPU as buffers)
                    return p.numel() * (itemsize if p.is_floating_point() else 8)

                return int(sum(nbytes(n, p) for n, p in u.named_parameters()))

            offload = self.mem.offload
            assert isinstance(offload, OffloadBlockSwap)  # self.swap says so
            self.swapped = choose_swapped([size(u) for u in units], offload.blocks_to_swap)
            for i in self.swapped:
                pre = names[id(units[i])]
                host.update(f"{pre}.{n}" for n, _ in units[i].named_parameters())
        per_channel = getattr(self.mem.weights, "scale", "tensor") == "channel"

        threshold = getattr(self.mem.weights, "outlier_threshold", 0.0)

        def put(root: torch.nn.Module, name: str, t: torch.Tensor) -> None:
            with torch.no_grad():
                owner, _, leaf = name.rpartition(".")
                if leaf == "weight" and owner in bnb_layers:  # the Linear becomes its bitsandbytes layer now
                    old = root.get_submodule(owner)
                    b = old._parameters.get("bias")
                    new = bnb_weights.make_layer(
                        self.bnb or "",
                        t,
                        None if b is None or b.is_meta else b,
                        b is not None,
                        self.device,
                        self.dtype,
                        threshold,
                    )
                    parent, _, child = owner.rpartition(".")
                    setattr(root.get_submodule(parent), child, new)
                    return
                if name in fp8_names:
                    w8, scale = fp8.quantize(t.to(self.device), per_channel)
                    if name in host:
                        w8 = host_like(w8, pinned=self.pinned)
                    fp8.store(modules[name.rpartition(".")[0]], w8, scale, compute_dtype=t.dtype)
                    return
                if name in int4_names:
                    packed, scale, zero = int4.quantize(t.to(self.device), self.int4, t.dtype)
                    if name in host:
                        packed = host_like(packed, pinned=self.pinned)
                    int4.store(modules[name.rpartition(".")[0]], packed, scale, zero, compute_dtype=t.dtype)
                    return
                set_tensor(root, name, host_like(t, pinned=self.pinned) if name in host else t.to(self.device))

        return put
