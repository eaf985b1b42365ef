"""LoRA files beyond the diffusers one: the kohya layout (ComfyUI, A1111/Forge), the metadata every
file carries in its safetensors header, and reading a file of either layout to continue training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError, UnsafeCheckpoint
from ..utils import atomic_file, read_safetensors_header
from . import kohya, lycoris

KOHYA_FILE = "lora_kohya.safetensors"


def kohya_file(cfg) -> str:
    """The kohya file's name: lora_kohya.safetensors, or, for one expert of a two-expert model, with the expert in
    it (lora_kohya_high_noise.safetensors), as ai-toolkit names its Wan 2.2 files: which model node loads it."""
    return f"lora_kohya_{cfg.model.expert}.safetensors" if cfg.model.expert else KOHYA_FILE


def formats(cfg, family) -> list[str]:
    """The LoRA layouts to write: save.lora_formats, else diffusers plus kohya where the family has it. LoHa and LoKr
    are written in the kohya/LyCORIS layout only: diffusers loads neither (its loaders take LoRA and DoRA)."""
    chosen = cfg.save.lora_formats
    lycoris_only = cfg.lora.type != "lora"
    if lycoris_only and not family.kohya_layout:
        raise ConfigError(
            f"lora.type {cfg.lora.type}: {family.name} LoRAs have no kohya layout, and diffusers does not load "
            "LoHa or LoKr, so no file any tool loads could be written.",
            hint="Use lora.type: lora (with lora.use_dora: true for DoRA) for this family.",
        )
    if lycoris_only and chosen is not None and "diffusers" in chosen:
        raise ConfigError(
            f"save.lora_formats diffusers with lora.type {cfg.lora.type}: diffusers does not load LoHa or LoKr "
            "(its loaders take LoRA and DoRA); the kohya/LyCORIS layout is what ComfyUI, Forge and A1111 load.",
            hint="Set save.lora_formats: [kohya] (or leave it unset).",
        )
    if chosen is None:
        if lycoris_only:
            return ["kohya"]
        return ["diffusers", "kohya"] if family.kohya_layout else ["diffusers"]
    if "kohya" in chosen and not family.kohya_layout:
        raise ConfigError(
            f"save.lora_formats kohya: {family.name} LoRAs have no kohya layout (sd-scripts does not "
            "train this family; its tools load the diffusers layout).",
            hint="Set save.lora_formats: [diffusers].",
        )
    return list(chosen)


def check_kohya_names(cfg, family, parts: list[str]) -> None:
    """Before anything loads: an adapter the kohya names cannot hold where they fuse several modules into one layer
    (Flux's and Z-Image's q/k/v): LoKr on any of them (rows of several Kronecker products are no Kronecker product),
    DoRA on some but not all (the fused layer's magnitude would need the others' base weights)."""
    kind = "lokr" if cfg.lora.type == "lokr" else "dora" if cfg.lora.use_dora else None
    if kind is None or "kohya" not in formats(cfg, family):
        return
    targets = cfg.lora.targets
    hit = lambda module: any(module == t or module.endswith("." + t) for t in targets)  # peft's rule
    for part in parts:
        if part != family.denoiser:
            continue
        for path, (members, _) in family.kohya_fused(cfg.model, part).items():
            names = [m for m, _ in members]
            on = [m.rpartition(".")[2] for m in names if hit(m)]
            off = [m.rpartition(".")[2] for m in names if not hit(m)]
            if kind == "lokr" and on:
                raise ConfigError(
                    f"lora.type lokr with lora.targets {', '.join(on)}: {family.name}'s kohya layout has one fused "
                    f"layer for {', '.join(names)} ({path}), and rows of several Kronecker products are no "
                    "Kronecker product, so the LoKr file could not be written.",
                    hint=f"Leave {', '.join(on)} out of lora.targets, or use lora.type: loha (which fuses exactly).",
                )
            if kind == "dora" and on and off:
                raise ConfigError(
                    f"lora.use_dora with lora.targets {', '.join(on)} but not {', '.join(off)}: {family.name}'s kohya "
                    f"layout has one fused layer for {', '.join(names)} ({path}), whose DoRA magnitude needs every "
                    "one of them adapted.",
                    hint=f"Add {', '.join(off)} to lora.targets, or leave {', '.join(on)} out.",
                )


def _pattern(peft_meta: dict, field: str, base, layers: dict[str, torch.Tensor]) -> dict:
    pattern = peft_meta.get(field) or {}
    out = {}
    for module in lycoris.modules(layers):
        hit = [v for k, v in pattern.items() if module == k or module.endswith("." + k)]
        out[module] = hit[0] if hit else base
    return out


def alphas(peft_meta: dict, layers: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each adapted module's alpha (peft's lora_alpha, LoHa's / LoKr's alpha, or its alpha_pattern entry)."""
    base = peft_meta.get("lora_alpha", peft_meta.get("alpha", peft_meta.get("r", 1)))
    return {m: float(a) for m, a in _pattern(peft_meta, "alpha_pattern", base, layers).items()}


