"""memory.pinned_limit_gib (issue 23, Windows-like limits): pinned host memory under a cap, pageable past it or when
the driver refuses, one warning; simulated on CPU with a stand-in for pinning."""

from __future__ import annotations

import types

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.memory import pinned

KIB = 1024


class FakePin:
    """Stands in for torch's pinned allocation on a CPU-only machine: records which buffers it made; refuses after
    ``refuse_after`` of them, as a driver at its limit would."""

    def __init__(self, refuse_after: int | None = None):
        self.made: list[int] = []
        self.refuse_after = refuse_after

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.refuse_after is not None and len(self.made) >= self.refuse_after:
            raise RuntimeError("CUDA error: out of memory\nmore lines")
        out = torch.empty_like(t, device="cpu")
        self.made.append(out.data_ptr())
        return out


@pytest.fixture(autouse=True)
def _fresh_budget():
    yield
    pinned.configure(None)  # the next test starts from the default (no cap, torch's pinning)


def test_the_cap_pins_what_fits_and_the_rest_is_pageable(capsys):
    pin = FakePin()
    pinned.configure(1.0 * 1000 * KIB / 2**30 + 1e-9, pin)  # room for 1000 KiB
    ts = [torch.randn(100 * KIB) for _ in range(4)]  # 400 KiB each (float32)
    copies = [pinned.host_like(t, pinned=True) for t in ts]
    for t, c in zip(ts, copies):
        assert torch.equal(t, c) and c.device.type == "cpu"
    b = pinned.budget()
    assert [c.data_ptr() in pin.made for c in copies] == [True, True, False, False]
    assert (b.pinned_bytes, b.pageable_bytes) == (800 * KIB, 800 * KIB)
    err = capsys.readouterr().err
    assert err.count("pinned_limit_gib") == 1 and "pageable" in err  # said once, not per tensor
    assert len(b.warnings) == 1


def test_a_refusing_driver_falls_back_once(capsys):
    pin = FakePin(refuse_after=2)
    pinned.configure(None, pin)
    copies = [pinned.host_like(torch.ones(1000), pinned=True) for _ in range(5)]
    assert sum(c.data_ptr() in pin.made for c in copies) == 2
    assert all(torch.equal(c, torch.ones(1000)) for c in copies)
    err = capsys.readouterr().err
    assert err.count("refused to pin") == 1 and "CUDA error: out of memory" in err and "more lines" not in err


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
    assert h.data_ptr() in pin.made and h.grad.data_ptr() not in pin.made and torch.equal(z, torch.zeros(2))
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
    setup.prepare_process(cfg, None, torch.device("cpu"))
    assert pinned.budget().limit == int(2.5 * 2**30)
    with pytest.raises(Exception, match="pinned_limit_gib"):
        resolve(recipe="tiny-sdxl-lora", sets=["memory.pinned_limit_gib=0"])
