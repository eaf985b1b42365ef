"""The Krea 2 transformer's original names (Krea's .safetensors, ComfyUI's copies, the LoRAs ComfyUI loads) and
diffusers' Krea2Transformer2DModel names, both ways.

Renamed tensor for tensor: a prefix of the top-level modules (``first.`` is ``img_in.``, ``blocks.`` is
``transformer_blocks.``, ``txtfusion.`` is ``text_fusion.`` ...) and the names inside blocks (``attn.wq`` is
``attn.to_q``, ``mlp.`` is ``ff.``, ``prenorm.scale`` is ``norm1.weight`` ...). One reshape: a block's six modulation
vectors are one flat tensor in the original (``mod.lin``), diffusers' ``scale_shift_table`` [6, width]. The table
is diffusers' own (``convert_krea2_transformer_checkpoint_to_diffusers``), checked against it in
tests/unit/test_krea2_family.py; ours goes both ways and one module path at a time (a LoRA's names in the original
layout), and loading streams one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

#: a file's transformer keys may carry this prefix (ComfyUI's one-file checkpoints)
PREFIX = "model.diffusion_model."
#: the key that tells a Krea 2 transformer file (diffusers' CHECKPOINT_KEY_NAMES["krea2"]); Raw and Turbo share it
MARKER = "txtfusion.projector.weight"

_TOP = (
    ("first.", "img_in."),
    ("tmlp.0.", "time_embed.linear_1."),
    ("tmlp.2.", "time_embed.linear_2."),
    ("tproj.1.", "time_mod_proj."),
    ("txtmlp.0.scale", "txt_in.norm.weight"),
    ("txtmlp.1.", "txt_in.linear_1."),
    ("txtmlp.3.", "txt_in.linear_2."),
    ("txtfusion.", "text_fusion."),
    ("blocks.", "transformer_blocks."),
    ("last.linear.", "final_layer.linear."),
    ("last.norm.scale", "final_layer.norm.weight"),
    ("last.modulation.lin", "final_layer.scale_shift_table"),
)
_INNER = (
    (".attn.wq.", ".attn.to_q."),
    (".attn.wk.", ".attn.to_k."),
    (".attn.wv.", ".attn.to_v."),
    (".attn.wo.", ".attn.to_out.0."),
    (".attn.gate.", ".attn.to_gate."),
    (".attn.qknorm.qnorm.scale", ".attn.norm_q.weight"),
    (".attn.qknorm.knorm.scale", ".attn.norm_k.weight"),
    (".mlp.", ".ff."),
    (".prenorm.scale", ".norm1.weight"),
    (".postnorm.scale", ".norm2.weight"),
    (".mod.lin", ".scale_shift_table"),
)


def is_krea2_file(keys: Sequence[str]) -> bool:
    names = {k.removeprefix(PREFIX) for k in keys}
    return MARKER in names and any(k.startswith("blocks.0.attn.wq") for k in names)


def to_diffusers(key: str) -> str:
    """The diffusers name of an original key (``model.diffusion_model.`` stripped)."""
    key = key.removeprefix(PREFIX)
    for a, b in _TOP:
        if key.startswith(a):
            key = b + key[len(a) :]
            break
    for a, b in _INNER:
        key = key.replace(a, b)
    return key


def to_original(key: str) -> str:
    """The original name of a diffusers key (a parameter, or a module path with a ``.weight``-like leaf)."""
    for a, b in _INNER:
        key = key.replace(b, a)
    for a, b in _TOP:
        if key.startswith(b):
            return a + key[len(b) :]
    return key


def module_to_original(path: str) -> str:
    """A module path in the original names (a LoRA's names in ComfyUI's Krea 2 layout)."""
    return to_original(path + ".weight").removesuffix(".weight")


def _block_table(name: str) -> bool:
    return name.startswith("transformer_blocks.") and name.endswith(".scale_shift_table")


def transformer_tensors(
    names: Sequence[str], read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(diffusers name, tensor) of a file's transformer tensors, each read when its turn comes (a block's flat
    modulation reshaped to [6, width])."""
    for k in names:
        d = to_diffusers(k)
        t = read(k)
        yield d, (t.reshape(6, -1) if _block_table(d) else t)


def _maker(v: torch.Tensor, flat: bool) -> Callable[[], torch.Tensor]:
    return lambda: v.reshape(-1) if flat else v


def to_single_file(sd: dict) -> dict:
    """A diffusers transformer state dict in the original names, as makers (LazyTensors)."""
    return {to_original(k): _maker(v, _block_table(k)) for k, v in sd.items()}
