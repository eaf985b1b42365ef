"""The kohya LoRA layout (sd-scripts' ``networks.lora``), which ComfyUI, A1111/Forge and diffusers load.

One entry per adapted module: ``<prefix>_<module path with "_" for ".">.lora_down.weight`` (peft's
``lora_A``), ``.lora_up.weight`` (``lora_B``) and ``.alpha`` (a scalar tensor: the layer's scale is
alpha / rank). Prefixes: ``lora_unet`` (SDXL's UNet, named by its original LDM module paths:
``input_blocks.4.1...``), ``lora_transformer`` (an MMDiT named by its diffusers paths, OneTrainer's and
ComfyUI's SD3 convention), ``lora_te1`` / ``lora_te2`` (the CLIP text encoders, transformers' paths).

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


def is_kohya(keys: Iterable[str]) -> bool:
    return any(k.endswith((_DOWN, _UP)) and k.split("_", 2)[0] == "lora" for k in keys)


def kohya_name(part: str, path: str) -> str:
    return f"{PREFIXES[part]}_{path.replace('.', '_')}"


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
) -> dict[str, torch.Tensor]:
    """peft-named LoRA weights per part -> one kohya state dict.

    ``names[part]`` maps each module path of the part to the path its kohya name is made of (a module
    missing there does not exist in the base model's file layout: every one is named in the error
    before anything is returned); ``alphas[part][module]`` is that module's alpha.
    """
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for part, sd in layers.items():
        if part not in PREFIXES:
            raise ValueError(f"no kohya prefix for the part {part!r}")
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
            name = kohya_name(part, path)
            out[name + new] = t.detach().contiguous()
            if new == _DOWN:
                out[name + _ALPHA] = torch.tensor(float(alphas[part][module]), dtype=torch.float32)
    if unmapped:
        raise UnmappedKeys("LoRA layers have no module of that name in the base model's layout", sorted(unmapped))
    return out


def from_kohya(
    sd: Mapping[str, torch.Tensor], names: Mapping[str, Mapping[str, str]]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, float]]]:
    """A kohya state dict -> (peft-named layers per part, alpha per part and module). Keys that name no
    module of ``names`` (the model's) are all listed in the error; a module without its alpha gets
    alpha = rank (sd-scripts' convention)."""
    lookup = {kohya_name(part, path): (part, module) for part, m in names.items() for module, path in m.items()}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, dict[str, float]] = {}
    unmapped: list[str] = []
    found_alpha: dict[tuple[str, str], float] = {}
    for key, t in sd.items():
        for suffix, new in ((_DOWN, _A), (_UP, _B), (_ALPHA, None)):
            if key.endswith(suffix):
                hit = lookup.get(key[: -len(suffix)])
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