def ranks(peft_meta: dict, layers: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each adapted module's peft rank (r, or its rank_pattern entry)."""
    return {m: int(r) for m, r in _pattern(peft_meta, "rank_pattern", peft_meta.get("r", 1), layers).items()}


def adapter_kind(peft_meta: dict) -> str:
    """ "lora", "dora", "loha" or "lokr" from a part's peft config."""
    peft_type = str(peft_meta.get("peft_type", "LORA")).rpartition(".")[2].upper()
    if peft_type in ("LOHA", "LOKR"):
        return peft_type.lower()
    return "dora" if peft_meta.get("use_dora") else "lora"


def lycoris_layers(peft_meta: dict, layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layers as LyCORIS' readers take them: a LoKr module with both factors full gets peft's scale alpha / r
    folded into its w1 (readers apply none there)."""
    if adapter_kind(peft_meta) != "lokr":
        return layers
    a, r = alphas(peft_meta, layers), ranks(peft_meta, layers)
    out = {}
    for module, leaves in lycoris.modules(layers).items():
        for leaf, t in lycoris.fold_full_lokr(leaves, a[module] / r[module]).items():
            out[module + leaf] = t
    return out


def metadata(cfg, family, peft_meta: dict[str, dict]) -> dict[str, str]:
    """Header fields every LoRA file gets: base model, rank, alpha, trigger phrase, a hash of the config
    (sd-scripts' ss_* names and the SAI model spec's, which A1111 and ComfyUI show)."""
    first = next(iter(peft_meta.values()), {})
    rank = first.get("r")
    alpha = first.get("lora_alpha", first.get("alpha", rank))
    kind = adapter_kind(first)
    conf = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, default=str)
    trigger = cfg.save.trigger_phrase or cfg.dreambooth.instance_prompt
    out = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": f"{float(alpha):g}" if alpha is not None else "",
        "ss_base_model_version": family.kohya_base_version or family.name,
        "ss_sd_model_name": Path(str(cfg.model.path)).name if cfg.model.path else str(cfg.model.config or ""),
        "ss_output_name": Path(cfg.train.output_dir).name,
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": family.modelspec_lora_architecture or f"{family.name}/lora",
        "modelspec.title": Path(cfg.train.output_dir).name,
        "difftrain.base_model": str(cfg.model.path or cfg.model.config or ""),
        "difftrain.parts": ",".join(peft_meta),
        "difftrain.config_sha256": hashlib.sha256(conf.encode()).hexdigest(),
    }
    if kind != "lora":  # as LyCORIS' kohya network records itself (what sd-scripts' tools and UIs show)
        args = {"algo": "lora" if kind == "dora" else kind}
        if kind == "dora":
            args.update(dora_wd="True", wd_on_output="True")
        if kind in ("loha", "lokr"):
            args.update(rank_dropout=f"{cfg.lora.rank_dropout:g}", module_dropout=f"{cfg.lora.module_dropout:g}")
        if kind == "lokr":
            args.update(
                factor=str(cfg.lora.factor),
                decompose_both=str(cfg.lora.decompose_both),
                full_matrix=str(cfg.lora.full_matrix),
            )
        out["ss_network_module"] = "lycoris.kohya"
        out["ss_network_args"] = json.dumps(args)
        out["difftrain.adapter"] = kind
        if kind in ("loha", "lokr"):
            out["difftrain.diffusers"] = "diffusers does not load LoHa/LoKr: ComfyUI, Forge and A1111 load this file"
    if cfg.model.expert:  # WanPipeline: load_lora_weights(..., load_into_transformer_2=True) for low_noise
        out["difftrain.expert"] = cfg.model.expert
        out["modelspec.architecture"] += f"-{cfg.model.expert.replace('_', '-')}"
    if trigger:
        out["modelspec.trigger_phrase"] = trigger
        out["ss_trigger_phrase"] = trigger
    return out


def write_kohya(
    path: Path, cfg, family, layers: dict[str, dict[str, torch.Tensor]], peft_meta: dict[str, dict]
) -> Path:
    """The kohya file, atomically; every layer is checked to name a module of the base model first."""
    from safetensors.torch import save

    names = {part: family.kohya_names(cfg.model, part) for part in layers}
    fused = {part: family.kohya_fused(cfg.model, part) for part in layers}
    scales = {p: alphas(peft_meta[p], layers[p]) for p in layers}
    kinds = {adapter_kind(m) for m in peft_meta.values()}
    layers = {p: lycoris_layers(peft_meta[p], sd) for p, sd in layers.items()}
    try:
        if family.lora_native_prefix is not None and kinds <= {"lora", "dora"}:
            # Krea 2: original names, lora_A / lora_B, alpha folded in (LoHa / LoKr keep kohya's names: ComfyUI maps
            # lora_unet_ + a module's original path for every model)
            sd = kohya.to_native(layers, names, scales, family.lora_native_prefix)
        else:
            sd = kohya.to_kohya(layers, names, scales, fused, family.kohya_prefixes)
    except kohya.UnmappedKeys as e:
        raise CheckpointError(
            f"The kohya LoRA was not written: {e}.",
            hint="Those layers cannot be named as sd-scripts names them; the diffusers file has them all.",
        ) from None
    except ValueError as e:  # a fused layer the adapter cannot be written as
        raise CheckpointError(
            f"The kohya LoRA was not written: {e}.", hint="Change lora.targets or lora.type."
        ) from None
    with atomic_file(path) as f:
        f.write(save(sd, metadata=metadata(cfg, family, peft_meta)))
    return path


def add_metadata(path: Path, extra: dict[str, str]) -> None:
    """Add fields to a safetensors file's header (rewritten atomically; the tensors are unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import save

    with safe_open(str(path), framework="pt") as f:
        meta = {**(f.metadata() or {}), **extra}
        sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    with atomic_file(path) as f:
        f.write(save(sd, metadata=meta))


def read_lora(
    path: Path, cfg, family, parts: list[str]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, float]]]:
    """A LoRA file of either layout -> (peft-named layers per part, alphas per part and module).
    Only safetensors is read (no pickle); every key that names no module of the model is listed."""
    return read_lora_file(path, cfg.model, family, parts)


