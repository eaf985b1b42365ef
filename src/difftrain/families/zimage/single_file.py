"""The Z-Image transformer's original names (Tongyi-MAI's .safetensors, ComfyUI's z_image_*.safetensors, the kohya
LoRAs ComfyUI loads) and diffusers' ZImageTransformer2DModel names, both ways.

Renamed tensor for tensor except the attention's fused ``qkv``, which is diffusers' ``to_q``, ``to_k`` and ``to_v``
stacked on the output rows. The rest: ``x_embedder`` / ``final_layer`` are diffusers' ``all_x_embedder.2-1`` /
``all_final_layer.2-1`` (its one patch size), ``attention.out`` is ``attention.to_out.0``, ``q_norm`` / ``k_norm``
are ``norm_q`` / ``norm_k``; a stray ``norm_final.weight`` (some exports) belongs to no module and is dropped.
Checked against diffusers' own converter (``convert_z_image_transformer_checkpoint_to_diffusers``) in
tests/unit/test_zimage_family.py. Ours rather than diffusers': that one goes one way and takes a whole state dict;
loading streams one tensor at a time (families/streaming.py) and a LoRA's kohya names need the way back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

import torch

#: a file's transformer keys may carry this prefix (ComfyUI's one-file checkpoints)
PREFIX = "model.diffusion_model."
#: the key that tells a Z-Image transformer file (diffusers' CHECKPOINT_KEY_NAMES["z-image-turbo"]); base and Turbo
#: share it
MARKER = "layers.0.adaLN_modulation.0.weight"
#: Z-Image's learned pad tokens: with MARKER and the caption embedder, what tells its files from other DiTs of the
#: same ``layers.N.attention.qkv`` layout (Lumina 2)
_PAD_TOKENS = ("x_pad_token", "cap_pad_token")

_TOP = (("x_embedder.", "all_x_embedder.2-1."), ("final_layer.", "all_final_layer.2-1."))
_ATTN = ((".attention.out.", ".attention.to_out.0."), (".attention.q_norm.", ".attention.norm_q."),
         (".attention.k_norm.", ".attention.norm_k."))  # fmt: skip
_QKV = re.compile(r"^(.*\.attention)\.qkv\.weight$")
_SPLIT = re.compile(r"^(.*\.attention)\.to_([qkv])\.weight$")
#: a member of a fused qkv: its weight, or its module path
_MEMBER = re.compile(r"\.attention\.to_[qkv](\.|$)")
DROPPED = ("norm_final.weight",)


def is_zimage_file(keys: Sequence[str]) -> bool:
    names = {k.removeprefix(PREFIX) for k in keys}
    return MARKER in names and "cap_embedder.1.weight" in names and all(k in names for k in _PAD_TOKENS)


def to_diffusers(key: str) -> str | None:
    """The diffusers name of an original key (``model.diffusion_model.`` stripped); None for the fused ``qkv``
    (split by :func:`transformer_tensors`) and for a dropped key."""
    key = key.removeprefix(PREFIX)
    if key in DROPPED or _QKV.match(key):
        return None
    for a, b in _TOP:
        if key.startswith(a):
            return b + key[len(a) :]
    for a, b in _ATTN:
        key = key.replace(a, b)
    return key


def to_original(key: str) -> str | None:
    """The original name of a diffusers key (or module path with a leaf); None for ``to_q``/``to_k``/``to_v``
    (one fused ``qkv`` there: :func:`fused_qkv`)."""
    if _MEMBER.search(key):
        return None
    for a, b in _TOP:
        if key.startswith(b):
            return a + key[len(b) :]
    for a, b in _ATTN:
        key = key.replace(b, a)
    return key


def module_to_original(path: str) -> str | None:
    """A module path in the original names (kohya LoRA names); None for the members of a fused ``qkv``."""
    o = to_original(path + ".weight")
    return None if o is None else o.removesuffix(".weight")


def fused_qkv(paths: Sequence[str]) -> dict[str, tuple[str, str, str]]:
    """Original ``...attention.qkv`` module path -> its diffusers members (to_q, to_k, to_v), for every attention
    among ``paths`` (diffusers module paths)."""
    out = {}
    for p in paths:
        if p.endswith(".attention.to_q"):
            base = p.removesuffix(".to_q")
            out[f"{base}.qkv"] = (f"{base}.to_q", f"{base}.to_k", f"{base}.to_v")
    return out


def transformer_tensors(
    names: Sequence[str], read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(diffusers name, tensor) of a file's transformer tensors, each read by ``read`` only when its turn comes (the
    load streams them one at a time): a fused ``qkv`` weight is split into its three thirds (views of it)."""
    for k in names:
        m = _QKV.match(k.removeprefix(PREFIX))
        if m:
            q, kk, v = read(k).chunk(3, dim=0)
            yield f"{m.group(1)}.to_q.weight", q
            yield f"{m.group(1)}.to_k.weight", kk
            yield f"{m.group(1)}.to_v.weight", v
            continue
        d = to_diffusers(k)
        if d is not None:
            yield d, read(k)


def to_single_file(sd: dict) -> dict:
    """A diffusers transformer state dict in the original names, as makers (LazyTensors): each fused ``qkv``
    concatenates its thirds only when it is written."""
    out: dict = {}
    for k, v in sd.items():
        m = _SPLIT.match(k)
        if m:
            if m.group(2) == "q":
                base = m.group(1)
                out[f"{base}.qkv.weight"] = lambda base=base: torch.cat(
                    [sd[f"{base}.to_{x}.weight"] for x in "qkv"], dim=0
                )
            continue
        o = to_original(k)
        if o is not None:
            out[o] = lambda v=v: v
    return out
