"""The Wan transformer's original names (Wan-AI's .safetensors and .pth files, ComfyUI's repackaged ones, the
LoRAs musubi-tuner and diffusion-pipe write) and diffusers' WanTransformer3DModel names, both ways.

The base transformer is renamed tensor for tensor: nothing is split, fused or reshaped (the Animate and VACE
variants' extra modules are not covered). One oddity: the original ``norm3`` (before the cross-attention) is
diffusers' ``norm2`` and the original ``norm2`` (before the feed-forward) is diffusers' ``norm3``. Checked against
diffusers' own converter (``single_file_utils.convert_wan_transformer_to_diffusers``) for every bundled
architecture in tests/unit/test_wan_layout.py. Ours rather than diffusers': that one goes one way (files to
diffusers) and works on whole state dicts; exporting a LoRA in the original names needs the way back, one module
path at a time, and loading streams one tensor at a time (families/streaming.py).
"""

from __future__ import annotations

import re

#: a file's transformer keys may carry this prefix (ComfyUI's one-file checkpoints)
PREFIX = "model.diffusion_model."

#: module paths outside the blocks: original -> diffusers
_TOP = {
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
    "head.head": "proj_out",
    "patch_embedding": "patch_embedding",
}
#: parameters outside the blocks that are not a module's weight or bias: original -> diffusers
_TOP_PARAMS = {"head.modulation": "scale_shift_table", "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}
#: module paths inside ``blocks.N.``: original -> diffusers
_ATTN = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"), ("norm_k", "norm_k"))
_BLOCK = {
    **{f"{a}.{p}": f"{b}.{q}" for a, b in (("self_attn", "attn1"), ("cross_attn", "attn2")) for p, q in _ATTN},
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "norm2": "norm3",
    "norm3": "norm2",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_BLOCK_PARAMS = {"modulation": "scale_shift_table"}
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _rename(path: str, modules: dict[str, str], params: dict[str, str]) -> str | None:
    if path in params:
        return params[path]
    module, _, leaf = path.rpartition(".")
    return f"{modules[module]}.{leaf}" if module in modules else None


def _invert(d: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in d.items()}


def to_diffusers(key: str) -> str | None:
    """The diffusers name of an original transformer key (``model.diffusion_model.`` stripped), None for a key the
    base transformer does not have."""
    key = key.removeprefix(PREFIX)
    m = _BLOCK_KEY.match(key)
    if m:
        inner = _rename(m.group(2), _BLOCK, _BLOCK_PARAMS)
        return None if inner is None else f"blocks.{m.group(1)}.{inner}"
    return _rename(key, _TOP, _TOP_PARAMS)


def to_original(key: str) -> str | None:
    """The original name of a diffusers transformer key (a parameter, or a module path with a ``.weight``-like
    leaf), None for one the original layout does not have."""
    m = _BLOCK_KEY.match(key)
    if m:
        inner = _rename(m.group(2), _invert(_BLOCK), _invert(_BLOCK_PARAMS))
        return None if inner is None else f"blocks.{m.group(1)}.{inner}"
    return _rename(key, _invert(_TOP), _invert(_TOP_PARAMS))


def is_wan_file(keys: list[str]) -> bool:
    """A Wan transformer's keys (with or without the prefix): its head's modulation and its patch embedding."""
    names = {k.removeprefix(PREFIX) for k in keys}
    return "head.modulation" in names and "patch_embedding.weight" in names
