"""The LDM autoencoder's single-file names (``first_stage_model.*``), which SDXL, SD3 and Flux files share, and the
two-way prefix renaming the families' single-file layouts are built from.

The VAE of an SDXL, SD3 or Flux single file is the LDM ``AutoencoderKL`` (SD3 and Flux keep its names under their
own prefixes); diffusers' ``AutoencoderKL`` holds the same weights under other names. Facts about the layout follow
diffusers' ``loaders/single_file_utils.py`` (``convert_ldm_vae_checkpoint``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping

import torch

from ..errors import CheckpointError, ModelLoadError

#: the VAE's prefix in a single file
VAE_PREFIX = "first_stage_model."

# How many names an error message lists before "...".
SHOW = 8


class PrefixMap:
    """Two-way key renaming built from module-level rules.

    A rule maps a diffusers module path to an original module path, e.g.
    ``down_blocks.0.resnets.1`` <-> ``input_blocks.2.0``. Everything after the
    module path is kept, unless the rule carries ``inner`` renames for the first
    component(s) of the rest (e.g. resnet ``norm1`` <-> ``in_layers.0``); then
    the rest must start with one of them, or the key is unmapped.
    A key is matched against its longest registered module path.
    """

    def __init__(self) -> None:
        self._to_orig: dict[str, tuple[str, dict[str, str] | None]] = {}
        self._to_diff: dict[str, tuple[str, dict[str, str] | None]] = {}

    def add(self, diffusers: str, original: str, inner: Mapping[str, str] | None = None) -> None:
        self._to_orig[diffusers] = (original, dict(inner) if inner is not None else None)
        self._to_diff[original] = (diffusers, {v: k for k, v in inner.items()} if inner is not None else None)

    def to_original(self, key: str) -> str | None:
        return self._lookup(self._to_orig, key)

    def to_diffusers(self, key: str) -> str | None:
        return self._lookup(self._to_diff, key)

    @staticmethod
    def _lookup(table: dict[str, tuple[str, dict[str, str] | None]], key: str) -> str | None:
        parts = key.split(".")
        # Always leave at least the parameter name ("weight", "bias") as rest.
        for n in range(len(parts) - 1, 0, -1):
            hit = table.get(".".join(parts[:n]))
            if hit is None:
                continue
            target, inner = hit
            rest = parts[n:]
            if inner is None:
                return ".".join([target, *rest])
            for m in range(len(rest) - 1, 0, -1):
                sub = inner.get(".".join(rest[:m]))
                if sub is not None:
                    return ".".join([target, sub, *rest[m:]])
        return None


# Resnet and attention sub-module names of the VAE, diffusers -> original.
VAE_RESNET = {
    "norm1": "norm1",
    "conv1": "conv1",
    "norm2": "norm2",
    "conv2": "conv2",
    "conv_shortcut": "nin_shortcut",
}
# The VAE mid-block attention (diffusers Attention with group_norm) <-> LDM AttnBlock.
VAE_ATTENTION = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}
# LDM's AttnBlock uses 1x1 convs ([C, C, 1, 1]); diffusers uses Linear ([C, C]).
VAE_ATTN_CONV = re.compile(r"(^|\.)mid\.attn_1\.(q|k|v|proj_out)\.weight$")


def unsupported(component: str, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"The {component} config has {what}, which the SDXL single-file layout cannot express.",
        hint="Only SDXL-shaped architectures convert to/from the single-file layout; use a diffusers folder instead.",
    )


def config_json(config: Mapping) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def unmapped_error(component: str, keys: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{len(keys)} {component} weights have no place in the SDXL single-file layout: {few(keys)}",
        hint="The component does not have the SDXL architecture its config describes; save it as a diffusers folder instead.",
    )


def few(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:SHOW])
    return shown + (f", ... ({len(keys) - SHOW} more)" if len(keys) > SHOW else "")


@functools.lru_cache(maxsize=8)
def vae_map(config_json: str) -> PrefixMap:
    """AutoencoderKL <-> LDM AutoencoderKL, from the diffusers config."""
    cfg = json.loads(config_json)
    down_types = list(cfg["down_block_types"])
    up_types = list(cfg["up_block_types"])
    for t in down_types:
        if t != "DownEncoderBlock2D":
            raise unsupported("vae", f"down block type {t!r}")
    for t in up_types:
        if t != "UpDecoderBlock2D":
            raise unsupported("vae", f"up block type {t!r}")
    layers = cfg.get("layers_per_block", 2)
    if not isinstance(layers, int):
        raise unsupported("vae", f"layers_per_block={layers!r}")

    m = PrefixMap()
    for part in ("encoder", "decoder"):
        m.add(f"{part}.conv_in", f"{part}.conv_in")
        m.add(f"{part}.conv_norm_out", f"{part}.norm_out")
        m.add(f"{part}.conv_out", f"{part}.conv_out")
        m.add(f"{part}.mid_block.resnets.0", f"{part}.mid.block_1", VAE_RESNET)
        m.add(f"{part}.mid_block.resnets.1", f"{part}.mid.block_2", VAE_RESNET)
        if cfg.get("mid_block_add_attention", True):
            m.add(f"{part}.mid_block.attentions.0", f"{part}.mid.attn_1", VAE_ATTENTION)

    n_down = len(down_types)
    for i in range(n_down):
        for j in range(layers):
            m.add(f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.block.{j}", VAE_RESNET)
        if i < n_down - 1:
            m.add(f"encoder.down_blocks.{i}.downsamplers.0.conv", f"encoder.down.{i}.downsample.conv")

    # LDM's decoder numbers its levels by resolution (up.0 = full resolution,
    # built last); diffusers numbers them in execution order. Each decoder
    # level has layers+1 resnets; all but the last (diffusers order) upsample.
    n_up = len(up_types)
    for i in range(n_up):
        level = n_up - 1 - i
        for j in range(layers + 1):
            m.add(f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up.{level}.block.{j}", VAE_RESNET)
        if i < n_up - 1:
            m.add(f"decoder.up_blocks.{i}.upsamplers.0.conv", f"decoder.up.{level}.upsample.conv")

    if cfg.get("use_quant_conv", True):
        m.add("quant_conv", "quant_conv")
    if cfg.get("use_post_quant_conv", True):
        m.add("post_quant_conv", "post_quant_conv")
    return m


def vae_to_original(sd: Mapping[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in the single file's names, under ``first_stage_model.`` (its
    attention's Linear weights as the 1x1 convolutions LDM stores)."""
    m = vae_map(config_json(config))
    out, bad = {}, []
    for k, v in sd.items():
        ok = m.to_original(k)
        if ok is None:
            bad.append(k)
            continue
        if VAE_ATTN_CONV.search(ok) and v.ndim == 2:
            v = v.reshape(*v.shape, 1, 1)  # Linear [C, C] -> 1x1 conv [C, C, 1, 1]
        out[VAE_PREFIX + ok] = v
    if bad:
        raise unmapped_error("vae", bad)
    return out
