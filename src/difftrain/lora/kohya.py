"""The kohya LoRA layout (sd-scripts' ``networks.lora``), which ComfyUI, A1111/Forge and diffusers load.

One entry per adapted module: ``<prefix>_<module path with "_" for ".">.lora_down.weight`` (peft's
``lora_A``), ``.lora_up.weight`` (``lora_B``) and ``.alpha`` (a scalar tensor: the layer's scale is
alpha / rank). Prefixes: ``lora_unet`` (SDXL's UNet, named by its original LDM module paths:
``input_blocks.4.1...``), ``lora_transformer`` (an MMDiT named by its diffusers paths, OneTrainer's and
ComfyUI's SD3 convention), ``lora_te1`` / ``lora_te2`` (the CLIP text encoders, transformers' paths).

Flux (sd-scripts' ``networks.lora_flux``) names the transformer ``lora_unet`` by its Black Forest Labs paths,
where q/k/v (and a single block's q/k/v/MLP) are one fused ``Linear``. Our LoRA has one adapter per diffusers
module, so a fused name holds them block-diagonally (``fused``): down = [A_q; A_k; A_v] (rank 3r), up = diag(B_q,
B_k, B_v), alpha = 3 alpha, the same ΔW, and the "sparse" form diffusers' ``_convert_kohya_flux_lora_to_diffusers``
splits back exactly; ComfyUI multiplies it out. A module of the group that was not adapted is zeros there.

Why our own: diffusers reads this layout (``_convert_non_diffusers_lora_to_diffusers``) but does not
write it, and peft knows only its own. The family says how a module path is spelled in the file
(``names``: diffusers module path -> the path the name is made of); this module only renames.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from . import lycoris

#: the name prefix of each part
PREFIXES = {
    "unet": "lora_unet",
    "transformer": "lora_transformer",
    "text_encoder": "lora_te1",
    "text_encoder_2": "lora_te2",
    "text_encoder_3": "lora_te3",
}
_A, _B = ".lora_A.weight", ".lora_B.weight"
_DOWN, _UP, _ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"


#: a fused group: ((module, output width) in stacking order, whether the output's halves are swapped)
Group = tuple[tuple[tuple[str, int], ...], bool]


def is_kohya(keys: Iterable[str]) -> bool:
    """kohya's layout (or LyCORIS' in it): lora_<prefix>_<path>.lora_down / lora_up, or .hada_* / .lokr_* keys."""
    lyco = tuple(k for k in lycoris.BACK if k.startswith((".hada_", ".lokr_")))
    return any((k.endswith((_DOWN, _UP)) and k.split("_", 2)[0] == "lora") or k.endswith(lyco) for k in keys)


def kohya_name(part: str, path: str, prefixes: Mapping[str, str] | None = None) -> str:
    return f"{(prefixes or PREFIXES)[part]}_{path.replace('.', '_')}"


def _swap(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


class UnmappedKeys(ValueError):
    """Keys that name no module of the model; ``keys`` lists them all."""

    def __init__(self, what: str, keys: list[str]):
        self.keys = keys
        shown = ", ".join(keys[:5]) + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")
        super().__init__(f"{len(keys)} {what}: {shown}")


def to_kohya(
    layers: Mapping[str, Mapping[str, torch.Tensor]],
    names: Mapping[str, Mapping[str, str]],
    alphas: Mapping[str, Mapping[str, float]],
    fused: Mapping[str, Mapping[str, Group]] | None = None,
    prefixes: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """peft-named LoRA weights per part -> one kohya state dict.

    ``names[part]`` maps each module path of the part to the path its kohya name is made of (a module
    missing there does not exist in the base model's file layout: every one is named in the error
    before anything is returned); ``alphas[part][module]`` is that module's alpha; ``fused[part]`` names the
    groups of modules one kohya name covers (see the module's docstring).
    """
    pre: Mapping[str, str] = prefixes or PREFIXES
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for part, sd in layers.items():
        if part not in pre:
            raise ValueError(f"no kohya prefix for the part {part!r}")
        sd = dict(sd)
        for fpath, group in (fused or {}).get(part, {}).items():
            name = kohya_name(part, fpath, pre)
            made = _fuse(sd, group, alphas.get(part, {}), name)
            if made is not None:
                out.update(made)
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in sd.items():
            hit = lycoris.split(key)
            if hit is None:
                unmapped.append(f"{part}.{key}")
            else:
                grouped.setdefault(hit[0], {})[hit[1]] = t
        for module, leaves in grouped.items():
            path = names.get(part, {}).get(module)
            if path is None:
                unmapped.append(f"{part}.{module}")
                continue
            name = kohya_name(part, path, pre)
            ndim = leaves[_A].dim() if _A in leaves else 0
            for leaf, t in leaves.items():
                if leaf == lycoris.MAG:
                    t = lycoris.to_dora_scale(t, ndim)
                out[name + lycoris.LEAVES[leaf]] = t.detach().contiguous()
            out[name + _ALPHA] = torch.tensor(float(alphas[part][module]), dtype=torch.float32)
    if unmapped:
        raise UnmappedKeys("LoRA layers have no module of that name in the base model's layout", sorted(unmapped))
    return out


def to_native(
    layers: Mapping[str, Mapping[str, torch.Tensor]],
    names: Mapping[str, Mapping[str, str]],
    alphas: Mapping[str, Mapping[str, float]],
    prefix: str,
) -> dict[str, torch.Tensor]:
    """peft-named LoRA weights -> the model's original module paths under ``prefix``, peft's ``lora_A`` /
    ``lora_B`` names, each up weight scaled by alpha / rank (no alpha entry): Krea 2's layout, which ComfyUI loads and
    diffusers' Krea 2 converter reads (it takes neither an alpha nor lora_down / lora_up). DoRA's magnitude is
    ``dora_scale`` as in the kohya layout (ComfyUI reads it by any module name)."""
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for part, sd in layers.items():
        for key, t in sd.items():
            hit = lycoris.split(key, (_A, _B, lycoris.MAG))
            if hit is None:
                unmapped.append(f"{part}.{key}")
                continue
            module, leaf = hit
            path = names.get(part, {}).get(module)
            if path is None:
                unmapped.append(f"{part}.{module}")
                continue
            if leaf == _B:
                rank = sd[module + _A].shape[0]
                t = t * (float(alphas[part][module]) / rank)
            elif leaf == lycoris.MAG:  # DoRA: ComfyUI's dora_scale beside the LoRA (the alpha folded in the same)
                t, leaf = lycoris.to_dora_scale(t, sd[module + _A].dim()), ".dora_scale"
            out[f"{prefix}{path}{leaf}"] = t.detach().contiguous()
    if unmapped:
        raise UnmappedKeys("LoRA layers have no module of that name in the base model's layout", sorted(unmapped))
    return out


def _fuse(
    sd: dict[str, torch.Tensor], group: Group, alphas: Mapping[str, float], name: str
) -> dict[str, torch.Tensor] | None:
    """The group's adapters (popped from ``sd``) as one block-diagonal kohya layer; None if none is adapted.

    LoRA: down = [A_1; A_2; ...], up = diag(B_1, B_2, ...). DoRA adds each member's magnitude rows in the same order
    (its norm is per output row, so the fused weight's rows keep theirs): every member must be adapted, as the
    magnitude of one that is not would be its base weight's norm. LoHa: w1_a = diag(w1_a of each), w1_b = [w1_b of
    each] (and w2 the same), whose Hadamard product is each member's in its rows. LoKr has no such form (rows of
    several Kronecker products are not one): a ValueError says so."""
    members, swap = group
    present = [m for m, _ in members if any(k.startswith(m + ".") for k in sd)]
    if not present:
        return None
    kinds = {lycoris.kind(k[len(m) :] for k in sd if k.startswith(m + ".")) for m in present}
    if kinds & {"lokr"}:
        raise ValueError(
            f"{name}: LoKr layers of {', '.join(present)} cannot be written as the one fused layer the kohya names "
            "have there (rows of several Kronecker products are no Kronecker product)"
        )
    if len(kinds) != 1:
        raise ValueError(f"{name}: the fused modules {', '.join(present)} have adapters of different types")
    (kind,) = kinds
    if kind == "loha":
        return _fuse_loha(sd, group, present, alphas, name)
    if kind == "dora" and len(present) != len(members):
        missing = [m for m, _ in members if m not in present]
        raise ValueError(
            f"{name}: DoRA on {', '.join(present)} without {', '.join(missing)}: the kohya names have one fused "
            "layer there, whose magnitude needs every member adapted"
        )
    first = sd[present[0] + _A]
    rank = first.shape[0]
    if any(sd[m + _A].shape[0] != rank for m in present):
        raise ValueError(f"{name}: the fused modules {', '.join(present)} have LoRAs of different ranks")
    alpha = float(alphas[present[0]])
    downs, ups, mags = [], [], []
    for m, width in members:
        if m in present:
            a, b = sd.pop(m + _A), sd.pop(m + _B)
            # each member keeps its own scale alpha_m / r inside the common one (alpha / r)
            downs.append(a.detach())
            ups.append(b.detach() * (float(alphas[m]) / alpha))
            if kind == "dora":
                mags.append(sd.pop(m + lycoris.MAG).detach().reshape(-1))
        else:
            downs.append(first.new_zeros(first.shape))
            ups.append(first.new_zeros(width, rank))
    down = torch.cat(downs, dim=0)
    up = torch.block_diag(*ups).to(first.dtype)
    if swap:
        up = _swap(up)
    out = {
        name + _DOWN: down.contiguous(),
        name + _UP: up.contiguous(),
        name + _ALPHA: torch.tensor(alpha * len(members), dtype=torch.float32),
    }
    if mags:
        mag = torch.cat(mags)
        out[name + ".dora_scale"] = lycoris.to_dora_scale(_swap(mag) if swap else mag, first.dim()).contiguous()
    return out


_HADA = (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b")


def _fuse_loha(
    sd: dict[str, torch.Tensor], group: Group, present: list[str], alphas: Mapping[str, float], name: str
) -> dict[str, torch.Tensor]:
    members, swap = group
    first = sd[present[0] + ".hada_w1_b"]
    rank = first.shape[0]
    if any(sd[m + ".hada_w1_b"].shape[0] != rank or sd[m + ".hada_w2_b"].shape[0] != rank for m in present):
        raise ValueError(f"{name}: the fused modules {', '.join(present)} have LoHa layers of different ranks")
    alpha = float(alphas[present[0]])
    parts: dict[str, list[torch.Tensor]] = {leaf: [] for leaf in _HADA}
    for m, width in members:
        if m in present:
            w = {leaf: sd.pop(m + leaf).detach() for leaf in _HADA}
            w[".hada_w1_a"] = w[".hada_w1_a"] * (float(alphas[m]) / alpha)  # the member's own scale in one factor
        else:
            w = {".hada_w1_a": first.new_zeros(width, rank), ".hada_w2_a": first.new_zeros(width, rank)}
            w[".hada_w1_b"] = w[".hada_w2_b"] = first.new_zeros(first.shape)
        for leaf in _HADA:
            parts[leaf].append(w[leaf])
    out = {}
    for leaf in (".hada_w1_a", ".hada_w2_a"):
        t = torch.block_diag(*parts[leaf]).to(first.dtype)
        out[name + leaf] = (_swap(t) if swap else t).contiguous()
    for leaf in (".hada_w1_b", ".hada_w2_b"):
        out[name + leaf] = torch.cat(parts[leaf], dim=0).contiguous()
    # ComfyUI divides alpha by w1_b's rows (n * r): n * alpha keeps the scale alpha / r
    out[name + _ALPHA] = torch.tensor(alpha * len(members), dtype=torch.float32)
    return out


def _unfuse(
    down: torch.Tensor, up: torch.Tensor, alpha: float, group: Group
) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """A fused kohya LoRA -> (module, A, B, alpha) per member: block-diagonal ones split exactly (a member of zeros,
    one our writer padded with, left out); any other (sd-scripts trains the fused layer) as diffusers splits it:
    the whole down for each member, up cut by output rows, the same alpha."""
    members, swap = group
    if swap:
        up = _swap(up)
    n, rank = len(members), down.shape[0]
    widths = [w for _, w in members]
    rows = torch.split(up, widths, dim=0)
    out = []
    if rank % n == 0:
        r = rank // n
        blocks = [row.split(r, dim=1) for row in rows]
        if all(not blocks[i][j].any() for i in range(n) for j in range(n) if i != j):
            for i, (m, _) in enumerate(members):
                a, b = down[i * r : (i + 1) * r], blocks[i][i]
                if a.any() or b.any():
                    out.append((m, a.contiguous(), b.contiguous(), alpha / n))
            return out
    return [(m, down.clone(), row.contiguous(), alpha) for (m, _), row in zip(members, rows, strict=True)]


def _unfuse_any(
    leaves: dict[str, torch.Tensor], alpha: float, group: Group
) -> list[tuple[str, dict[str, torch.Tensor], float]]:
    """A fused kohya layer (its kohya leaves) -> (module, peft-named leaves, alpha) per member."""
    members, swap = group
    widths = [w for _, w in members]
    if ".hada_w1_a" in leaves:
        return _unfuse_loha(leaves, alpha, group)
    out = []
    mags = None
    if ".dora_scale" in leaves:
        mag = leaves[".dora_scale"].reshape(-1)
        mags = dict(zip([m for m, _ in members], torch.split(_swap(mag) if swap else mag, widths), strict=True))
    ndim = leaves[_DOWN].dim()
    for m, a, b, al in _unfuse(leaves[_DOWN], leaves[_UP], alpha, group):
        got = {_A: a, _B: b}
        if mags is not None:
            got[lycoris.MAG] = lycoris.from_dora_scale(mags[m].contiguous(), ndim)
        out.append((m, got, al))
    return out


def _unfuse_loha(
    leaves: dict[str, torch.Tensor], alpha: float, group: Group
) -> list[tuple[str, dict[str, torch.Tensor], float]]:
    """A fused LoHa: block-diagonal ones (:func:`_fuse_loha`) split exactly; any other as a LoHa of the whole rank
    for each member (its rows of w1_a and w2_a, all of w1_b and w2_b, the same alpha): the same rows of ΔW."""
    members, swap = group
    widths = [w for _, w in members]
    n, rank = len(members), leaves[".hada_w1_b"].shape[0]
    rows = {
        leaf: torch.split(_swap(leaves[leaf]) if swap else leaves[leaf], widths)
        for leaf in (".hada_w1_a", ".hada_w2_a")
    }
    if rank % n == 0 and leaves[".hada_w2_b"].shape[0] == rank:
        r = rank // n
        blocks = {leaf: [row.split(r, dim=1) for row in rows[leaf]] for leaf in rows}
        if all(not b[i][j].any() for b in blocks.values() for i in range(n) for j in range(n) if i != j):
            out = []
            for i, (m, _) in enumerate(members):
                got = {leaf: blocks[leaf][i][i].contiguous() for leaf in blocks}
                for leaf in (".hada_w1_b", ".hada_w2_b"):
                    got[leaf] = leaves[leaf][i * r : (i + 1) * r].contiguous()
                if any(t.any() for t in got.values()):
                    out.append((m, got, alpha / n))
            return out
    return [
        (
            m,
            {
                ".hada_w1_a": rows[".hada_w1_a"][i].contiguous(),
                ".hada_w2_a": rows[".hada_w2_a"][i].contiguous(),
                ".hada_w1_b": leaves[".hada_w1_b"].clone(),
                ".hada_w2_b": leaves[".hada_w2_b"].clone(),
            },
            alpha,
        )
        for i, (m, _) in enumerate(members)
    ]


def from_kohya(
    sd: Mapping[str, torch.Tensor],
    names: Mapping[str, Mapping[str, str]],
    fused: Mapping[str, Mapping[str, Group]] | None = None,
    prefixes: Mapping[str, str] | None = None,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, float]]]:
    """A kohya state dict (LoRA, DoRA's dora_scale, LyCORIS' LoHa and LoKr) -> (peft-named layers per part, alpha
    per part and module). Keys that name no module of ``names`` (the model's) are all listed in the error; a module
    without its alpha gets alpha = rank (sd-scripts' convention: scale 1)."""
    lookup = {
        kohya_name(part, path, prefixes): (part, module) for part, m in names.items() for module, path in m.items()
    }
    groups = {
        kohya_name(part, path, prefixes): (part, group)
        for part, g in (fused or {}).items()
        for path, group in g.items()
    }
    layers: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, dict[str, float]] = {}
    unmapped: list[str] = []
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        hit = lycoris.split(key, (*lycoris.BACK, _ALPHA))
        if hit is None:
            unmapped.append(key)
        else:
            by_name.setdefault(hit[0], {})[hit[1]] = t
    for base, leaves in by_name.items():
        stored = leaves.pop(_ALPHA, None)
        if not leaves:
            unmapped.append(base + _ALPHA)
            continue
        peft_named = {lycoris.BACK[leaf]: t for leaf, t in leaves.items()}
        r = lycoris.rank(peft_named)
        alpha = float(stored.item()) if stored is not None else float(r or 1)
        if base in groups:
            part, group = groups[base]
            need = [_DOWN, _UP] if ".hada_w1_a" not in leaves else [".hada_w1_b", ".hada_w2_a", ".hada_w2_b"]
            lacking = [base + n for n in need if n not in leaves]
            if any(leaf.startswith(".lokr_") for leaf in leaves):  # no per-module LoKr makes these rows
                unmapped.append(f"{base} (LoKr of a fused layer)")
                continue
            if lacking:
                unmapped.extend(f"{k} (missing)" for k in lacking)
                continue
            for module, got, al in _unfuse_any(leaves, alpha, group):
                layers.setdefault(part, {}).update({module + leaf: t for leaf, t in got.items()})
                alphas.setdefault(part, {})[module] = al
            continue
        hit2 = lookup.get(base)
        if hit2 is None:
            unmapped.extend(base + leaf for leaf in leaves)
            continue
        part, module = hit2
        ndim = leaves[_DOWN].dim() if _DOWN in leaves else 2
        for leaf, t in peft_named.items():
            if leaf == lycoris.MAG:
                t = lycoris.from_dora_scale(t, ndim)
            layers.setdefault(part, {})[module + leaf] = t
        alphas.setdefault(part, {})[module] = alpha
    if unmapped:
        raise UnmappedKeys("keys of the LoRA name no module of this model", sorted(unmapped))
    return layers, alphas
