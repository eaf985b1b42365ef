"""SD3 / SD3.5 single-file checkpoints <-> diffusers/transformers component state dicts.

SD3 is distributed as one ``.safetensors`` file in Stability's layout
(``sd3_medium_incl_clips_t5xxlfp8.safetensors``, ``sd3.5_large.safetensors``;
what ComfyUI and sd-scripts load):

    model.diffusion_model.*                 MMDiT (joint_blocks.N.{x,context}_block ..., fused qkv)
    first_stage_model.*                     VAE (LDM autoencoder naming, 16 latent channels)
    text_encoders.clip_l.transformer.*      CLIP-L, transformers naming
    text_encoders.clip_g.transformer.*      CLIP-G (bigG), transformers naming
    text_encoders.t5xxl.transformer.*       T5-XXL encoder, transformers naming (often fp8)

Some files carry only the MMDiT and the VAE (``sd3_medium.safetensors``), some
also the CLIPs but not T5 (``sd3_medium_incl_clips.safetensors``);
``parts_in_file`` says which are there.

original -> diffusers uses diffusers' own converters from
``diffusers.loaders.single_file_utils`` (``convert_sd3_transformer_checkpoint_to_diffusers``,
``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``,
``convert_sd3_t5_checkpoint_to_diffusers``), called offline on the tensors of
one component at a time. diffusers has no converter the other way, so
``diffusers_to_original`` is ours: the exact inverse of diffusers' MMDiT
renaming (checked by a round trip in the tests), the VAE through the SDXL
module's LDM-VAE map (the same layout), the text encoders by prefix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from ...errors import CheckpointError
from ..common import LazyTensors
from ..ldm_vae import vae_to_original

COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")

PREFIXES = {
    "transformer": "model.diffusion_model.",
    "vae": "first_stage_model.",
    "text_encoder": "text_encoders.clip_l.transformer.",
    "text_encoder_2": "text_encoders.clip_g.transformer.",
    "text_encoder_3": "text_encoders.t5xxl.transformer.",
}

#: what a part is called in messages
LABELS = {
    "transformer": "MMDiT (transformer)",
    "vae": "VAE",
    "text_encoder": "CLIP-L",
    "text_encoder_2": "CLIP-G",
    "text_encoder_3": "T5-XXL",
}

_SHOW = 3


def parts_in_file(keys: Iterable[str]) -> set[str]:
    """The SD3 components a single file carries, judged by key prefixes."""
    found: set[str] = set()
    for key in keys:
        for part, prefix in PREFIXES.items():
            if part not in found and key.startswith(prefix):
                found.add(part)
    return found


def detect_sd3_single_file(keys: Iterable[str]) -> bool:
    """True if the key names look like an SD3/SD3.5 file (MMDiT joint blocks, or SD3's text_encoders.* layout)."""
    return any(k.startswith((PREFIXES["transformer"] + "joint_blocks.", "text_encoders.")) for k in keys)


def guess_architecture(keys: Iterable[str]) -> str | None:
    """The bundled config name whose MMDiT matches the file's joint blocks (None if no transformer or unknown)."""
    blocks, dual = set(), False
    pat = re.compile(r"^model\.diffusion_model\.joint_blocks\.(\d+)\.")
    for k in keys:
        if m := pat.match(k):
            blocks.add(int(m[1]))
            dual = dual or ".x_block.attn2." in k
    if not blocks:
        return None
    depth = max(blocks) + 1
    if depth == 24:
        return "sd3.5-medium" if dual else "sd3-medium"
    if depth == 38:
        return "sd3.5-large"
    return None


# ---------------------------------------------------------------------------
# original -> diffusers (diffusers' converters)
# ---------------------------------------------------------------------------


def transformer_tensors(
    keys: Iterable[str], shape: Callable[[str], tuple[int, ...]], get: Callable[[str], torch.Tensor], config: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """(diffusers name, tensor) of the MMDiT's tensors in a single file, each file tensor read by ``get`` once, when
    its turn comes (the load streams them: families/streaming.py).

    Which rows of which file tensor each diffusers tensor is, diffusers' converter tells: it runs on stand-ins, each
    file tensor as a column of (its key's number, its row) with the real number of rows, and it only chunks,
    concatenates and swaps halves along the first dimension. Why not a table of our own: the converter is diffusers'
    single source of the SD3 / SD3.5 layouts (qk norms, the second attention of 3.5-medium, the last block's context
    half), and one table would have to follow it. Whatever the stand-ins cannot express comes out with a wrong shape,
    which the load refuses by name; tests compare this with the converter run on the real tensors."""
    prefix = PREFIXES["transformer"]
    names = [k for k in keys if k.startswith(prefix)]
    stand = {}
    for i, k in enumerate(names):
        n = (shape(k) or (1,))[0]
        stand[k] = torch.stack([torch.full((n,), float(i), dtype=torch.float64),
                                torch.arange(n, dtype=torch.float64)], dim=1)  # fmt: skip
    converted = original_to_diffusers("transformer", stand, config)
    number = {**{k: i for i, k in enumerate(names)}, **{k[len(prefix) :]: i for i, k in enumerate(names)}}
    by_source: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, t in converted.items():
        if name.startswith("<unconverted> "):
            by_source.setdefault(number[name.removeprefix("<unconverted> ")], []).append((name, torch.empty(0)))
            continue
        src = t[:, 0].unique()
        if len(src) != 1:
            raise CheckpointError(f"the SD3 converter mixed several file tensors into {name}")
        by_source.setdefault(int(src.item()), []).append((name, t[:, 1].long()))
    for i in sorted(by_source):
        t = get(names[i])
        for name, rows in by_source[i]:
            whole = name.startswith("<unconverted> ") or (
                rows.numel() == t.shape[0] and bool((rows == torch.arange(t.shape[0])).all())
            )
            if whole:
                yield name, t
            elif rows.numel() and bool((rows[1:] - rows[:-1] == 1).all()):
                yield name, t[int(rows[0]) : int(rows[-1]) + 1]
            else:
                yield name, t.index_select(0, rows)
        del t


def original_to_diffusers(part: str, checkpoint: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """One component's tensors (file keys, prefix included) -> its diffusers/transformers state dict.

    ``checkpoint`` is consumed (diffusers' MMDiT converter pops what it converts).
    The result may miss keys or hold extra ones when the file does not fit the
    config; the caller's ``load_state_dict`` reports those.
    """
    from diffusers.loaders import single_file_utils as sfu

    prefix = PREFIXES[part]
    if part == "transformer":
        sd = sfu.convert_sd3_transformer_checkpoint_to_diffusers(checkpoint)
        # what diffusers' converter left behind did not fit its layout: report it as unexpected
        sd.update({f"<unconverted> {k}": v for k, v in checkpoint.items()})
        return sd
    if part == "vae":
        return sfu.convert_ldm_vae_checkpoint(checkpoint, config)
    if part == "text_encoder_3":
        sd = sfu.convert_sd3_t5_checkpoint_to_diffusers(checkpoint)
        # transformers ties encoder.embed_tokens to shared; files store shared only
        if "shared.weight" in sd:
            sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])
        return sd
    # CLIP-L / CLIP-G: transformers naming under a prefix. diffusers' create_diffusers_clip_model_from_ldm
    # needs a config from the hub or a folder, so only its renaming step (convert_ldm_clip_checkpoint) is used.
    sd = sfu.convert_ldm_clip_checkpoint(checkpoint, prefix)
    sd = {k: v for k, v in sd.items() if not k.endswith("position_ids") and k != "logit_scale"}
    if part == "text_encoder":
        # SD3 uses CLIP-L's pooled output unprojected (Stability's reference code: return_projected_pooled=False);
        # diffusers expresses that as an identity text_projection, whatever the file holds. So do we.
        like = sd.get("text_model.final_layer_norm.weight")
        width = config["hidden_size"]
        sd["text_projection.weight"] = torch.eye(
            width,
            dtype=like.dtype if like is not None else torch.float32,
            device=like.device if like is not None else None,
        )
    return sd


# ---------------------------------------------------------------------------
# diffusers -> original (ours: diffusers has no converter this way)
# ---------------------------------------------------------------------------


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """Stability's final adaLN gives (shift, scale); diffusers' AdaLayerNormContinuous (scale, shift). An involution."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


# diffusers block sub-module -> Stability's (for the parts renamed one to one)
_BLOCK_SIMPLE = {
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    "attn2.to_out.0": "x_block.attn2.proj",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
# fused projections: Stability's qkv = cat([q, k, v]) along the output dimension
_BLOCK_QKV = {
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
}
_TOP = {
    "pos_embed.pos_embed": "pos_embed",
    "pos_embed.proj.weight": "x_embedder.proj.weight",
    "pos_embed.proj.bias": "x_embedder.proj.bias",
    "time_text_embed.timestep_embedder.linear_1.weight": "t_embedder.mlp.0.weight",
    "time_text_embed.timestep_embedder.linear_1.bias": "t_embedder.mlp.0.bias",
    "time_text_embed.timestep_embedder.linear_2.weight": "t_embedder.mlp.2.weight",
    "time_text_embed.timestep_embedder.linear_2.bias": "t_embedder.mlp.2.bias",
    "time_text_embed.text_embedder.linear_1.weight": "y_embedder.mlp.0.weight",
    "time_text_embed.text_embedder.linear_1.bias": "y_embedder.mlp.0.bias",
    "time_text_embed.text_embedder.linear_2.weight": "y_embedder.mlp.2.weight",
    "time_text_embed.text_embedder.linear_2.bias": "y_embedder.mlp.2.bias",
    "context_embedder.weight": "context_embedder.weight",
    "context_embedder.bias": "context_embedder.bias",
    "proj_out.weight": "final_layer.linear.weight",
    "proj_out.bias": "final_layer.linear.bias",
}
_BLOCK_KEY = re.compile(r"^transformer_blocks\.(\d+)\.(.+)\.(weight|bias)$")


def _constant(v: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: v


def _concatenated(sd: Mapping[str, torch.Tensor], names: list[str]) -> Callable[[], torch.Tensor]:
    """The fused q/k/v weight, read (and concatenated) only when it is written."""
    return lambda: torch.cat([sd[n] for n in names], dim=0)


def _transformer_to_original(sd: Mapping[str, torch.Tensor], config: dict) -> dict[str, Callable[[], torch.Tensor]]:
    """The inverse of diffusers' convert_sd3_transformer_checkpoint_to_diffusers, as lazy makers."""
    prefix = PREFIXES["transformer"]
    last = int(config["num_layers"]) - 1
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    used: set[str] = set()

    def direct(src: str, dst: str, fn=None):
        used.add(src)
        makers[prefix + dst] = (lambda: fn(sd[src])) if fn else (lambda: sd[src])

    for src, dst in _TOP.items():
        if src in sd:
            direct(src, dst)
    for kind in ("weight", "bias"):
        if f"norm_out.linear.{kind}" in sd:
            direct(f"norm_out.linear.{kind}", f"final_layer.adaLN_modulation.1.{kind}", _swap_halves)

    blocks = sorted({int(m[1]) for k in sd if (m := _BLOCK_KEY.match(k))})
    for i in blocks:
        b = f"transformer_blocks.{i}."
        for kind in ("weight", "bias"):
            for src, dst in _BLOCK_SIMPLE.items():
                if b + f"{src}.{kind}" in sd:
                    direct(b + f"{src}.{kind}", f"joint_blocks.{i}.{dst}.{kind}")
            ctx = b + f"norm1_context.linear.{kind}"
            if ctx in sd:
                # the last block's context stream is "pre only": its adaLN is a continuous norm (scale/shift swapped)
                direct(
                    ctx,
                    f"joint_blocks.{i}.context_block.adaLN_modulation.1.{kind}",
                    _swap_halves if i == last else None,
                )
            for dst, srcs in _BLOCK_QKV.items():
                names = [b + f"{s}.{kind}" for s in srcs]
                present = [n in sd for n in names]
                if all(present):
                    used.update(names)
                    makers[prefix + f"joint_blocks.{i}.{dst}.{kind}"] = _concatenated(sd, names)
                elif any(present):
                    raise CheckpointError(
                        f"The SD3 transformer has only some of {', '.join(names)}; the single-file layout fuses them."
                    )
    bad = [k for k in sd if k not in used]
    if bad:
        raise CheckpointError(
            f"{len(bad)} SD3 transformer weights have no place in the single-file layout: {bad[:_SHOW]}",
            hint="Only SD3Transformer2DModel architectures convert to the single-file layout; save a diffusers folder instead.",
        )
    return makers


def diffusers_to_original(
    state_dicts: Mapping[str, Mapping[str, torch.Tensor]], configs: Mapping[str, dict]
) -> LazyTensors:
    """Component state dicts (diffusers/transformers naming) -> one SD3 single-file mapping (lazy).

    Components absent from ``state_dicts`` are skipped. The transformer and VAE
    need their configs. Values are the given tensors where the layout allows; the
    fused qkv and the swapped final modulation are computed when read.
    """
    unknown = set(state_dicts) - set(COMPONENTS)
    if unknown:
        raise CheckpointError(f"Unknown SD3 components {sorted(unknown)}; expected some of {list(COMPONENTS)}.")
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    for part in COMPONENTS:
        sd = state_dicts.get(part)
        if sd is None:
            continue
        if part == "transformer":
            makers.update(_transformer_to_original(sd, configs["transformer"]))
        elif part == "vae":
            # the SD3 VAE is the LDM autoencoder under first_stage_model., as in SDXL files
            vae = vae_to_original(sd, configs["vae"])
            makers.update({k: _constant(v) for k, v in vae.items()})
        else:
            prefix = PREFIXES[part]
            for k, v in sd.items():
                if k.endswith("position_ids") or (part == "text_encoder_3" and k == "encoder.embed_tokens.weight"):
                    continue  # a buffer rebuilt at load / a tie of shared.weight
                if part != "text_encoder_3" and not (k.startswith("text_model.") or k == "text_projection.weight"):
                    k = "text_model." + k  # transformers >= 5.6 CLIPTextModel has no text_model wrapper
                makers[prefix + k] = _constant(v)
    return LazyTensors(makers)
