"""Small shared helpers with no difftrain dependencies: atomic writes, hashing, dtypes, devices."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


def to_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def free_memory(device: torch.device) -> None:
    """What was dropped goes back: the collector for reference cycles, then the CUDA cache to the driver (on a CUDA
    device); after a model is let go (an encoder, a sampling pipeline) or a step that ran out of memory."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def gpu_index_gib(device: torch.device) -> tuple[int, float]:
    """(index, total memory in GiB) of a CUDA ``device``."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return idx, torch.cuda.get_device_properties(idx).total_memory / 2**30


def cap_gpu_memory(device: torch.device, limit_gib: float | None) -> None:
    """Cap this process's share of a CUDA ``device`` at ``limit_gib`` (torch's per-process fraction), as a smaller
    card would leave it: going over is an out-of-memory error. Nothing to do on other devices or without a limit."""
    if not limit_gib or device.type != "cuda":
        return
    idx, total = gpu_index_gib(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gib / total), idx)


@contextmanager
def atomic_file(path: Path) -> Iterator:
    """An open binary file whose content replaces ``path`` only once it is complete and on disk.

    A crash, a full disk or an exception leaves either the old file or the new
    one, never a mix, and no temporary file behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new file."""
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path``, or {} when the file is missing, unreadable, cut short or not an object
    (run files a killed process may have left half-written)."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return {}
    return obj if isinstance(obj, dict) else {}


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def commit_dir(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` (beside ``final``) become ``final``: files fsynced, then renamed; an
    existing ``final`` is replaced only once the new one is in place. What :func:`atomic_dir` does on success,
    for a folder that several processes filled."""
    for p in Path(tmp).rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success it is renamed to ``final``.

    An existing ``final`` is replaced only after the new folder is complete, so
    an interrupted write never damages what was there.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def sha256_text(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def stream_save_safetensors(
    path: Path, tensors, metadata: dict[str, str] | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Write a .safetensors file one tensor at a time, atomically.

    ``safetensors.torch.save_file`` serialises the whole dict in host memory
    first: for a 2.6B-parameter UNet on the GPU that is a second full copy in
    RAM. Here the header is computed from shapes and dtypes, then each tensor is
    moved to the host, cast (floating tensors to ``dtype`` if given) and
    written on its own, so host RAM holds one tensor at a time. The layout is
    the safetensors format: 8-byte little-endian header size, JSON header
    (padded to 8 bytes), then the raw little-endian data.
    """
    import struct

    path = Path(path)
    names = sorted(tensors)

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    header: dict = {}
    offset = 0
    for name in names:
        t = tensors[name]
        dt = out_dtype(t)
        nbytes = t.numel() * torch.empty((), dtype=dt).element_size()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            t = tensors[name].detach().to("cpu", out_dtype(tensors[name])).contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy())  # its buffer, not a copy of it
            del t
    return path


def fix_malloc_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Keep the host heap from growing with the number of items a long loop handles (glibc only).

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB); from then on the
    large transient buffers of an encode loop (decoded pixels, convolution workspaces) are carved from the
    heap, between the small long-lived blocks the loop keeps (cache entries waiting for their shard), and
    the heap can only grow: precompute's RSS climbed by ~250 KiB per image on the CPU. A fixed threshold
    (what ``MALLOC_MMAP_THRESHOLD_`` sets) gives blocks above ``nbytes`` back to the system when freed.
    Returns whether it was set."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # musl or another libc: nothing to set
        return False


#: a safetensors header larger than this is refused before it is read (real ones are well under 10 MB)
MAX_SAFETENSORS_HEADER = 100 * 2**20
_ST_FLOATS = {_ST_DTYPES[t]: t for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}  # not fp8
_ST_BY_NAME = {name: t for t, name in _ST_DTYPES.items()}


def read_safetensors_header(path: Path, limit: int = MAX_SAFETENSORS_HEADER) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets; "__metadata__"), read
    without mapping the file. Raises ValueError when the file is not one or its header is absurd, before any
    large allocation (the 8-byte length comes first and is checked against the file size and ``limit``)."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is too short to be a safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        if n > limit or n > size - 8:
            raise ValueError(
                f"{path} claims a {n}-byte header ({size} bytes in the file, at most {limit} accepted): "
                "it is damaged or not a safetensors file"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} has an unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a safetensors header that is not a JSON object")
    return header


class SafetensorsReader:
    """The tensors of a safetensors file, each read into its own buffer with plain reads, one at a time.

    Why not safetensors' ``safe_open``: it maps the file, and every page of a tensor read through the mapping counts
    in the process's RSS until the file is closed: loading SDXL's UNet kept 4.8 GiB of file pages beside the weights
    (measured on the H100, docs/benchmarks.md "Tiers as cards"). Read with ``readinto``, the bytes pass through the
    kernel's page cache (which the system takes back when it needs it) and the process holds only the tensors it
    keeps. The same interface as the part of ``safe_open`` that the loaders use: keys, get_tensor, metadata, shapes.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        header = read_safetensors_header(self.path)
        self._meta = header.pop("__metadata__", None) or {}
        self._header = header
        self._size = self.path.stat().st_size
        self._f = open(self.path, "rb")  # noqa: SIM115 (closed by close() / the context manager)
        self._start = 8 + int.from_bytes(self._f.read(8), "little")
        for key in header:  # every entry checked now, as safe_open does, before a loader reads any of them
            self._where(key)

    def _where(self, key: str) -> tuple[torch.dtype, list[int], int, int]:
        info = self._header[key]
        try:
            dtype = _ST_BY_NAME[info["dtype"]]
            a, b = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
        except (KeyError, TypeError, ValueError):
            dtype = None
        if dtype is None or min(shape, default=0) < 0 or b - a != math.prod(shape) * dtype.itemsize or a < 0:
            self.close()
            raise ValueError(f"tensor {key!r} has an invalid dtype, shape or offsets in the header")
        if self._start + b > self._size:
            self.close()
            raise ValueError(f"tensor {key!r} lies beyond the end of the file ({self._size} bytes)")
        return dtype, shape, a, b

    def keys(self) -> list[str]:
        return list(self._header)

    def metadata(self) -> dict:
        return dict(self._meta)

    def get_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def get_tensor(self, key: str) -> torch.Tensor:
        dtype, shape, a, b = self._where(key)
        buf = torch.empty(b - a, dtype=torch.uint8)
        self._f.seek(self._start + a)
        if b > a and self._f.readinto(buf.numpy().data) != b - a:
            raise ValueError(f"{self.path} ends inside tensor {key!r}: the file is truncated")
        return buf.view(dtype).reshape(shape)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stored_float_dtype(files, prefix: str = "") -> torch.dtype | None:
    """The floating dtype most of the bytes of ``files``' tensors (those whose name starts with ``prefix``) are
    stored in; None when there are none or a header cannot be read."""
    sizes: dict[torch.dtype, int] = {}
    for f in files:
        try:
            header = read_safetensors_header(f)
        except (OSError, ValueError):
            return None
        for name, info in header.items():
            if name == "__metadata__" or not name.startswith(prefix) or not isinstance(info, dict):
                continue
            dt = _ST_FLOATS.get(info.get("dtype", ""))
            offsets = info.get("data_offsets") or [0, 0]
            if dt is not None:
                sizes[dt] = sizes.get(dt, 0) + int(offsets[1]) - int(offsets[0])
    return max(sizes, key=sizes.__getitem__) if sizes else None


def own_parameter(t: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
    """A parameter holding ``t`` with a version counter of its own. ``Parameter(t)`` would share ``t``'s, and a view
    into a pinned slab (memory/pinned.py) shares its slab's with every other tensor carved from it: an in-place
    write to one (block swap's write-back, an optimizer step) would count as a change to all of them, and autograd
    refuses a backward through a weight changed since its forward (measured on the H100: sdxl-full-3gb and
    flux-full-24gb failed so). ``.data`` assignment keeps the parameter's own counter, as block swap's moves do."""
    p = torch.nn.Parameter(torch.empty(0, dtype=t.dtype, device=t.device), requires_grad=requires_grad)
    p.data = t
    return p


def set_tensor(root: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """``t`` as the parameter or buffer ``name`` of ``root`` (as ``load_state_dict(assign=True)`` sets it: a
    parameter keeps its requires_grad)."""
    owner, _, leaf = name.rpartition(".")
    m = root.get_submodule(owner)
    old = m._parameters.get(leaf)
    if old is not None or leaf in m._parameters:
        grad = old.requires_grad if old is not None else False
        m._parameters[leaf] = own_parameter(t, requires_grad=grad and t.is_floating_point())
    else:
        m._buffers[leaf] = t
