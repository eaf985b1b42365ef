"""The group of one FSDP makes for a single-process run names its GPU by number (NCCL refuses a bare "cuda")."""

from __future__ import annotations

import torch

from difftrain.memory.fsdp import with_index


def test_a_bare_cuda_device_becomes_the_current_gpu_by_number(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert with_index(torch.device("cuda")) == torch.device("cuda", 1)
    assert with_index(torch.device("cuda", 0)) == torch.device("cuda", 0)  # a numbered GPU stays as named
    assert with_index(torch.device("cpu")) == torch.device("cpu")
