"""The Flux.2 transformer's original names (Black Forest Labs' flux2-dev.safetensors and flux-2-klein-*.safetensors,
ComfyUI's copies, the LoRAs ComfyUI loads) and diffusers' Flux2Transformer2DModel names, both ways.

Renamed tensor for tensor except three places: a double block's attention q, k and v are one fused ``qkv`` per
stream (``img_attn.qkv`` is diffusers' to_q/to_k/to_v, ``txt_attn.qkv`` its add_q/k/v_proj, stacked on the output
rows); the final layer's modulation (``final_layer.adaLN_modulation.1``, diffusers' ``norm_out.linear``) has its two
halves in the other order (shift, scale against diffusers' scale, shift); the q/k norms' ``.scale`` is diffusers'
``.weight``. The single blocks' fused projections are one module in both (``linear1`` is ``attn.to_qkv_mlp_proj``,
``linear2`` ``attn.to_out``). The table is diffusers' own (``convert_flux2_transformer_checkpoint_to_diffusers``),
checked against it in tests/unit/test_flux2_family.py. Ours rather than diffusers': that one goes one way and takes a
whole state dict; loading streams one tensor at a time (families/streaming.py) and a LoRA's names need the way back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

import torch

#: a file's transformer keys may carry this prefix (ComfyUI's one-file checkpoints)
PREFIX = "model.diffusion_model."
#: the key that tells a Flux.2 transformer file from FLUX.1's (diffusers' CHECKPOINT_KEY_NAMES["flux2"]): the
#: modulation shared by all single blocks (FLUX.1 has one per block)
MARKER = "single_stream_modulation.lin.weight"

#: top-level modules, diffusers -> original
_TOP = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
#: a double block's modules, diffusers -> original (within ``transformer_blocks.N.`` / ``double_blocks.N.``)
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
#: a double block's fused q/k/v, original -> its diffusers members in the order the fused weight stacks them
QKV = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_MEMBERS = {m: fused for fused, members in QKV.items() for m in members}
#: a single block's modules, diffusers -> original (within ``single_transformer_blocks.N.`` / ``single_blocks.N.``)
_SINGLE = {
    "attn.to_qkv_mlp_proj": "linear1",
    "attn.to_out": "linear2",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
}
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_ORIG_BLOCK = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")
_TOP_BACK = {v: k for k, v in _TOP.items()}
_DOUBLE_BACK = {v: k for k, v in _DOUBLE.items()}
_SINGLE_BACK = {v: k for k, v in _SINGLE.items()}
#: the final modulation whose halves are swapped between the layouts
_SWAPPED = "norm_out.linear.weight"


def is_flux2_file(keys: Sequence[str]) -> bool:
    names = {k.removeprefix(PREFIX) for k in keys}
    return MARKER in names and any(k.startswith(("double_blocks.", "single_blocks.")) for k in names)


def block_counts(keys: Sequence[str]) -> tuple[int, int]:
    """(double blocks, single blocks) of a file's transformer."""
    names = [k.removeprefix(PREFIX) for k in keys]
    doubles = {int(k.split(".")[1]) for k in names if k.startswith("double_blocks.")}
    singles = {int(k.split(".")[1]) for k in names if k.startswith("single_blocks.")}
    return len(doubles), len(singles)


def module_to_original(path: str) -> str | None:
    """A diffusers module path in the original names (a LoRA's kohya names); None for the members of a fused
    ``qkv`` (:data:`QKV`) and for what has no original name."""
    m = _BLOCK.match(path)
    if m is None:
        return _TOP.get(path)
    kind, i, rest = m.groups()
    table = _DOUBLE if kind == "transformer_blocks" else _SINGLE
    name = table.get(rest)
    if name is None:
        return None
    return f"{'double_blocks' if kind == 'transformer_blocks' else 'single_blocks'}.{i}.{name}"


def module_to_diffusers(path: str) -> str | None:
    """An original module path in diffusers' names; None for a fused ``qkv`` and for what diffusers has not."""
    m = _ORIG_BLOCK.match(path)
    if m is None:
        return _TOP_BACK.get(path)
    kind, i, rest = m.groups()
    table = _DOUBLE_BACK if kind == "double_blocks" else _SINGLE_BACK
    name = table.get(rest)
    if name is None:
        return None
    return f"{'transformer_blocks' if kind == 'double_blocks' else 'single_transformer_blocks'}.{i}.{name}"


def fused_qkv(paths: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Original ``double_blocks.N.{img,txt}_attn.qkv`` -> its diffusers members, for every double block among
    ``paths`` (diffusers module paths)."""
    out: dict[str, tuple[str, ...]] = {}
    for p in paths:
        m = _BLOCK.match(p)
        if m is None or m.group(1) != "transformer_blocks" or m.group(3) not in _MEMBERS:
            continue
        i, fused = m.group(2), _MEMBERS[m.group(3)]
        out[f"double_blocks.{i}.{fused}"] = tuple(f"transformer_blocks.{i}.{x}" for x in QKV[fused])
    return out


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _split_param(key: str) -> tuple[str, str]:
    module, _, leaf = key.rpartition(".")
    return module, leaf


def transformer_tensors(
    names: Sequence[str], read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(diffusers name, tensor) of a file's transformer tensors, each read by ``read`` only when its turn comes (the
    load streams them one at a time): a fused ``qkv`` split into its three thirds, the final modulation's halves
    swapped, a norm's ``scale`` named ``weight``. A name with no diffusers place is yielded as it is (the fill names
    it as unexpected)."""
    for k in names:
        module, leaf = _split_param(k.removeprefix(PREFIX))
        m = _ORIG_BLOCK.match(module)
        if m is not None and m.group(1) == "double_blocks" and m.group(3) in QKV:
            thirds = read(k).chunk(3, dim=0)
            for member, t in zip(QKV[m.group(3)], thirds):
                yield f"transformer_blocks.{m.group(2)}.{member}.{leaf}", t
            continue
        d = module_to_diffusers(module)
        if d is None:
            yield k, read(k)
            continue
        name = f"{d}.{'weight' if leaf == 'scale' else leaf}"
        t = read(k)
        yield name, (_swap_halves(t) if name == _SWAPPED else t)


def to_single_file(sd: dict) -> dict:
    """A diffusers transformer state dict in the original names, as makers (LazyTensors): each fused ``qkv``
    concatenates its thirds only when it is written."""
    out: dict = {}
    for k, v in sd.items():
        module, leaf = _split_param(k)
        m = _BLOCK.match(module)
        if m is not None and m.group(1) == "transformer_blocks" and m.group(3) in _MEMBERS:
            fused = _MEMBERS[m.group(3)]
            if m.group(3) != QKV[fused][0]:
                continue
            i = m.group(2)
            members = [f"transformer_blocks.{i}.{x}.{leaf}" for x in QKV[fused]]
            out[f"double_blocks.{i}.{fused}.{leaf}"] = lambda members=members: torch.cat(
                [sd[x] for x in members], dim=0
            )
            continue
        o = module_to_original(module)
        if o is None:
            raise KeyError(f"{k} has no place in the Flux.2 original layout")
        is_norm = o.endswith(("query_norm", "key_norm"))
        name = f"{o}.{'scale' if is_norm and leaf == 'weight' else leaf}"
        out[name] = (lambda v=v: _swap_halves(v)) if k == _SWAPPED else (lambda v=v: v)
    return out
