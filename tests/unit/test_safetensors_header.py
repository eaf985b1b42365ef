"""Reading a safetensors header without trusting it: its claimed size is checked before it is read."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from difftrain.utils import read_safetensors_header, stored_float_dtype


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
