"""Reading a safetensors header without trusting it: its claimed size is checked before it is read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftrain.utils import SafetensorsReader, read_safetensors_header, stored_float_dtype


def test_the_header_lists_the_tensors(tmp_path):
    save_file(
        {"a": torch.zeros(2, 3, dtype=torch.float16), "b": torch.zeros(4)},
        tmp_path / "x.safetensors",
        metadata={"k": "v"},
    )
    h = read_safetensors_header(tmp_path / "x.safetensors")
    assert h["a"]["dtype"] == "F16" and h["a"]["shape"] == [2, 3] and h["__metadata__"] == {"k": "v"}


@pytest.mark.parametrize(
    "data, why",
    [
        (b"", "too short"),
        ((2**60).to_bytes(8, "little") + b"{}", "claims a"),  # a header of an exabyte: refused, nothing allocated
        ((50).to_bytes(8, "little") + b"{}", "claims a"),  # longer than the file
        ((4).to_bytes(8, "little") + b"\xff\xfe{}", "unreadable"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ],
)
def test_a_damaged_or_hostile_header_is_refused_with_the_reason(tmp_path, data, why):
    f = tmp_path / "bad.safetensors"
    f.write_bytes(data)
    with pytest.raises(ValueError, match=why):
        read_safetensors_header(f)


def test_the_dtype_most_bytes_are_stored_in(tmp_path):
    save_file(
        {
            "unet.a": torch.zeros(100, dtype=torch.float16),
            "unet.b": torch.zeros(10, dtype=torch.float32),
            "te.c": torch.zeros(1000, dtype=torch.bfloat16),
            "i": torch.zeros(5000, dtype=torch.int64),
        },
        tmp_path / "m.safetensors",
    )
    assert stored_float_dtype([tmp_path / "m.safetensors"]) == torch.bfloat16
    assert stored_float_dtype([tmp_path / "m.safetensors"], prefix="unet.") == torch.float16
    assert stored_float_dtype([tmp_path / "m.safetensors"], prefix="nothing") is None
    (tmp_path / "bad.safetensors").write_bytes(b"12")
    assert stored_float_dtype([tmp_path / "bad.safetensors"]) is None


def test_reader_reads_what_safetensors_wrote_without_mapping_the_file(tmp_path):
    """SafetensorsReader (issue 23: the file's pages no longer count in the RSS while a model loads): every dtype and
    shape safetensors writes comes back bit for bit, with the metadata; the file is never mapped."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 2, 2, generator=g).bfloat16(),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }
    f = tmp_path / "m.safetensors"
    save_file(tensors, str(f), metadata={"format": "pt", "note": "x"})
    with SafetensorsReader(f) as r:
        assert sorted(r.keys()) == sorted(tensors) and r.metadata() == {"format": "pt", "note": "x"}
        for k, t in tensors.items():
            got = r.get_tensor(k)
            assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape) == r.get_shape(k)
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
        maps = Path("/proc/self/maps").read_text() if sys.platform.startswith("linux") else ""
        assert str(f) not in maps
    assert r._f.closed


def test_reader_refuses_a_truncated_file(tmp_path):
    f = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(100)}, str(f))
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ValueError, match="lies beyond the end of the file"):
        SafetensorsReader(f)