def read_lora_file(
    path: Path,
    mcfg,
    family,
    parts: list[str],
    label: str = "lora.init_weights",
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, float]]]:
    """:func:`read_lora` for the model ``mcfg``; ``label`` is what the messages call the file."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise UnsafeCheckpoint(
            f"{label} {path} is not a .safetensors file; difftrain does not unpickle LoRA files.",
            hint="Convert it to .safetensors.",
        )
    try:
        header = read_safetensors_header(path)  # an absurd header length is refused before anything is allocated
        sd = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - OSError, the check's ValueError, safetensors' own error types
        raise CheckpointError(
            f"{label} {path} cannot be read: {str(e).replace(str(path), 'it')}.",
            hint="Give a LoRA .safetensors file (is the download complete?).",
        ) from None
    odd = [k for k, t in sd.items() if not t.is_floating_point() or t.dtype.itemsize < 2]
    if odd:
        raise CheckpointError(
            f"{label} {path}: {odd[0]} is {sd[odd[0]].dtype}, not a LoRA weight (fp32/bf16/fp16).",
            hint="Give a LoRA .safetensors file.",
        )
    meta = header.get("__metadata__") or {}
    expert = meta.get("difftrain.expert")
    if expert and expert != getattr(mcfg, "expert", None):  # a two-expert model's LoRA fits its own expert only
        raise CheckpointError(
            f"{label} {path.name} was trained for the {expert} expert, and this run trains "
            f"{getattr(mcfg, 'expert', None) or 'a model without experts'}.",
            hint=f"Set model.expert: {expert}, or give the LoRA of this expert.",
        )
    try:
        return _parse_lora(sd, meta, path, mcfg, family, parts, label)
    except (ValueError, TypeError, AttributeError, RuntimeError) as e:  # metadata or alphas of the wrong type or shape
        raise CheckpointError(
            f"{label} {path} has a malformed alpha or lora_adapter_metadata: {e}.",
            hint="Give a LoRA file that diffusers, difftrain or sd-scripts wrote.",
        ) from None


def _parse_lora(sd: dict, meta: dict, path: Path, mcfg, family, parts: list[str], label: str):
    native = family.lora_native_prefix
    if native is not None and sd and all(k.startswith(native) for k in sd) and family.denoiser in parts:
        # the model's original names, lora_A / lora_B, the alpha folded in (Krea 2's second file): alpha = rank
        back = {path: module for module, path in family.kohya_names(mcfg, family.denoiser).items()}
        own: dict[str, dict[str, torch.Tensor]] = {family.denoiser: {}}
        unmapped = []
        for key, t in sd.items():
            path_, _, leaf = key[len(native) :].rpartition(".lora_")
            if key.endswith(".dora_scale"):  # DoRA's magnitude (dora_scale [out, 1, ...]) beside the LoRA
                path_, leaf = key[len(native) : -len(".dora_scale")], "magnitude_vector"
                down = sd.get(f"{native}{path_}.lora_A.weight")
                t = lycoris.from_dora_scale(t, down.dim() if down is not None else 2)
            module = back.get(path_)
            if module is None:
                unmapped.append(key)
                continue
            own[family.denoiser][f"{module}.lora_{leaf}"] = t
        if unmapped:
            raise CheckpointError(
                f"{label} {path.name} does not fit this model: {len(unmapped)} keys name no module of it "
                f"({', '.join(sorted(unmapped)[:5])}).",
                hint="Is it a LoRA of this model family and architecture?",
            )
        return own, diffusers_alphas({}, own)
    if kohya.is_kohya(sd):
        prefixes = family.kohya_prefixes or kohya.PREFIXES
        names = {part: family.kohya_names(mcfg, part) for part in parts if part in prefixes}
        fused = {part: family.kohya_fused(mcfg, part) for part in parts if part in prefixes}
        try:
            return kohya.from_kohya(sd, names, fused, family.kohya_prefixes)
        except kohya.UnmappedKeys as e:
            raise CheckpointError(
                f"{label} {path.name} does not fit this model: {e}.",
                hint="Is it a LoRA of this model family and architecture?",
            ) from None
    layers: dict[str, dict[str, torch.Tensor]] = {}
    stray = []
    for key, t in sd.items():
        part, _, rest = key.partition(".")
        if part in parts and rest:
            layers.setdefault(part, {})[rest] = t
        else:
            stray.append(key)
    if stray:
        raise CheckpointError(
            f"{label} {path.name}: {len(stray)} keys belong to no trained part "
            f"({', '.join(parts)}): {', '.join(sorted(stray)[:5])}.",
            hint="Train the parts the file has (train_text_encoders), or give a LoRA of this family.",
        )
    return layers, diffusers_alphas(meta, layers)


def diffusers_alphas(meta: dict[str, str], layers: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Alphas per part and module of a diffusers-layout file: diffusers keeps each part's peft config flattened
    as "<part>.<field>" in the header's lora_adapter_metadata (no config: alpha = rank)."""
    try:
        flat = json.loads(meta.get("lora_adapter_metadata", "{}"))
    except json.JSONDecodeError:
        flat = {}
    flat = flat if isinstance(flat, dict) else {}
    found = {}
    for part, sd_part in layers.items():
        pm = {k[len(part) + 1 :]: v for k, v in flat.items() if k.startswith(part + ".")}
        found[part] = (
            alphas(pm, sd_part)
            if "lora_alpha" in pm
            else {
                k[: -len(".lora_A.weight")]: float(t.shape[0])
                for k, t in sd_part.items()
                if k.endswith(".lora_A.weight")
            }
        )
    return found


