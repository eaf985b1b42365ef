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


# ------------------------------------------------------------------ the Wan2.2 VAE (TI2V-5B's), Wan's own names
#
# wan2.2_vae.safetensors (ComfyUI's, and Wan2.2_VAE.pth as Wan-AI ship it) keeps the names of Wan's own module
# (wan/modules/vae2_2.py). diffusers' single-file loader knows the 2.1 VAE only (convert_wan_vae_to_diffusers);
# its conversion script's convert_vae_22 renames the 2.2 one, which is what this follows, per key and both ways.
# Checked against the names and shapes Wan's module has for the real configuration
# (tests/fixtures/wan22_vae_keys.json) and AutoencoderKLWan's in tests/unit/test_wan_layout.py.

_VAE_FIXED = {
    "conv1": "quant_conv",
    "conv2": "post_quant_conv",
    "encoder.conv1": "encoder.conv_in",
    "decoder.conv1": "decoder.conv_in",
    "encoder.head.0": "encoder.norm_out",
    "encoder.head.2": "encoder.conv_out",
    "decoder.head.0": "decoder.norm_out",
    "decoder.head.2": "decoder.conv_out",
}
_VAE_RESIDUAL = {"residual.0": "norm1", "residual.2": "conv1", "residual.3": "norm2", "residual.6": "conv2",
                 "shortcut": "conv_shortcut"}  # fmt: skip
_VAE_MIDDLE = re.compile(r"^(encoder|decoder)\.middle\.(\d)\.(.+)$")
_VAE_STAGE = re.compile(r"^(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(downsamples|upsamples)\.(\d+)\.(.+)$")
_VAE_STAGE_D = re.compile(
    r"^(encoder\.down_blocks|decoder\.up_blocks)\.(\d+)\.(resnets\.(\d+)|downsampler|upsampler)\.(.+)$"
)
_VAE_MIDDLE_D = re.compile(r"^(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.+)$")


def is_wan22_vae(keys) -> bool:
    """Wan's own 2.2 VAE names: each encoder stage's blocks under ``downsamples.N.downsamples.M``."""
    return any(_VAE_STAGE.match(k) for k in keys)


def vae22_to_diffusers(key: str) -> str | None:
    """A Wan2.2 VAE key in Wan's names as AutoencoderKLWan names it (None: not one of its tensors)."""
    path, _, param = key.rpartition(".")
    if path in _VAE_FIXED:
        return f"{_VAE_FIXED[path]}.{param}"
    if m := _VAE_MIDDLE.match(key):
        side, i, rest = m.groups()
        if i == "1":  # the attention between the two resnets
            return f"{side}.mid_block.attentions.0.{rest}"
        sub, _, p = rest.rpartition(".")
        if sub in _VAE_RESIDUAL:
            return f"{side}.mid_block.resnets.{int(i) // 2}.{_VAE_RESIDUAL[sub]}.{p}"
        return None
    if m := _VAE_STAGE.match(key):
        top, stage, _, j, rest = m.groups()
        blocks = "encoder.down_blocks" if top.startswith("encoder") else "decoder.up_blocks"
        sub, _, p = rest.rpartition(".")
        if sub in _VAE_RESIDUAL:
            return f"{blocks}.{stage}.resnets.{j}.{_VAE_RESIDUAL[sub]}.{p}"
        if rest.startswith(("resample.", "time_conv.")):  # the stage's resampler, whatever its index there
            return f"{blocks}.{stage}.{'downsampler' if top.startswith('encoder') else 'upsampler'}.{rest}"
        return None
    return None


def vae22_to_original(key: str, num_res_blocks: int) -> str | None:
    """The way back (for tests and files written in Wan's names). A stage's resampler follows its resnets in Wan's
    module: the encoder's ``num_res_blocks``, the decoder's one more."""
    path, _, param = key.rpartition(".")
    back, res = _invert(_VAE_FIXED), _invert(_VAE_RESIDUAL)
    if path in back:
        return f"{back[path]}.{param}"
    if m := _VAE_MIDDLE_D.match(key):
        side, kind, i, rest = m.groups()
        if kind == "attentions":
            return f"{side}.middle.1.{rest}"
        sub, _, p = rest.rpartition(".")
        return f"{side}.middle.{int(i) * 2}.{res[sub]}.{p}" if sub in res else None
    if m := _VAE_STAGE_D.match(key):
        top, stage, _, j, rest = m.groups()
        orig, inner = (
            ("encoder.downsamples", "downsamples") if top.startswith("encoder") else ("decoder.upsamples", "upsamples")
        )
        if j is not None:
            sub, _, p = rest.rpartition(".")
            return f"{orig}.{stage}.{inner}.{j}.{res[sub]}.{p}" if sub in res else None
        after = num_res_blocks if top.startswith("encoder") else num_res_blocks + 1
        return f"{orig}.{stage}.{inner}.{after}.{rest}"
    return None
