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
    return any(k.endswith((_DOWN, _UP)) and k.split("_", 2)[0] == "lora" for k in keys)


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
        for key, t in sd.items():
            if key.endswith(_A):
                module, new = key[: -len(_A)], _DOWN
            elif key.endswith(_B):
                module, new = key[: -len(_B)], _UP
            else:
                unmapped.append(f"{part}.{key}")
                continue
            path = names.get(part, {}).get(module)
            if path is None:
                unmapped.append(f"{part}.{module}")
                continue
            name = kohya_name(part, path, pre)
            out[name + new] = t.detach().contiguous()
            if new == _DOWN:
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
    diffusers' Krea 2 converter reads (it takes neither an alpha nor lora_down / lora_up)."""
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for part, sd in layers.items():
        for key, t in sd.items():
            if not key.endswith((_A, _B)):
                unmapped.append(f"{part}.{key}")
                continue
            module = key[: -len(_A)]
            path = names.get(part, {}).get(module)
            if path is None:
                unmapped.append(f"{part}.{module}")
                continue
            if key.endswith(_B):
                rank = sd[module + _A].shape[0]
                t = t * (float(alphas[part][module]) / rank)
            out[f"{prefix}{path}{key[len(module) :]}"] = t.detach().contiguous()
    if unmapped:
        raise UnmappedKeys("LoRA layers have no module of that name in the base model's layout", sorted(unmapped))
    return out


def _fuse(
    sd: dict[str, torch.Tensor], group: Group, alphas: Mapping[str, float], name: str
) -> dict[str, torch.Tensor] | None:
    """The group's adapters (popped from ``sd``) as one block-diagonal kohya LoRA; None if none is adapted."""
    members, swap = group
    present = [m for m, _ in members if m + _A in sd]
    if not present:
        return None
    first = sd[present[0] + _A]
    rank = first.shape[0]
    if any(sd[m + _A].shape[0] != rank for m in present):
        raise ValueError(f"{name}: the fused modules {', '.join(present)} have LoRAs of different ranks")
    alpha = float(alphas[present[0]])
    downs, ups = [], []
    for m, width in members:
        if m in present:
            a, b = sd.pop(m + _A), sd.pop(m + _B)
            # each member keeps its own scale alpha_m / r inside the common one (alpha / r)
            downs.append(a.detach())
            ups.append(b.detach() * (float(alphas[m]) / alpha))
        else:
            downs.append(first.new_zeros(first.shape))
            ups.append(first.new_zeros(width, rank))
    down = torch.cat(downs, dim=0)
    up = torch.block_diag(*ups).to(first.dtype)
    if swap:
        up = _swap(up)
    return {
        name + _DOWN: down.contiguous(),
        name + _UP: up.contiguous(),
        name + _ALPHA: torch.tensor(alpha * len(members), dtype=torch.float32),
    }


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


def from_kohya(
    sd: Mapping[str, torch.Tensor],
    names: Mapping[str, Mapping[str, str]],
    fused: Mapping[str, Mapping[str, Group]] | None = None,
    prefixes: Mapping[str, str] | None = None,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, float]]]:
    """A kohya state dict -> (peft-named layers per part, alpha per part and module). Keys that name no
    module of ``names`` (the model's) are all listed in the error; a module without its alpha gets
    alpha = rank (sd-scripts' convention)."""
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
    found_alpha: dict[tuple[str, str], float] = {}
    for key, t in sd.items():
        for suffix, new in ((_DOWN, _A), (_UP, _B), (_ALPHA, None)):
            if key.endswith(suffix):
                base = key[: -len(suffix)]
                if base in groups:
                    if new == _A:
                        part, group = groups[base]
                        up = sd.get(base + _UP)
                        if up is None:
                            unmapped.append(base + _UP + " (missing)")
                            break
                        stored = sd.get(base + _ALPHA)
                        alpha = float(stored.item()) if stored is not None else float(t.shape[0])
                        for module, a, b, al in _unfuse(t, up, alpha, group):
                            layers.setdefault(part, {})[module + _A] = a
                            layers[part][module + _B] = b
                            found_alpha[(part, module)] = al
                    break
                hit = lookup.get(base)
                if hit is None:
                    unmapped.append(key)
                elif new is None:
                    found_alpha[hit] = float(t.item())
                else:
                    layers.setdefault(hit[0], {})[hit[1] + new] = t
                break
        else:
            unmapped.append(key)
    if unmapped:
        raise UnmappedKeys("keys of the LoRA name no module of this model", sorted(unmapped))
    for part, sd_part in layers.items():
        for key, t in sd_part.items():
            if key.endswith(_A):
                module = key[: -len(_A)]
                alphas.setdefault(part, {})[module] = found_alpha.get((part, module), float(t.shape[0]))
    return layers, alphas
