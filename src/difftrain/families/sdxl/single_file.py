"""SDXL single-file checkpoints <-> diffusers/transformers component state dicts.

SDXL is distributed as one ``.safetensors`` file in Stability's SGM/LDM layout
(``sd_xl_base_1.0.safetensors``; what sd-scripts, A1111 and ComfyUI load):

    model.diffusion_model.*                     UNet (openaimodel naming)
    first_stage_model.*                         VAE (LDM autoencoder naming)
    conditioner.embedders.0.transformer.*       CLIP-L, transformers naming
    conditioner.embedders.1.model.*             OpenCLIP bigG, open_clip naming

diffusers keeps the same weights per component under other names. This module
renames in both directions. The renaming is derived from the component configs
(number of blocks, layers per block, which blocks carry attention), so the same
code serves the real SDXL architecture and the tiny test one. Facts about the
original layout follow diffusers' ``loaders/single_file_utils.py``
(``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``,
``convert_open_clip_checkpoint``) and sd-scripts' ``library/sdxl_model_util.py``.

Reading is lazy: ``original_to_diffusers`` takes a ``get(key)`` callable (for
example ``safe_open(...).get_tensor``), checks the key names against the
expected set first (without reading any tensor), then reads one tensor at a
time, so the file's tensors are never all held twice.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from ...errors import CheckpointError, ModelLoadError
from ..ldm_vae import (
    VAE_ATTN_CONV,
    VAE_PREFIX,
    PrefixMap,
    config_json,
    few,
    unmapped_error,
    unsupported,
    vae_map,
    vae_to_original,
)

COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")

# File prefix of each component in the single-file layout.
PREFIXES = {
    "unet": "model.diffusion_model.",
    "vae": VAE_PREFIX,
    "text_encoder": "conditioner.embedders.0.transformer.",
    "text_encoder_2": "conditioner.embedders.1.model.",
}

# open_clip stores logit_scale (the CLIP contrastive temperature, unused for
# generation); transformers' text model has no such weight. SDXL ships ln(100).
_LOGIT_SCALE = math.log(100.0)

# ---------------------------------------------------------------------------
# Prefix renaming table
# ---------------------------------------------------------------------------


# Resnet sub-module names, diffusers -> original.
# LDM's UNet ResBlock: in_layers = [GroupNorm, SiLU, Conv], emb_layers = [SiLU,
# Linear], out_layers = [GroupNorm, SiLU, Dropout, Conv]; hence the indices.
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def _per_block(value, n: int, name: str, component: str) -> list[int]:
    """diffusers allows an int or one int per block for layers_per_block."""
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise unsupported(component, f"{name}={value} for {n} blocks")
    return value


@functools.lru_cache(maxsize=8)
def _unet_map(config_json: str) -> PrefixMap:
    """UNet2DConditionModel <-> SGM/LDM openaimodel UNet, from the diffusers config."""
    cfg = json.loads(config_json)
    m = PrefixMap()
    m.add("conv_in", "input_blocks.0.0")
    m.add("time_embedding.linear_1", "time_embed.0")
    m.add("time_embedding.linear_2", "time_embed.2")
    # SDXL's pooled-text + size/crop conditioning (diffusers add_embedding) is
    # label_emb in SGM: Sequential(Sequential(Linear, SiLU, Linear)).
    if cfg.get("addition_embed_type") == "text_time":
        m.add("add_embedding.linear_1", "label_emb.0.0")
        m.add("add_embedding.linear_2", "label_emb.0.2")
    elif cfg.get("class_embed_type") in ("timestep", "projection"):
        m.add("class_embedding.linear_1", "label_emb.0.0")
        m.add("class_embedding.linear_2", "label_emb.0.2")

    down_types = list(cfg["down_block_types"])
    up_types = list(cfg["up_block_types"])
    for t in down_types:
        if t not in ("DownBlock2D", "CrossAttnDownBlock2D"):
            raise unsupported("unet", f"down block type {t!r}")
    for t in up_types:
        if t not in ("UpBlock2D", "CrossAttnUpBlock2D"):
            raise unsupported("unet", f"up block type {t!r}")
    n_down, n_up = len(down_types), len(up_types)
    layers = _per_block(cfg.get("layers_per_block", 2), n_down, "layers_per_block", "unet")

    # input_blocks is one flat list: [conv_in], then per level its
    # (resnet[, transformer]) entries, then a downsampler entry on every level
    # but the last. The downsampler's conv is called `op` in LDM.
    k = 1
    for i, t in enumerate(down_types):
        attn = t.startswith("CrossAttn")
        for j in range(layers[i]):
            m.add(f"down_blocks.{i}.resnets.{j}", f"input_blocks.{k}.0", _UNET_RESNET)
            if attn:
                m.add(f"down_blocks.{i}.attentions.{j}", f"input_blocks.{k}.1")
            k += 1
        if i < n_down - 1:
            m.add(f"down_blocks.{i}.downsamplers.0.conv", f"input_blocks.{k}.0.op")
            k += 1

    # middle_block = [resnet, transformer, resnet].
    mid_type = cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid_type != "UNetMidBlock2DCrossAttn":
        raise unsupported("unet", f"mid block type {mid_type!r}")
    m.add("mid_block.resnets.0", "middle_block.0", _UNET_RESNET)
    m.add("mid_block.attentions.0", "middle_block.1")
    m.add("mid_block.resnets.1", "middle_block.2", _UNET_RESNET)

    # output_blocks: per level (deepest first) layers+1 entries of
    # (resnet[, transformer][, upsampler]); the upsampler sits in the last entry
    # of every level but the last, at index 1 without attention, 2 with it.
    up_layers = list(reversed(layers))
    k = 0
    for i, t in enumerate(up_types):
        attn = t.startswith("CrossAttn")
        for j in range(up_layers[i] + 1):
            m.add(f"up_blocks.{i}.resnets.{j}", f"output_blocks.{k}.0", _UNET_RESNET)
            if attn:
                m.add(f"up_blocks.{i}.attentions.{j}", f"output_blocks.{k}.1")
            if i < n_up - 1 and j == up_layers[i]:
                m.add(f"up_blocks.{i}.upsamplers.0.conv", f"output_blocks.{k}.{2 if attn else 1}.conv")
            k += 1

    # out = [GroupNorm, SiLU, Conv].
    m.add("conv_norm_out", "out.0")
    m.add("conv_out", "out.2")
    return m


# ---------------------------------------------------------------------------
# Text encoders
# ---------------------------------------------------------------------------

# Sub-modules of transformers' CLIP text tower. transformers >= 5.6 flattened
# CLIPTextModel (keys "embeddings.*"), older versions and CLIPTextModelWithProjection
# keep them under "text_model.". Internally we use the flat names and add the
# prefix back where the installed class has it (see _reference_shapes).
_TOWER = ("embeddings.", "encoder.", "final_layer_norm.")
_TEXT_MODEL = "text_model."

# transformers CLIP encoder layer -> open_clip resblock, for the unfused parts.
_OPENCLIP_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "self_attn.out_proj": "attn.out_proj",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_QKV = re.compile(r"^encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_RESBLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.(.+)$")


def _flat_tower_key(key: str) -> str:
    """A CLIP text-tower key without the optional "text_model." prefix."""
    return key[len(_TEXT_MODEL) :] if key.startswith(_TEXT_MODEL) else key


def _openclip_name(key: str) -> str | None:
    """Flat transformers key of CLIPTextModelWithProjection -> open_clip key.

    q/k/v projections all map to the fused in_proj_{weight,bias}.
    """
    fixed = {
        "embeddings.token_embedding.weight": "token_embedding.weight",
        "embeddings.position_embedding.weight": "positional_embedding",
        "final_layer_norm.weight": "ln_final.weight",
        "final_layer_norm.bias": "ln_final.bias",
        "text_projection.weight": "text_projection",
    }
    if key in fixed:
        return fixed[key]
    if mm := _QKV.match(key):
        return f"transformer.resblocks.{mm[1]}.attn.in_proj_{mm[3]}"
    if mm := _LAYER.match(key):
        rest = mm[2]
        for src, dst in _OPENCLIP_LAYER.items():
            if rest.startswith(src + "."):
                return f"transformer.resblocks.{mm[1]}.{dst}{rest[len(src) :]}"
    return None


def _openclip_plan(okey: str) -> tuple[tuple[str, ...], Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] | None:
    """open_clip key -> (flat transformers keys, transform of the tensor into those)."""
    ident = lambda t: (t,)
    fixed = {
        "token_embedding.weight": "embeddings.token_embedding.weight",
        "positional_embedding": "embeddings.position_embedding.weight",
        "ln_final.weight": "final_layer_norm.weight",
        "ln_final.bias": "final_layer_norm.bias",
    }
    if okey in fixed:
        return (fixed[okey],), ident
    if okey == "text_projection":
        # open_clip computes x @ text_projection ([hidden, proj]); nn.Linear stores [proj, hidden].
        return ("text_projection.weight",), lambda t: (t.T.contiguous(),)
    mm = _RESBLOCK.match(okey)
    if mm is None:
        return None
    i, rest = mm[1], mm[2]
    if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
        kind = rest.rsplit("_", 1)[1]
        keys = tuple(f"encoder.layers.{i}.self_attn.{p}_proj.{kind}" for p in "qkv")
        # Clone the three slices so they do not share one storage (safetensors
        # refuses to save tensors that share memory).
        return keys, lambda t: tuple(p.clone() for p in t.chunk(3, dim=0))
    for dst, src in _OPENCLIP_LAYER.items():
        if rest.startswith(src + "."):
            return (f"encoder.layers.{i}.{dst}{rest[len(src) :]}",), ident
    return None


# ---------------------------------------------------------------------------
# Expected diffusers/transformers keys (built on the meta device)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _reference_shapes(component: str, config_json: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the component's state dict, from a model built on the meta device.

    This is the ground truth for which keys a loaded component must have; it
    costs no memory and well under a second even for the real SDXL UNet.
    """
    cfg = json.loads(config_json)
    with torch.device("meta"):
        if component == "unet":
            from diffusers import UNet2DConditionModel

            model = UNet2DConditionModel.from_config(cfg)
        elif component == "vae":
            from diffusers import AutoencoderKL

            model = AutoencoderKL.from_config(cfg)
        else:
            from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

            cls = CLIPTextModel if component == "text_encoder" else CLIPTextModelWithProjection
            model = cls(CLIPTextConfig(**cfg))
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("position_ids")}


