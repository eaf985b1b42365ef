"""ZeRO-3's RAM-safe load (issue 8): the denoiser is built from its config on every process (under
deepspeed.zero.Init each keeps only its share) and filled by one reader, a chunk of parameters at a time
inside a gather. Here the gather and the broadcast are recorded, so the logic runs on the CPU; the real
DeepSpeed path runs in tests/gpu/test_multi_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from difftrain.config.schema import ModelConfig
from difftrain.families.cogvideox import CogVideoX, CogVideoXI2V
from difftrain.families.sd3 import SD3
from difftrain.families.sdxl import SDXL
from difftrain.families.wan import Wan, WanI2V
from difftrain.memory.deepspeed_engine import fill_weights


class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(16, 32)
        self.conv = torch.nn.Conv2d(4, 8, 3)
        self.b = torch.nn.Linear(32, 16)
        self.b.weight = torch.nn.Parameter(self.a.weight.detach().t().clone())
        self.tied = self.a  # the same module (and weights) under a second name
        self.register_buffer("table", torch.randn(5, 3) + seed)


class Recorder:
    def __init__(self):
        self.chunks: list[list[int]] = []
        self.buffers: list[torch.Tensor] = []

    @contextlib.contextmanager
    def gather(self, params):
        self.chunks.append([id(p) for p in params])
        yield

    def broadcast(self, t):
        self.buffers.append(t)


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_the_reader_fills_every_weight_once_in_chunks():
    target, source, rec = Net(0), Net(1), Recorder()
    n = fill_weights(target, source, rec.gather, rec.broadcast, chunk_bytes=600)
    for k, v in source.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k
    gathered = [i for c in rec.chunks for i in c]
    assert sorted(gathered) == sorted({id(p) for p in target.parameters()})  # each once, tied ones too
    assert len(rec.chunks) > 1  # several chunks of at most ~600 bytes each
    assert n == sum(p.numel() * p.element_size() for p in target.parameters())
    assert [b.data_ptr() for b in rec.buffers] == [target.table.data_ptr()]


def test_other_processes_take_part_in_every_gather_and_copy_nothing():
    target, main, rec_main, rec_other = Net(0), Net(0), Recorder(), Recorder()
    before = _state(target)
    fill_weights(main, Net(1), rec_main.gather, rec_main.broadcast, chunk_bytes=600)
    assert fill_weights(target, None, rec_other.gather, rec_other.broadcast, chunk_bytes=600) == 0
    for k, v in before.items():
        assert torch.equal(target.state_dict()[k], v)
    # the same collectives in the same order: otherwise the processes would wait on each other forever
    assert [len(c) for c in rec_other.chunks] == [len(c) for c in rec_main.chunks]
    assert len(rec_other.buffers) == len(rec_main.buffers) == 1


def test_weights_that_do_not_fit_are_named_before_anything_is_copied():
    target, rec = Net(0), Recorder()
    before = _state(target)
    source = Net(1)
    del source.conv
    source.conv2 = torch.nn.Conv2d(4, 8, 3)
    with pytest.raises(ValueError, match=r"missing \['conv.bias', 'conv.weight'\], unexpected \['conv2.bias"):
        fill_weights(target, source, rec.gather, rec.broadcast)
    assert rec.chunks == []
    for k, v in before.items():
        assert torch.equal(target.state_dict()[k], v)


def test_a_wrong_shape_is_named():
    target, source, rec = Net(0), Net(1), Recorder()
    source.conv.weight = torch.nn.Parameter(torch.zeros(8, 4, 5, 5))
    with pytest.raises(ValueError, match=r"conv.weight has shape \(8, 4, 5, 5\) in the weights, \(8, 4, 3, 3\)"):
        fill_weights(target, source, rec.gather, rec.broadcast)


@pytest.mark.parametrize("family", [SDXL, SD3, CogVideoX, CogVideoXI2V, Wan, WanI2V])
def test_each_family_builds_its_denoiser_from_config_as_load_returns_it(family, tmp_path):
    fam = family()
    model = fam.build_tiny(tmp_path / "tiny", seed=0)
    mcfg = ModelConfig(path=model)
    den = fam.denoiser
    loaded = fam.load(mcfg, [den])[den]
    empty = fam.empty_part(mcfg, den)
    shapes = {k: tuple(v.shape) for k, v in loaded.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in empty.state_dict().items()} == shapes
    assert type(empty) is type(loaded)
    rec = Recorder()
    fill_weights(empty.to(loaded.dtype), loaded, rec.gather, rec.broadcast)
    for k, v in loaded.state_dict().items():
        assert torch.equal(empty.state_dict()[k], v), k
