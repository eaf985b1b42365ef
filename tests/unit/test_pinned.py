"""memory.pinned_limit_gib (issue 23, Windows-like limits): pinned host memory under a cap, pageable past it or when
the driver refuses, one warning; simulated on CPU with a stand-in for pinning."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.memory import pinned

KIB = 1024


class FakePin:
    """Stands in for pinned allocation on a CPU-only machine: records the byte buffers it made; refuses after
    ``refuse_after`` of them, as a driver at its limit would."""

    def __init__(self, refuse_after: int | None = None):
        self.made: list[tuple[int, int]] = []  # (address, bytes)
        self.refuse_after = refuse_after

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.refuse_after is not None and len(self.made) >= self.refuse_after:
            raise RuntimeError("CUDA error: out of memory\nmore lines")
        out = torch.empty(nbytes, dtype=torch.uint8)
        self.made.append((out.data_ptr(), nbytes))
        return out

    def owns(self, t: torch.Tensor) -> bool:
        a = t.data_ptr()
        return any(p <= a and a + t.numel() * t.element_size() <= p + n for p, n in self.made)


@pytest.fixture(autouse=True)
def _fresh_budget():
    yield
    pinned.configure(None)  # the next test starts from the default (no cap, torch's pinning)


def test_the_cap_pins_what_fits_and_the_rest_is_pageable(capsys, monkeypatch):
    monkeypatch.setattr(pinned, "SLAB", 1024 * KIB)
    pin = FakePin()
    pinned.configure(1.0 * 1000 * KIB / 2**30 + 1e-9, pin)  # room for 1000 KiB: a 512 KiB slab, then 256 KiB ones
    ts = [torch.randn(100 * KIB) for _ in range(4)]  # 400 KiB each (float32)
    copies = [pinned.host_like(t, pinned=True) for t in ts]
    for t, c in zip(ts, copies):
        assert torch.equal(t, c) and c.device.type == "cpu"
    b = pinned.budget()
    assert [pin.owns(c) for c in copies] == [True, False, False, False]
    assert (b.pinned_bytes, b.used_bytes, b.pageable_bytes) == (512 * KIB, 400 * KIB, 1200 * KIB)
    assert b.pinned_bytes <= b.limit
    err = capsys.readouterr().err
    assert err.count("pinned_limit_gib") == 1 and "pageable" in err  # said once, not per tensor
    assert len(b.warnings) == 1


def test_a_refusing_driver_falls_back_once(capsys, monkeypatch):
    monkeypatch.setattr(pinned, "SLAB", 4 * KIB)  # a slab for each 4000-byte tensor
    pin = FakePin(refuse_after=2)
    pinned.configure(None, pin)
    copies = [pinned.host_like(torch.ones(1000), pinned=True) for _ in range(5)]
    assert [pin.owns(c) for c in copies] == [True, True, False, False, False]
    assert all(torch.equal(c, torch.ones(1000)) for c in copies)
    err = capsys.readouterr().err
    assert err.count("refused to pin") == 1 and "CUDA error: out of memory" in err and "more lines" not in err


def test_pinned_copies_are_packed_into_slabs_not_rounded_one_by_one(monkeypatch):
    """torch's pinned allocator rounds each buffer up to a power of two (SDXL's swapped blocks: 4.68 GiB of weights
    took 6.15); packed, 200 tensors of 2.1 MB take two 256 MiB slabs instead of 200 x 4 MiB."""
    pin = FakePin()
    pinned.configure(None, pin)
    shapes = [(525_000,)] * 199 + [(3, 5, 7, 11)]
    ts = [torch.randn(s).bfloat16() if i % 2 else torch.randn(s) for i, s in enumerate(shapes)]
    copies = [pinned.host_like(t, pinned=True) for t in ts]
    b = pinned.budget()
    assert all(torch.equal(t, c) and c.shape == t.shape and c.dtype == t.dtype for t, c in zip(ts, copies))
    assert all(pin.owns(c) for c in copies) and len(pin.made) == 2
    assert b.pinned_bytes == 2 * pinned.SLAB < sum(pinned._pow2(t.numel() * t.element_size()) for t in ts)
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))  # no two views overlap
    bases = [p for p, _ in pin.made]
    assert all(min(c.data_ptr() - p for p in bases if c.data_ptr() >= p) % pinned.ALIGN == 0 for c in copies)


def test_a_tensor_larger_than_a_slab_gets_a_power_of_two_slab_the_rest_fill_it(monkeypatch):
    monkeypatch.setattr(pinned, "SLAB", 64 * KIB)
    pin = FakePin()
    pinned.configure(None, pin)
    big = pinned.host_like(torch.ones(40 * KIB), pinned=True)  # 160 KiB: a 256 KiB slab
    small = pinned.host_like(torch.ones(10 * KIB), pinned=True)  # fits the big slab's tail: no new slab
    cl = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    c = pinned.host_like(cl, pinned=True)
    assert [n for _, n in pin.made] == [256 * KIB] and pin.owns(big) and pin.owns(small) and pin.owns(c)
    assert c.stride() == cl.stride() and torch.equal(c, cl)


def test_not_asked_to_pin_takes_nothing_from_the_budget():
    pin = FakePin()
    pinned.configure(1e-6, pin)
    c = pinned.host_like(torch.ones(10_000), pinned=False)
    assert pin.made == [] and pinned.budget().pinned_bytes == 0 and pinned.budget().warnings == []
    assert torch.equal(c, torch.ones(10_000))


def test_a_library_pins_through_the_budget_and_gets_its_torch_back():
    """As torchao's CPUOffloadOptimizer builds its host buffers: ``torch.empty_like(p, device="cpu",
    pin_memory=True)`` and ``torch.empty_like(p_host, pin_memory=True)`` in its own module."""
    lib = types.ModuleType("fake_cpu_offload")
    exec(
        "import torch\n"
        "def build(p):\n"
        "    h = torch.empty_like(p, device='cpu', pin_memory=True)\n"
        "    h.grad = torch.empty_like(h, pin_memory=True)\n"
        "    return h, torch.zeros(2)\n",
        lib.__dict__,
    )
    pin = FakePin()
    pinned.configure(4 * 4096 / 2**30, pin)  # room for one 4096-float buffer, not two
    with pinned.pinning_through_budget(lib):
        h, z = lib.build(torch.ones(4096))
    assert pin.owns(h) and not pin.owns(h.grad) and torch.equal(z, torch.zeros(2))
    assert lib.torch is torch
    with pytest.raises(ZeroDivisionError), pinned.pinning_through_budget(lib):
        1 / 0  # noqa: B018
    assert lib.torch is torch


def test_block_swap_takes_its_host_copies_from_the_budget(monkeypatch):
    from difftrain.memory import block_swap

    calls = []

    def recording(t, pinned):
        calls.append(pinned)
        return t.detach().clone()

    monkeypatch.setattr(block_swap, "host_like", recording)
    units = [torch.nn.Linear(8, 8) for _ in range(3)]
    root = torch.nn.Sequential(*units).requires_grad_(False)
    block_swap.BlockSwap(root, list(units), 2, torch.device("cpu"))
    assert calls == [False] * 4  # two units' weight and bias; not pinned: no CUDA here


def test_the_setting_is_validated_and_configures_the_run(monkeypatch):
    from difftrain.trainers import setup

    cfg = resolve(recipe="tiny-sdxl-lora", sets=["memory.pinned_limit_gib=2.5"]).config
    monkeypatch.setattr(setup.dist_, "init", lambda world, device: None)
    setup.prepare_process(cfg, setup.dist_.World(), torch.device("cpu"))
    assert pinned.budget().limit == int(2.5 * 2**30)
    with pytest.raises(Exception, match="pinned_limit_gib"):
        resolve(recipe="tiny-sdxl-lora", sets=["memory.pinned_limit_gib=0"])
