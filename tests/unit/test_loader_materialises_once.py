"""The RAM-safe loader (issue 8): a model is built on the meta device and each weight is read from its file once,
straight into place; nothing is first initialised at random and then overwritten (that would be a second copy of
every parameter in host RAM, per process)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from difftrain.config.schema import ModelConfig
from difftrain.families import common
from difftrain.families.sdxl.family import PARTS, SDXL

INITS = (
    "kaiming_uniform_",
    "kaiming_normal_",
    "uniform_",
    "normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "trunc_normal_",
    "zeros_",
    "ones_",
    "constant_",
)


@pytest.fixture
def init_calls(monkeypatch):
    """Names of torch.nn.init functions called on real (not meta) tensors while the fixture is active."""
    calls: list[str] = []
    for name in INITS:
        orig = getattr(torch.nn.init, name)

        def wrapped(tensor, *args, _orig=orig, _name=name, **kwargs):
            if not tensor.is_meta:
                calls.append(_name)
            return _orig(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, name, wrapped)
    return calls


@pytest.fixture(scope="module")
def single_file(tiny_model, tmp_path_factory):
    fam = SDXL()
    comps = fam.load(ModelConfig(path=tiny_model), PARTS)
    return fam.save_single_file(
        {p: comps[p].state_dict() for p in PARTS},
        fam.module_configs(comps),
        tmp_path_factory.mktemp("single") / "tiny-sdxl.safetensors",
    )


def test_single_file_reads_each_tensor_once_and_initialises_nothing(single_file, init_calls, monkeypatch):
    reads: Counter = Counter()
    opened = common.open_checkpoint

    def counting(kind, p):
        keys, get, shape, meta = opened(kind, p)
        counting.keys = keys

        def get_once(k):
            reads[k] += 1
            return get(k)

        return keys, get_once, shape, meta

    monkeypatch.setattr(common, "open_checkpoint", counting)
    unet = SDXL().load(ModelConfig(path=single_file, config="sdxl-tiny"), ["unet"])["unet"]
    unet_keys = {k for k in counting.keys if k.startswith("model.diffusion_model.")}
    assert set(reads) == unet_keys  # the UNet's tensors only: the encoders in the same file are not touched
    assert max(reads.values()) == 1  # each once
    assert init_calls == []  # no random initialisation of real tensors: built on the meta device
    assert not any(t.is_meta for t in unet.state_dict().values())
    from safetensors import safe_open

    with safe_open(str(single_file), "pt") as f:  # and the weights are the file's
        torch.testing.assert_close(
            unet.conv_in.weight, f.get_tensor("model.diffusion_model.input_blocks.0.0.weight").float()
        )


def test_diffusers_folder_builds_on_meta_and_reads_each_tensor_once(tiny_model, init_calls, monkeypatch):
    from difftrain.utils import SafetensorsReader

    reads: Counter = Counter()
    get = SafetensorsReader.get_tensor

    def counting(self, key):
        reads[key] += 1
        return get(self, key)

    monkeypatch.setattr(SafetensorsReader, "get_tensor", counting)
    unet = SDXL().load(ModelConfig(path=tiny_model), ["unet"])["unet"]
    assert set(reads) == set(unet.state_dict()) and set(reads.values()) == {1}  # every tensor, each once
    assert init_calls == []
    assert not any(t.is_meta for t in unet.state_dict().values())