def _tower_prefix(reference: Mapping[str, object]) -> str:
    """ "text_model." if the installed transformers class nests the text tower, else ""."""
    return _TEXT_MODEL if any(k.startswith(_TEXT_MODEL) for k in reference) else ""


# ---------------------------------------------------------------------------
# diffusers -> original
# ---------------------------------------------------------------------------


def _require_config(configs: Mapping[str, dict], component: str) -> dict:
    try:
        return configs[component]
    except KeyError:
        raise ModelLoadError(f"No config given for the SDXL {component}.") from None


def _unet_to_original(sd: Mapping[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    m = _unet_map(config_json(config))
    out, bad = {}, []
    for k, v in sd.items():
        ok = m.to_original(k)
        if ok is None:
            bad.append(k)
        else:
            out[PREFIXES["unet"] + ok] = v
    if bad:
        raise unmapped_error("unet", bad)
    return out


def _te1_to_original(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # CLIP-L keeps transformers naming in the file, always under "text_model.".
    out, bad = {}, []
    for k, v in sd.items():
        flat = _flat_tower_key(k)
        if flat.endswith("position_ids"):
            continue
        if not flat.startswith(_TOWER):
            bad.append(k)
            continue
        out[PREFIXES["text_encoder"] + _TEXT_MODEL + flat] = v
    if bad:
        raise unmapped_error("text_encoder", bad)
    return out


def _te2_to_original(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = PREFIXES["text_encoder_2"]
    out: dict[str, torch.Tensor] = {}
    bad: list[str] = []
    fused: dict[str, dict[str, torch.Tensor]] = {}  # in_proj key -> {"q": ..., "k": ..., "v": ...}
    for k, v in sd.items():
        flat = _flat_tower_key(k)
        if flat.endswith("position_ids"):
            continue
        if flat == "logit_scale":  # not a transformers weight, but keep one if the caller has it
            out[prefix + "logit_scale"] = v
            continue
        ok = _openclip_name(flat)
        if ok is None:
            bad.append(k)
        elif mm := _QKV.match(flat):
            fused.setdefault(ok, {})[mm[2]] = v
        elif ok == "text_projection":
            out[prefix + ok] = v.T.contiguous()  # [proj, hidden] -> [hidden, proj]
        else:
            out[prefix + ok] = v
    if bad:
        raise unmapped_error("text_encoder_2", bad)
    for ok, parts in fused.items():
        if set(parts) != {"q", "k", "v"}:
            raise unmapped_error("text_encoder_2", [f"{ok} (has only {sorted(parts)} of q, k, v)"])
        # open_clip's nn.MultiheadAttention packs [q; k; v] along the output dim.
        out[prefix + ok] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    if prefix + "logit_scale" not in out:
        like = out.get(prefix + "text_projection")
        out[prefix + "logit_scale"] = torch.tensor(
            _LOGIT_SCALE,
            dtype=like.dtype if like is not None else torch.float32,
            device=like.device if like is not None else None,
        )
    return out


def diffusers_to_original(
    state_dicts: dict[str, Mapping[str, torch.Tensor]], configs: dict[str, dict]
) -> dict[str, torch.Tensor]:
    """Component state dicts (diffusers/transformers naming) -> one SDXL single-file state dict.

    ``state_dicts`` and ``configs`` are keyed by component name (see COMPONENTS);
    components absent from ``state_dicts`` are skipped (e.g. only unet + vae).
    The UNet and VAE need their diffusers configs; the text encoders do not.
    Tensors are passed through where the layout allows (no copies), except the
    fused open_clip attention projections and the transposed text projection.
    """
    unknown = set(state_dicts) - set(COMPONENTS)
    if unknown:
        raise CheckpointError(f"Unknown SDXL components {sorted(unknown)}; expected some of {list(COMPONENTS)}.")
    out: dict[str, torch.Tensor] = {}
    for component in COMPONENTS:
        sd = state_dicts.get(component)
        if sd is None:
            continue
        if component == "unet":
            out.update(_unet_to_original(sd, _require_config(configs, "unet")))
        elif component == "vae":
            out.update(vae_to_original(sd, _require_config(configs, "vae")))
        elif component == "text_encoder":
            out.update(_te1_to_original(sd))
        else:
            out.update(_te2_to_original(sd))
    return out


# ---------------------------------------------------------------------------
# original -> diffusers
# ---------------------------------------------------------------------------

_Plan = tuple[tuple[str, ...], Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]


def _identity(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t,)


def _conv1x1_to_linear(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # [C, C, 1, 1] (LDM's 1x1 conv), or [C, C, 1] as a few old VAEs saved it -> [C, C].
    # A wrong shape falls through to the shape check.
    if t.ndim in (3, 4) and all(d == 1 for d in t.shape[2:]):
        return (t.reshape(t.shape[0], t.shape[1]),)
    return (t,)


def _planner(component: str, config: dict, tower: str):
    """Returns (plan(original key without prefix) -> _Plan | None, original name of a diffusers key)."""
    if component in ("unet", "vae"):
        m = _unet_map(config_json(config)) if component == "unet" else vae_map(config_json(config))

        def plan(okey: str) -> _Plan | None:
            dkey = m.to_diffusers(okey)
            if dkey is None:
                return None
            if component == "vae" and VAE_ATTN_CONV.search(okey):
                return (dkey,), _conv1x1_to_linear
            return (dkey,), _identity

        return plan, m.to_original

    if component == "text_encoder":

        def plan(okey: str) -> _Plan | None:
            if not okey.startswith(_TEXT_MODEL):
                return None
            flat = okey[len(_TEXT_MODEL) :]
            return ((tower + flat,), _identity) if flat.startswith(_TOWER) else None

        return plan, lambda dkey: _TEXT_MODEL + _flat_tower_key(dkey)

    def openclip_plan(okey: str) -> _Plan | None:
        p = _openclip_plan(okey)
        if p is None:
            return None
        keys, fn = p
        # Only the tower keys take the "text_model." prefix; text_projection sits on the wrapper.
        return tuple(k if k == "text_projection.weight" else tower + k for k in keys), fn

    return openclip_plan, lambda dkey: _openclip_name(_flat_tower_key(dkey))


def _ignored(component: str, okey: str) -> bool:
    # position_ids is a buffer (often saved, sometimes corrupted by merges): always rebuilt.
    # logit_scale only matters for CLIP's contrastive loss.
    return okey.endswith("position_ids") or (component == "text_encoder_2" and okey == "logit_scale")


def _component_steps(keys: list[str], configs: dict[str, dict], component: str) -> tuple[list, dict]:
    """Names only: what each file key of ``component`` becomes (its steps) and the model's shapes, missing or
    unexpected keys raised as ModelLoadError before a tensor is read."""
    if component not in PREFIXES:
        raise ModelLoadError(f"Unknown SDXL component {component!r}; expected one of {list(COMPONENTS)}.")
    config = _require_config(configs, component)
    prefix = PREFIXES[component]
    reference = _reference_shapes(component, config_json(config))
    plan, original_name = _planner(component, config, _tower_prefix(reference))

    steps: list[tuple[str, _Plan]] = []
    unexpected: list[str] = []
    produced: set[str] = set()
    for key in keys:
        if not key.startswith(prefix):
            continue
        okey = key[len(prefix) :]
        if _ignored(component, okey):
            continue
        p = plan(okey)
        if p is None or any(d not in reference for d in p[0]):
            unexpected.append(key)
            continue
        steps.append((key, p))
        produced.update(p[0])
    if not steps and not unexpected:
        raise ModelLoadError(
            f"The checkpoint has no {component} weights (no key starts with {prefix!r}).",
            hint="Load only the components the file has (components=...) and take the others from a diffusers folder.",
        )
    missing = sorted({prefix + (original_name(d) or d) for d in reference if d not in produced})
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({few(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({few(unexpected)})")
        raise ModelLoadError(
            f"The checkpoint's {component} weights do not match the SDXL layout for its config: "
            + "; ".join(parts)
            + ".",
            hint=(
                "Check that the file is an SDXL base-architecture checkpoint (not SD 1.x/2.x or the refiner). "
                "If it lacks some components, load only those present (components=...)."
            ),
        )

    return steps, reference


def component_tensors(
    get: Callable[[str], torch.Tensor], keys: Iterable[str], configs: dict[str, dict], component: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """One component's (diffusers name, tensor) pairs, each read by ``get`` only when its turn comes (the load
    streams them); names checked first as :func:`original_to_diffusers` does, a wrong shape raised as it comes."""
    steps, reference = _component_steps(list(keys), configs, component)
    for key, (dkeys, fn) in steps:
        for dkey, t in zip(dkeys, fn(get(key))):
            if tuple(t.shape) != reference[dkey]:
                raise ModelLoadError(
                    f"1 {component} weights of the checkpoint have the wrong shape for its config: "
                    f"{key} {tuple(t.shape)} (expected {reference[dkey]} for {dkey})",
                    hint="The file is probably a different architecture than the config (e.g. the SDXL refiner).",
                )
            yield dkey, t


def original_to_diffusers(
    get: Callable[[str], torch.Tensor],
    keys: Iterable[str],
    configs: dict[str, dict],
    components=COMPONENTS,
) -> dict[str, dict[str, torch.Tensor]]:
    """SDXL single-file tensors -> per-component diffusers/transformers state dicts.

    ``get(key)`` returns one tensor of the file (e.g. ``safe_open(...).get_tensor``)
    and ``keys`` lists the file's keys. Each requested component's key names are
    checked against the keys of its model (built from ``configs`` on the meta
    device) before any tensor is read; missing or unexpected keys raise
    ModelLoadError naming the first few. Keys outside the requested components'
    prefixes are ignored.
    """
    keys = list(keys)
    result: dict[str, dict[str, torch.Tensor]] = {}
    for component in components:
        steps, reference = _component_steps(keys, configs, component)

        # 2. Read one tensor at a time and check shapes against the model.
        sd: dict[str, torch.Tensor] = {}
        wrong: list[str] = []
        for key, (dkeys, fn) in steps:
            for dkey, t in zip(dkeys, fn(get(key))):
                if tuple(t.shape) != reference[dkey]:
                    wrong.append(f"{key} {tuple(t.shape)} (expected {reference[dkey]} for {dkey})")
                sd[dkey] = t
        if wrong:
            raise ModelLoadError(
                f"{len(wrong)} {component} weights of the checkpoint have the wrong shape for its config: {few(wrong)}",
                hint="The file is probably a different architecture than the config (e.g. the SDXL refiner).",
            )
        # Same order as the model's own state_dict, for readability.
        result[component] = {k: sd[k] for k in reference}
    return result


def detect_sdxl_single_file(keys: Iterable[str]) -> bool:
    """True if the key names look like an SDXL (base-architecture) single file.

    SDXL base has the UNet under model.diffusion_model. and OpenCLIP bigG as the
    second embedder (conditioner.embedders.1.model.); the refiner has bigG as
    embedder 0 and no embedder 1; SD 1.x/2.x use cond_stage_model.
    A UNet-only file (no text encoders) is known by the UNet's micro-conditioning
    embedding (label_emb), which SD 1.x/2.x lack; SD3's MMDiT has joint_blocks instead.
    """
    has_unet = has_bigg = refiner = False
    for key in keys:
        has_unet = has_unet or key.startswith(PREFIXES["unet"])
        has_bigg = has_bigg or key.startswith((PREFIXES["text_encoder_2"], PREFIXES["unet"] + "label_emb."))
        refiner = refiner or key.startswith("conditioner.embedders.0.model.")  # bigG as embedder 0
    return has_unet and has_bigg and not refiner
