"""FLUX.1 single files <-> diffusers/transformers component state dicts.

What people download and ComfyUI users keep, one file per part:

    flux1-dev.safetensors           the transformer alone, Black Forest Labs' names (``double_blocks.N.img_attn.qkv``,
                                    ``single_blocks.N.linear1``, ...; fused q/k/v and q/k/v/MLP projections), no prefix;
                                    fp8-stored copies (``flux1-dev-fp8-e4m3fn.safetensors``) have the same names
    ae.safetensors                  the VAE, LDM autoencoder names (``encoder.down.0.block.0...``), no prefix
    clip_l.safetensors              CLIP-L, transformers names (``text_model.encoder...``)
    t5xxl_fp16.safetensors          T5-XXL's encoder, transformers names (``encoder.block.N...``, ``shared.weight``);
                                    also stored in fp8 (``t5xxl_fp8_e4m3fn.safetensors``)

and ComfyUI's one-file checkpoint (``flux1-dev-fp8.safetensors`` of Comfy-Org) with every part under a prefix
(``PREFIXES``). ``detect_prefix`` tells which.

Why our own transformer converter: diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` fixes the width
at FLUX.1's (3072, MLP ratio 4), so it cannot read another width (our tiny test model), and diffusers has none the
other way. Ours is one table (``module_pairs``) read in both directions; the tests check it against diffusers'
converter tensor for tensor at FLUX.1's widths. The VAE uses diffusers' converter; the
text encoders are transformers' own names under a prefix.
The same table names the LoRA layers of the sd-scripts / ComfyUI layout (``kohya_groups``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ...errors import CheckpointError
from ..ldm_vae import vae_to_original

PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2")

#: ComfyUI's one-file checkpoint; the separate files have no prefix
PREFIXES = {
    "transformer": "model.diffusion_model.",
    "vae": "vae.",
    "text_encoder": "text_encoders.clip_l.transformer.",
    "text_encoder_2": "text_encoders.t5xxl.transformer.",
}
LABELS = {"transformer": "transformer", "vae": "VAE (ae)", "text_encoder": "CLIP-L", "text_encoder_2": "T5-XXL"}
#: the ModelConfig field (sd-scripts' option name) that names a part's own file
FILE_OPTION = {"vae": "ae", "text_encoder": "clip_l", "text_encoder_2": "t5xxl"}

_SHOW = 3


@dataclass(frozen=True)
class Pair:
    """One Black Forest Labs module and the diffusers modules it holds, their outputs concatenated in this order;
    ``swap``: the two halves of the output are swapped (BFL's final adaLN gives shift, scale; diffusers' scale,
    shift)."""

    bfl: str
    members: tuple[str, ...]
    swap: bool = False


_TOP = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
_GUIDANCE = {
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
}
_DOUBLE = {
    "img_mod.lin": ("norm1.linear",),
    "txt_mod.lin": ("norm1_context.linear",),
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
}
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
}
_SINGLE = {
    "modulation.lin": ("norm.linear",),
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
}
_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}


def module_pairs(config: Mapping) -> list[Pair]:
    """Every weight-carrying module of a FluxTransformer2DModel of ``config``, BFL name <- diffusers names."""
    pairs = [Pair(b, (d,)) for b, d in _TOP.items()]
    if config.get("guidance_embeds", False):
        pairs += [Pair(b, (d,)) for b, d in _GUIDANCE.items()]
    pairs.append(Pair("final_layer.adaLN_modulation.1", ("norm_out.linear",), swap=True))
    for i in range(int(config["num_layers"])):
        pairs += [
            Pair(f"double_blocks.{i}.{b}", tuple(f"transformer_blocks.{i}.{m}" for m in ms))
            for b, ms in _DOUBLE.items()
        ]
    for i in range(int(config["num_single_layers"])):
        pairs += [
            Pair(f"single_blocks.{i}.{b}", tuple(f"single_transformer_blocks.{i}.{m}" for m in ms))
            for b, ms in _SINGLE.items()
        ]
    return pairs


def param_pairs(config: Mapping) -> dict[str, str]:
    """The parameters renamed one to one outside ``module_pairs`` (the q/k RMS norms' scales): BFL -> diffusers."""
    out = {}
    for i in range(int(config["num_layers"])):
        out.update({f"double_blocks.{i}.{b}": f"transformer_blocks.{i}.{d}" for b, d in _DOUBLE_NORMS.items()})
    for i in range(int(config["num_single_layers"])):
        out.update({f"single_blocks.{i}.{b}": f"single_transformer_blocks.{i}.{d}" for b, d in _SINGLE_NORMS.items()})
    return out


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(shift, scale) <-> (scale, shift) along the output dimension; an involution."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _split_sizes(pair: Pair, total: int, inner: int) -> list[int]:
    """The output widths of a fused module's members: q, k, v have the attention's width; linear1's MLP the rest."""
    n = len(pair.members)
    if pair.members[-1].endswith("proj_mlp"):
        return [inner] * (n - 1) + [total - inner * (n - 1)]
    return [total // n] * n


# ---------------------------------------------------------------------------
# detection
# ---------------------------------------------------------------------------


def detect_prefix(keys: Iterable[str]) -> str | None:
    """ "" for a BFL transformer file, ``model.diffusion_model.`` for a ComfyUI checkpoint, None if neither."""
    for k in keys:
        if k.startswith(("double_blocks.", "single_blocks.")):
            return ""
        if k.startswith(PREFIXES["transformer"] + "double_blocks."):
            return PREFIXES["transformer"]
    return None


def is_flux_file(keys: Iterable[str]) -> bool:
    return detect_prefix(keys) is not None


def parts_in_file(keys: Iterable[str]) -> set[str]:
    """The parts a file carries: a ComfyUI checkpoint's by prefix, a lone file's by its names."""
    keys = list(keys)
    found = {p for p, pre in PREFIXES.items() if any(k.startswith(pre) for k in keys)}
    if detect_prefix(keys) == "":
        found.add("transformer")
    if not found:
        if any(k.startswith(("encoder.down.", "decoder.up.")) for k in keys):
            found.add("vae")
        elif any(k.startswith("text_model.") for k in keys):
            found.add("text_encoder")
        elif any(k.startswith("encoder.block.") for k in keys):
            found.add("text_encoder_2")
    return found


def guess_architecture(keys: Iterable[str]) -> str | None:
    """flux-dev (a guidance embedding) or flux-schnell, for FLUX.1's 19 + 38 blocks; None if not FLUX.1-sized."""
    keys = list(keys)
    prefix = detect_prefix(keys)
    if prefix is None:
        return None
    body = [k[len(prefix) :] for k in keys if k.startswith(prefix)]
    doubles = {int(k.split(".")[1]) for k in body if k.startswith("double_blocks.")}
    singles = {int(k.split(".")[1]) for k in body if k.startswith("single_blocks.")}
    if len(doubles) != 19 or len(singles) != 38:
        return None
    return "flux-dev" if any(k.startswith("guidance_in.") for k in body) else "flux-schnell"


SCALED_FP8 = ("scale_weight", "scale_input", "scaled_fp8", "weight_scale")


def refuse_scaled_fp8(keys: Iterable[str], name: str) -> None:
    """ComfyUI's "scaled fp8" files store a scale per weight; read as plain fp8 they would be wrong, so refuse."""
    odd = [k for k in keys if k.rsplit(".", 1)[-1] in SCALED_FP8]
    if odd:
        raise CheckpointError(
            f"{name} is a scaled-fp8 checkpoint ({odd[0]}): its weights need per-tensor scales difftrain does not "
            "apply.",
            hint="Use the plain fp8 (e4m3fn) or 16-bit file of the same model.",
        )


# ---------------------------------------------------------------------------
# BFL -> diffusers
# ---------------------------------------------------------------------------


def transformer_to_diffusers(checkpoint: Mapping[str, torch.Tensor], config: Mapping) -> dict[str, torch.Tensor]:
    """BFL-named transformer tensors (no prefix) -> FluxTransformer2DModel's state dict for ``config``.

    Tensors the table does not place come back as ``<unconverted> name`` and missing ones are absent: the
    caller's ``load_state_dict`` reports both."""
    return dict(transformer_tensors(list(checkpoint), checkpoint.__getitem__, config))


def transformer_tensors(
    keys: Iterable[str], get: Callable[[str], torch.Tensor], config: Mapping
) -> Iterator[tuple[str, torch.Tensor]]:
    """(diffusers name, tensor) of each BFL-named transformer tensor (no prefix), each file tensor read by ``get``
    only when its turn comes (a fused projection's pieces are views of it): the load streams them one at a time.
    What the table does not place comes as ``<unconverted> name``."""
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    left = dict.fromkeys(keys)
    for pair in module_pairs(config):
        for kind in ("weight", "bias"):
            key = f"{pair.bfl}.{kind}"
            if key not in left:
                continue
            del left[key]
            t = get(key)
            if pair.swap:
                t = swap_halves(t)
            if len(pair.members) == 1:
                yield f"{pair.members[0]}.{kind}", t
                continue
            sizes = _split_sizes(pair, t.shape[0], inner)
            for member, piece in zip(pair.members, torch.split(t, sizes, dim=0), strict=True):
                yield f"{member}.{kind}", piece
            del t, piece
    for bfl, dif in param_pairs(config).items():
        if bfl in left:
            del left[bfl]
            yield dif, get(bfl)
    for k in left:
        yield f"<unconverted> {k}", get(k)


def vae_to_diffusers(checkpoint: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """ae.safetensors (LDM names, with or without ``vae.``) -> AutoencoderKL's state dict (diffusers' converter)."""
    from diffusers.loaders import single_file_utils as sfu

    return sfu.convert_ldm_vae_checkpoint(checkpoint, config)


def clip_to_diffusers(checkpoint: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """CLIP-L (transformers names under ``prefix``) -> CLIPTextModel's state dict; Flux uses the pooled output
    unprojected, so a projection in the file (ComfyUI's clip_l.safetensors has one) is left out."""
    sd = {k[len(prefix) :]: v for k, v in checkpoint.items() if k.startswith(prefix)}
    drop = ("position_ids", "logit_scale", "text_projection.weight")
    return {k: v for k, v in sd.items() if not k.endswith(drop)}


def t5_to_diffusers(checkpoint: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """T5-XXL's encoder (transformers names under ``prefix``) -> T5EncoderModel's state dict (``shared`` tied)."""
    sd = {k[len(prefix) :]: v for k, v in checkpoint.items() if k.startswith(prefix)}
    if "shared.weight" in sd:
        sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])
    elif "encoder.embed_tokens.weight" in sd:
        sd["shared.weight"] = sd["encoder.embed_tokens.weight"]
    return sd


# ---------------------------------------------------------------------------
# diffusers -> BFL (lazy, so a fused projection is concatenated only while it is written)
# ---------------------------------------------------------------------------


def transformer_to_bfl(sd: Mapping[str, torch.Tensor], config: Mapping, prefix: str = "") -> dict[str, Callable]:
    """FluxTransformer2DModel's state dict -> BFL names (under ``prefix``), as makers of each tensor."""
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    used: set[str] = set()
    for pair in module_pairs(config):
        for kind in ("weight", "bias"):
            names = [f"{m}.{kind}" for m in pair.members]
            present = [n in sd for n in names]
            if not any(present):
                continue
            if not all(present):
                raise CheckpointError(
                    f"The Flux transformer has only some of {', '.join(names)}; the BFL layout fuses them."
                )
            used.update(names)
            makers[prefix + f"{pair.bfl}.{kind}"] = _maker(sd, names, pair.swap)
    for bfl, dif in param_pairs(config).items():
        if dif in sd:
            used.add(dif)
            makers[prefix + bfl] = _maker(sd, [dif], False)
    bad = sorted(k for k in sd if k not in used)
    if bad:
        raise CheckpointError(
            f"{len(bad)} Flux transformer weights have no place in the BFL layout: {bad[:_SHOW]}",
            hint="Only FluxTransformer2DModel architectures convert to the BFL layout; save a diffusers folder instead.",
        )
    return makers


def _maker(sd: Mapping[str, torch.Tensor], names: list[str], swap: bool) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        t = sd[names[0]] if len(names) == 1 else torch.cat([sd[n] for n in names], dim=0)
        return swap_halves(t) if swap else t

    return make


def to_single_file(
    state_dicts: Mapping[str, Mapping[str, torch.Tensor]], configs: Mapping[str, dict]
) -> dict[str, Callable]:
    """Component state dicts -> one file's makers: one part alone as its own file has it (the transformer in the
    BFL layout: flux1-dev.safetensors; ae, clip_l, t5xxl.safetensors), or several in ComfyUI's checkpoint layout
    (every part under its ``PREFIXES`` entry)."""

    unknown = set(state_dicts) - set(PARTS)
    if unknown:
        raise CheckpointError(f"Unknown Flux parts {sorted(unknown)}; expected some of {list(PARTS)}.")
    alone = len(state_dicts) == 1  # one part: its own file (flux1-dev, ae, clip_l, t5xxl.safetensors), no prefix
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    for part in PARTS:
        sd = state_dicts.get(part)
        if sd is None:
            continue
        prefix = "" if alone else PREFIXES[part]
        if part == "transformer":
            makers.update(transformer_to_bfl(sd, configs["transformer"], prefix))
        elif part == "vae":
            vae = vae_to_original(sd, configs["vae"])
            cut = len("first_stage_model.")
            makers.update({prefix + k[cut:]: _constant(v) for k, v in vae.items()})
        else:
            for k, v in sd.items():
                if k.endswith("position_ids") or (part == "text_encoder_2" and k == "encoder.embed_tokens.weight"):
                    continue  # a buffer rebuilt at load / a tie of shared.weight
                if part == "text_encoder" and not k.startswith("text_model."):
                    k = "text_model." + k  # transformers >= 5.6 CLIPTextModel has no text_model wrapper
                makers[prefix + k] = _constant(v)
    return makers


def _constant(v: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: v


# ---------------------------------------------------------------------------
# LoRA: the sd-scripts / ComfyUI names
# ---------------------------------------------------------------------------


def kohya_groups(config: Mapping) -> list[Pair]:
    """The transformer's modules as sd-scripts' Flux LoRA names them (``lora_unet_`` + the BFL path with "_"):
    each BFL module with the diffusers modules it fuses."""
    return module_pairs(config)
