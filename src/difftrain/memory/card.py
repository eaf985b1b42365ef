"""What a real card leaves to torch's allocator: a recipe's tier is the card, not torch's peak.

A GPU of N GiB holds, beside what torch's caching allocator reserves: the CUDA context (the driver's
per-process state), the kernels of the CUDA libraries loaded at their first use (cuBLAS/cuBLASLt for
matmuls, cuDNN for convolutions, the attention kernels; their workspaces come from torch's allocator and
are in its figures, their code and handles are not), and on a desktop the display's framebuffers. torch's
counters see none of these, so a peak measured as ``memory_reserved`` on a data-centre GPU says nothing about
a 4 GB card. The planner adds them as their own rows (``card_terms``); ``difftrain bench memory --card``
caps the allocator at what is left (``allocator_budget``) and trains under that cap.

The figures are measured (``measure_overhead``, run by benchmarks/card_fit.py on the lent GPU) and stored
in ``card_overhead.json`` by device name; a device not measured gets the largest stored figures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
#: what a desktop's display (two monitors, a browser, the compositor) keeps on the card it drives
DISPLAY_MARGIN_GIB = 0.3
_MEASURED = Path(__file__).with_name("card_overhead.json")


@dataclass(frozen=True)
class Overhead:
    """GPU memory outside torch's allocator (GiB): the CUDA context, and the libraries' kernels and handles."""

    context_gib: float
    libraries_gib: float
    source: str  # the device it was measured on, or "measured now"

    @property
    def total_gib(self) -> float:
        return self.context_gib + self.libraries_gib


def stored_overhead(device_name: str | None = None) -> Overhead:
    """The stored measurement for ``device_name`` (a substring match on the name torch reports), else the
    largest stored one: an unmeasured card is planned with the most the context has been seen to take."""
    rows = json.loads(_MEASURED.read_text(encoding="utf-8"))["devices"]
    if device_name:
        for name, r in rows.items():
            if name.lower() in device_name.lower():
                return Overhead(r["context_gib"], r["libraries_gib"], name)
    name, r = max(rows.items(), key=lambda kv: kv[1]["context_gib"] + kv[1]["libraries_gib"])
    return Overhead(r["context_gib"], r["libraries_gib"], f"{name} (largest measured)")


CONTEXT = "CUDA context"
LIBRARIES = "CUDA libraries (kernels, handles)"
DISPLAY = "display margin"


def card_terms(overhead: Overhead | None = None, display: bool = True) -> dict[str, float]:
    """The planner's rows beyond torch's reserved peak, in GiB."""
    o = overhead or stored_overhead()
    terms = {CONTEXT: o.context_gib, LIBRARIES: o.libraries_gib}
    if display:
        terms[DISPLAY] = DISPLAY_MARGIN_GIB
    return terms


def parse_card(text: str) -> float:
    """'4gb', '8GB', '12 GiB', '24' -> GiB. A card sold as N GB has N GiB (4096 MiB for a 4 GB card)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:gi?b?)?\s*", text or "", re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"cannot read the card size {text!r}: write it like 4gb, 8GB or 12GiB")
    return float(m.group(1))


def allocator_budget(card_gib: float, overhead: Overhead, display: bool = True) -> float:
    """What a card of ``card_gib`` leaves to torch's allocator once the context, the libraries and (on a
    desktop) the display have theirs."""
    return card_gib - overhead.total_gib - (DISPLAY_MARGIN_GIB if display else 0.0)


def _outside_torch(device) -> float:
    """GiB the device has in use beyond torch's reservation (this process's context and libraries, and any
    other process on the GPU)."""
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return (total - free - torch.cuda.memory_reserved(device)) / GIB


def warm_libraries(device) -> None:
    """Load what a training step loads: cuBLAS/cuBLASLt (bf16 matmuls forward and backward), the attention
    kernels (SDPA forward and backward) and cuDNN (a bf16 convolution forward and backward)."""
    import torch
    import torch.nn.functional as F

    dt = torch.bfloat16
    a = torch.randn(256, 256, device=device, dtype=dt, requires_grad=True)
    (a @ a).sum().backward()
    q = torch.randn(1, 8, 256, 64, device=device, dtype=dt, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q).sum().backward()
    x = torch.randn(1, 32, 64, 64, device=device, dtype=dt, requires_grad=True)
    w = torch.randn(32, 32, 3, 3, device=device, dtype=dt, requires_grad=True)
    F.conv2d(x, w, padding=1).sum().backward()
    torch.cuda.synchronize(device)


def measure_overhead(device) -> Overhead:
    """The context and the libraries' share, measured on this device now (the process alone on the GPU:
    another process's memory would count as ours). torch's own memory is returned to the device first."""
    import torch

    torch.empty(1, device=device)  # the context
    torch.cuda.empty_cache()
    context = _outside_torch(device)
    warm_libraries(device)
    torch.cuda.empty_cache()
    return Overhead(round(context, 3), round(max(0.0, _outside_torch(device) - context), 3), "measured now")