def load_into(
    module: torch.nn.Module,
    part: str,
    layers: dict[str, torch.Tensor],
    file_alphas: dict[str, float],
    peft_meta: dict,
    source: Path,
) -> None:
    """Copy a file's LoRA weights into ``module``'s adapter; rank, alpha and the adapted layers must match."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    mine = get_peft_model_state_dict(module, save_embedding_layers=False)
    missing, extra = sorted(set(mine) - set(layers)), sorted(set(layers) - set(mine))
    if missing or extra:
        raise ConfigError(
            f"lora.init_weights {source.name} does not adapt the same {part} layers as this config: "
            f"{len(missing)} missing (e.g. {missing[:2]}), {len(extra)} not adapted here (e.g. {extra[:2]}).",
            hint="Set lora.targets to the layers the file adapts.",
        )
    wrong = [k for k in mine if tuple(mine[k].shape) != tuple(layers[k].shape)]
    if wrong:
        k = wrong[0]
        raise ConfigError(
            f"lora.init_weights {source.name}: {k} is {tuple(layers[k].shape)} in the file, "
            f"{tuple(mine[k].shape)} here.",
            hint="Set lora.rank to the file's rank.",
        )
    want = alphas(peft_meta, mine)
    full = {m for m, leaves in lycoris.modules(mine).items() if lycoris.full_lokr(leaves)}
    if full:  # both LoKr factors full: the file's w1 holds peft's scale alpha / r (lycoris_layers), its alpha is unused
        r = ranks(peft_meta, mine)
        layers = dict(layers)
        for m in full:
            layers[m + ".lokr_w1"] = layers[m + ".lokr_w1"] / (want[m] / r[m])
    off = [m for m, a in want.items() if m not in full and abs(file_alphas.get(m, a) - a) > 1e-6 * max(1.0, a)]
    if off:
        m = off[0]
        raise ConfigError(
            f"lora.init_weights {source.name}: alpha {file_alphas[m]:g} in the file, {want[m]:g} here ({m}).",
            hint=f"Set lora.alpha: {file_alphas[m]:g}.",
        )
    dtype = next(iter(mine.values())).dtype
    result = set_peft_model_state_dict(module, {k: v.to(dtype) for k, v in layers.items()})
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ConfigError(
            f"lora.init_weights {source.name}: {len(unexpected)} keys were not loaded ({unexpected[:2]})."
        )
