"""Training state as safetensors + JSON: nested structures without pickle.

``torch.save`` would pickle; a checkpoint is a user-shareable file, so
difftrain never unpickles one. A nested structure of dicts, lists, tuples,
scalars and tensors is split into a JSON tree (tensors replaced by
references) and one safetensors file holding the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import CheckpointError
from ..memory.fsdp import QUANTIZED
from ..utils import read_safetensors_header, stream_save_safetensors

# tensor subclasses that optimizer states are made of (torchao's quantized moments, the set FSDP's share files name
# too), stored as their flattened parts and rebuilt on load; only these classes are ever imported from a checkpoint
SUBCLASSES = set(QUANTIZED)


def _encode_attr(v: Any) -> Any:
    return {"__dtype__": str(v).removeprefix("torch.")} if isinstance(v, torch.dtype) else v


def _decode_attr(v: Any) -> Any:
    return getattr(torch, v["__dtype__"]) if isinstance(v, dict) and "__dtype__" in v else v


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor) and hasattr(type(obj), "__tensor_flatten__"):
        cls = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if cls not in SUBCLASSES:
            raise TypeError(f"cannot store tensor subclass {cls} at {path}")
        names, ctx = obj.__tensor_flatten__()  # type: ignore[attr-defined]  # tensor subclasses' protocol, checked above
        return {
            "__subclass__": cls,
            "tensors": {n: _encode(getattr(obj, n), f"{path}.{n}", tensors) for n in names},
            "ctx": [_encode_attr(c) for c in ctx],
            "shape": list(obj.shape),
        }
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach()  # stays on its device: written one at a time
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}}
        if all(isinstance(k, int) for k in obj):
            return {"__intdict__": {str(k): _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}}
        raise TypeError(f"cannot store dict with keys of mixed types at {path}")
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {path}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__subclass__" in obj:
            import importlib

            if obj["__subclass__"] not in SUBCLASSES:
                raise CheckpointError(
                    f"The checkpoint names an unknown tensor class {obj['__subclass__']!r}; it is not loaded."
                )
            module, _, name = obj["__subclass__"].rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            inner = {n: _decode(v, tensors) for n, v in obj["tensors"].items()}
            return cls.__tensor_unflatten__(
                inner, [_decode_attr(c) for c in obj["ctx"]], torch.Size(obj["shape"]), None
            )
        if "__dict__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__dict__"].items()}
        if "__intdict__" in obj:
            return {int(k): _decode(v, tensors) for k, v in obj["__intdict__"].items()}
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    return obj


def save_tree(obj: Any, folder: Path, name: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, name, tensors)
    (Path(folder) / f"{name}.json").write_text(json.dumps(tree), encoding="utf-8")
    stream_save_safetensors(Path(folder) / f"{name}.safetensors", tensors)


def load_tree(folder: Path, name: str, device: str | torch.device = "cpu") -> Any:
    folder = Path(folder)
    try:
        tree = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
        read_safetensors_header(
            folder / f"{name}.safetensors"
        )  # an absurd header length is refused before anything is allocated
        tensors = load_file(str(folder / f"{name}.safetensors"), device=str(device))
        return _decode(tree, tensors)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - OSError, bad JSON or header, safetensors' errors, a tree naming what is not there
        raise CheckpointError(
            f"The checkpoint {folder} is incomplete or damaged ({name}: {type(e).__name__}: {e}).",
            hint="Resume from an earlier checkpoint (--resume PATH).",
        ) from None
