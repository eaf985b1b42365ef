"""FLUX.2 [dev]'s Mistral 3 text encoder from the single file ComfyUI users have (Comfy-Org/flux2-dev's
``mistral_3_small_flux2_bf16.safetensors``, fp8-scaled copies too) as a folder transformers reads.

The file's names are those of a Mistral causal LM (``model.layers.N...``, ``model.embed_tokens``, ``model.norm``,
``lm_head``) beside the vision tower and projector at the top level, and the tokenizer as a byte tensor
(``tekken_model``); older copies use transformers 4's multimodal names (``language_model.model.layers.N...``). Both
are what other loaders of these files rename (VideoX-Fun's ComfyUI nodes; read 2026-11-28), to transformers 5's
``Mistral3ForConditionalGeneration`` names (``model.language_model.layers.N...``, ``model.vision_tower...``).

Why a folder on disk rather than a state dict: a state dict in host memory would hold the 19 B parameters precompute
runs in bf16 (38 GB) before bitsandbytes quantizes them, more than a 32 GB desktop has. transformers reads a sharded
folder one shard at a time, quantizing as it goes; so the file is rewritten once, a few layers a shard (each tensor
read, renamed, written), next to it, and removed after the load. The layers after the deepest one the pipeline takes
(``precompute_layers``) are not written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelLoadError
from .. import common

#: bytes of tensors a shard holds at most (a few of Mistral-Small-3's 0.6 GB layers)
SHARD_BYTES = 2 << 30
_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")
#: ComfyUI's names -> transformers 5's (first match wins)
_RENAMES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model.language_model."),
    ("model.vision_tower.", "model.vision_tower."),
    ("model.multi_modal_projector.", "model.multi_modal_projector."),
    ("model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("lm_head.", "lm_head."),
)


def transformers_name(key: str) -> str | None:
    """A Mistral 3 file's key in transformers 5's Mistral3ForConditionalGeneration names; None for what is not a
    weight of it (``tekken_model``, the tokenizer as bytes) or a name no Mistral 3 file has."""
    for old, new in _RENAMES:
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def is_mistral3_file(keys: Sequence[str]) -> bool:
    """The file holds a Mistral language model's layers (under any of the names above)."""
    return any((n := transformers_name(k)) is not None and _LAYER.match(n) for k in keys)


def _tensors(keys: Sequence[str], keep: int) -> Iterator[tuple[str, str]]:
    """(file key, transformers name) of each tensor to write: the layers below ``keep`` and everything else."""
    for k in keys:
        name = transformers_name(k)
        if name is None:
            continue
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) >= keep:
            continue
        yield k, name


def write_folder(f: Path, config: Mapping[str, Any], keep: int, dest: Path, dtype: torch.dtype) -> None:
    """``dest``/text_encoder: config.json and the file's tensors renamed, in shards of at most SHARD_BYTES (one
    tensor in host memory at a time beside the shard being filled), layers from ``keep`` on left out."""
    from safetensors.torch import save_file

    keys, get, _, _ = common.open_checkpoint("single", f)
    if not is_mistral3_file(keys):
        raise ModelLoadError(
            f"model.text_encoder {f.name} does not look like FLUX.2 [dev]'s Mistral 3 (no model.layers.N or "
            "language_model.model.layers.N tensors).",
            hint="Give mistral_3_small_flux2_bf16.safetensors (or its fp8 copy) from Comfy-Org/flux2-dev, or set "
            "model.path to a diffusers FLUX.2 [dev] folder.",
        )
    keys, read = common.scaled_fp8(keys, get)  # fp8-scaled copies: each weight times its scale
    out = dest / "text_encoder"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    shard: dict[str, torch.Tensor] = {}
    size, n, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, n = {}, 0, n + 1

    for k, name in _tensors(keys, keep):
        t = read(k)
        t = t.to(dtype) if t.is_floating_point() else t
        shard[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


PREFIX = ".difftrain-mistral3-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's process, or a system that cannot tell: left alone
    return True


def remove_stale(folder: Path) -> list[Path]:
    """The rewritten folders in ``folder`` whose process is gone (a run killed while loading would leave its ~38 GB
    copy behind): removed; the ones of a running process are left to it."""
    gone = []
    for d in folder.glob(PREFIX + "*"):
        try:
            pid = int((d / "pid").read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being made
        if not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


@contextmanager
def as_folder(f: Path, config: Mapping[str, Any], keep: int, dtype: torch.dtype) -> Iterator[Path]:
    """The file rewritten as a folder (``write_folder``) next to it (where its own disk has room for its copy; the
    system's temporary folder where that is not writable), removed when the block ends; a killed run's leftover
    beside it is removed first (``remove_stale``)."""
    remove_stale(f.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=PREFIX, dir=f.parent))
    except OSError:
        tmp = Path(tempfile.mkdtemp(prefix=PREFIX.lstrip(".")))
    try:
        (tmp / "pid").write_text(str(os.getpid()))
        write_folder(f, config, keep, tmp, dtype)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
