"""Precompute's VAE batch on a small GPU (issue 24, item 4): planned from free memory with the measured bytes per
pixel, halved where the GPU runs out all the same, and a clear error where one image does not fit. The GPU itself
is faked here (a CUDA device name, CPU tensors, the free memory patched); tests/gpu/test_gpu.py runs it capped."""

from __future__ import annotations

import pytest
import torch

from difftrain.errors import DataError
from difftrain.precompute import encode

GIB = 2**30
MPX = 1024 * 1024


def test_the_planned_batch_follows_the_measured_bytes_per_pixel():
    # an 8 GB card leaves torch ~6.95 GiB; the VAE's weights take ~0.3 of it
    room = 6.6 * GIB
    assert encode.vae_chunk(4, "fp32", MPX, room) == 1  # 3.01 GiB a megapixel image, 1.5x reserved
    assert encode.vae_chunk(4, "bf16", MPX, room) == 2
    assert encode.vae_chunk(4, "bf16", 512 * 512, room) == 4  # never above the configured batch
    assert encode.vae_chunk(4, "fp32", MPX, 70 * GIB) == 4
    assert encode.vae_chunk(4, "bf16", MPX, 0.5 * GIB) == 1  # at least one: the error comes from trying


class _Fam:
    """An image family whose encoder runs out of memory above ``fits`` images at once."""

    video = False

    def __init__(self, fits: int):
        self.fits, self.calls = fits, []

    def encode_images(self, comps, pix):
        self.calls.append(len(pix))
        if len(pix) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return pix[:, :2, ::8, ::8] * 2


@pytest.fixture
def fake_gpu(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(encode, "gpu_room", lambda device: 70 * GIB)
    monkeypatch.setattr(encode, "info", said.append)
    return said


def test_a_batch_that_runs_out_is_halved_once_for_the_run_and_said_once(fake_gpu):
    fam, dev = _Fam(fits=2), torch.device("cuda", 0)
    chunk = encode._Chunk(4)
    pix = torch.randn(4, 3, 64, 64)
    out = encode._encode_images(fam, {}, pix, dev, "fp32", chunk)
    assert torch.equal(out, pix[:, :2, ::8, ::8] * 2)  # every image, in order
    assert fam.calls == [4, 2, 2] and chunk.size == 2
    out2 = encode._encode_images(fam, {}, torch.randn(4, 3, 64, 64), dev, "fp32", chunk)
    assert out2.shape[0] == 4 and fam.calls[3:] == [2, 2]  # the next batch starts at what fitted
    assert len(fake_gpu) == 1 and "2 image(s) at a time" in fake_gpu[0] and "fp32" in fake_gpu[0]


def test_the_halved_batch_runs_after_the_failed_one_is_freed(fake_gpu):
    """The failed batch's tensors live as long as its error; where a reference cycle runs through the error (here a
    local naming it), only the collector frees them: the halved batch must start after both (the collector off)."""
    import gc
    import weakref

    class Held:
        pass

    held: list[weakref.ref] = []
    freed_at_retry: list[bool] = []

    class CyclicFam(_Fam):
        def encode_images(self, comps, pix):
            if len(pix) > self.fits:
                acts = Held()
                held.append(weakref.ref(acts))
                err = torch.OutOfMemoryError("CUDA out of memory (fake)")
                raise err  # err -> traceback -> this frame -> err
            freed_at_retry.append(all(r() is None for r in held))
            return pix[:, :2, ::8, ::8]

    was = gc.isenabled()
    gc.disable()
    try:
        encode._encode_images(CyclicFam(fits=2), {}, torch.randn(4, 3, 64, 64), torch.device("cuda", 0), "fp32",
                              encode._Chunk(4))  # fmt: skip
    finally:
        if was:
            gc.enable()
    assert held and freed_at_retry == [True, True]


def test_the_planned_batch_is_used_before_anything_runs_out(fake_gpu, monkeypatch):
    monkeypatch.setattr(encode, "gpu_room", lambda device: 6.6 * GIB)
    fam = _Fam(fits=4)
    out = encode._encode_images(fam, {}, torch.randn(3, 3, 1024, 1024), torch.device("cuda"), "fp32", encode._Chunk(4))
    assert fam.calls == [1, 1, 1] and out.shape[0] == 3


def test_one_image_that_does_not_fit_is_a_clear_error(fake_gpu):
    with pytest.raises(DataError) as e:
        encode._encode_images(_Fam(fits=0), {}, torch.randn(2, 3, 64, 64), torch.device("cuda"), "fp32",
                              encode._Chunk(2))  # fmt: skip
    assert "one 64x64 image in fp32" in str(e.value) and "vae_dtype: bf16" in e.value.hint


def test_the_cpu_and_video_families_encode_the_whole_batch(fake_gpu):
    fam = _Fam(fits=1)
    with pytest.raises(torch.OutOfMemoryError):  # no chunking off the GPU: the batch goes as it is
        encode._encode_images(fam, {}, torch.randn(2, 3, 64, 64), torch.device("cpu"), "fp32", encode._Chunk(2))
    fam.video = True
    with pytest.raises(torch.OutOfMemoryError):
        encode._encode_images(fam, {}, torch.randn(2, 3, 64, 64), torch.device("cuda"), "fp32", encode._Chunk(2))


def test_the_free_memory_is_read_for_a_device_named_without_an_index(monkeypatch):
    """precompute.device "cuda" (auto's choice) has no index; torch's per-process cap wants one (found on the GPU:
    "Expected a torch.device with a specified index")."""
    seen = []

    def wants_index(name, value):
        def f(dev=None):
            if not isinstance(dev, int):
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{dev}")
            seen.append(name)
            return value

        return f

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", wants_index("free", (10 * GIB, 80 * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", wants_index("allocated", 1 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", wants_index("reserved", 2 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", wants_index("fraction", 0.1))
    room = encode.gpu_room(torch.device("cuda"))
    assert room == pytest.approx(0.1 * 80 * GIB - 1 * GIB)  # the cap (8 GiB) less what is allocated, below free
    assert set(seen) == {"free", "allocated", "reserved", "fraction"}
    assert encode.gpu_room(torch.device("cuda", 0)) == room
