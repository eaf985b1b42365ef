"""difftrain lora merge / resize: bake a LoRA into a single-file checkpoint; change a LoRA's rank by SVD.

Both read the two layouts difftrain writes (diffusers/peft ``<part>.<module>.lora_A.weight`` with the peft
config in the header, and kohya ``lora_<prefix>_<path>.lora_down.weight`` with ``.alpha`` tensors), safetensors
only. A layer's change to its weight is ΔW = (alpha / rank) * up @ down (a Conv2d LoRA's down is a conv of the
layer's kernel, its up a 1x1 conv: the same product with the kernel flattened into the input dimension).
merge also bakes DoRA (``lora_magnitude_vector`` / ``dora_scale``) and LyCORIS' LoHa and LoKr (lycoris.py: the
weights ComfyUI computes from them); resize takes plain LoRAs only and says why for the others.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config.schema import ModelConfig
from ..errors import CheckpointError, ModelLoadError, UnsafeCheckpoint, UsageError
from ..utils import atomic_file, read_safetensors_header, stored_float_dtype, to_dtype
from . import kohya, lycoris

if TYPE_CHECKING:
    from ..families.base import ModelFamily

_A, _B = ".lora_A.weight", ".lora_B.weight"
_SUFFIXES = {"diffusers": (_A, _B), "kohya": (".lora_down.weight", ".lora_up.weight", ".alpha")}
_HADA = (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b")
#: what each layout may hold besides: DoRA's magnitude, LyCORIS' LoHa and LoKr tensors (lycoris.py)
_MORE = {
    "diffusers": (lycoris.MAG, ".dora_scale"),  # dora_scale: a DoRA in the model's own names (Krea 2's file)
    "kohya": tuple(k for k in lycoris.BACK if k not in _SUFFIXES["kohya"]),
}
#: the denoiser part name -> the families that have it, to name the family a stray LoRA was made for
_DENOISER_OF = {"unet": "SDXL", "transformer": "SD3 (or another MMDiT/DiT)"}
#: header fields that hash the old tensors: wrong once they change
_STALE = ("sshs_model_hash", "sshs_legacy_hash", "modelspec.hash_sha256")


def delta(down: torch.Tensor, up: torch.Tensor, alpha: float) -> torch.Tensor:
    """ΔW = alpha / rank * up @ down in fp32, shaped as the adapted layer's weight ([out, in] or [out, in, kh, kw])."""
    d = (up.flatten(1).float() @ down.flatten(1).float()) * (alpha / down.shape[0])
    return d.reshape(up.shape[0], *down.shape[1:])


def _read(path: Path, label: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A .safetensors LoRA's tensors and header metadata (never a pickle)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise UnsafeCheckpoint(
            f"{label} {path} is not a .safetensors file; difftrain does not unpickle LoRA files.",
            hint="Convert it to .safetensors (or give the .safetensors file difftrain wrote).",
        )
    if not path.is_file():
        raise UsageError(f"{label} {path} does not exist.", hint="Give the path of a LoRA .safetensors file.")
    try:
        meta = read_safetensors_header(path).get("__metadata__") or {}
        return load_file(str(path)), meta
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
        raise CheckpointError(
            f"{label} {path} cannot be read: {e}.", hint="Is the file complete? Give a LoRA .safetensors file."
        ) from None


def _layout(sd: dict[str, torch.Tensor], path: Path) -> str:
    """ "kohya" or "diffusers"; every key must be one of that layout's LoRA tensors (else all are named)."""
    layout = "kohya" if kohya.is_kohya(sd) else "diffusers"
    other = sorted(k for k in sd if not k.endswith(_SUFFIXES[layout] + _MORE[layout]))
    if other or not sd:
        shown = ", ".join(other[:5]) + (f" (and {len(other) - 5} more)" if len(other) > 5 else "")
        raise CheckpointError(
            f"{path.name} is not a LoRA difftrain can read: "
            + (
                f"{len(other)} keys are not {layout}-layout LoRA weights: {shown}." if other else "it holds no tensors."
            ),
            hint="difftrain reads LoRA and DoRA (lora_A/lora_B or lora_down/lora_up + alpha, dora_scale) and "
            "LyCORIS' LoHa / LoKr (hada_*, lokr_*); other adapters (LoCon's Tucker mid weights, OFT, GLoRA): use the "
            "tool that made them.",
        )
    return layout


# ------------------------------------------------------------------ merge
@dataclass
class MergeResult:
    path: Path
    family: str
    layout: str
    dtype: torch.dtype
    layers: dict[str, int]  # per part: how many layers were merged


def _mergeable() -> list[ModelFamily]:
    """The families whose LoRAs can be merged into a single file (CogVideoX has no single-file layout)."""
    from ..families.registry import all_families

    return [f for f in all_families() if f.mergeable]


def _family_of(base: Path, keys: list[str] | None) -> ModelFamily:
    from ..families.common import read_json

    mergeable = _mergeable()
    if keys is not None:
        found = "unknown"
        hit = next((f for f in mergeable if f.recognises_single_file(keys)), None)
    else:
        index = base / "model_index.json"
        found = str(read_json(index).get("_class_name", "?")) if index.is_file() else "no model_index.json"
        hit = next((f for f in mergeable if f.recognises_folder(base, found)), None)
    if hit is not None:
        return hit
    names = [f.name for f in mergeable]
    raise UsageError(
        f"Cannot tell which model family {base} is ({found}); lora merge handles {', '.join(names)}.",
        hint="Pass " + " or ".join(f"--family {n}" for n in names) + ".",
    )


def _base(base: Path, family: str | None, config: str | None):
    """(family, model config, parts present, weight files) of a single-file checkpoint or a diffusers folder."""
    from ..families.registry import get_family
    from ..runtime.hub import parse_hub_id, resolve_model_path

    if not Path(base).expanduser().exists() and parse_hub_id(base) is not None:
        # a Hub id: the parts a merge writes into (the denoiser and text encoders), from the cache or downloaded
        wanted = (
            get_family(family).parts if family else ("unet", "transformer", "text_encoder", "text_encoder_2", "vae")
        )
        base = resolve_model_path(base, wanted)[0] or Path(base)
    base = Path(base).expanduser()
    if not base.exists():
        raise ModelLoadError(
            f"The base model {base} does not exist.", hint="Give a .safetensors checkpoint or a diffusers folder."
        )
    keys = None
    if base.is_dir():
        files = sorted(base.glob("*/*.safetensors"))
    else:
        if base.suffix.lower() != ".safetensors":
            raise UnsafeCheckpoint(
                f"The base model {base.name} is not a .safetensors file; difftrain does not unpickle "
                "checkpoints to merge into them.",
                hint="Convert it to .safetensors first.",
            )
        try:
            keys = [k for k in read_safetensors_header(base) if k != "__metadata__"]
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{base} cannot be read: {e}", hint="Is the download complete?") from None
        files = [base]
    if family is None:
        fam = _family_of(base, keys)
    else:
        mergeable = [f.name for f in _mergeable()]
        if family not in mergeable:
            raise UsageError(
                f"lora merge handles {', '.join(mergeable)}, not {family}.",
                hint="CogVideoX has no single-file layout: load its LoRA with the pipeline's load_lora_weights.",
            )
        fam = get_family(family)
    all_parts = fam.parts
    if keys is None:
        parts = [p for p in all_parts if (base / p).is_dir()]
        pickled = [p for p in parts if not any((base / p).glob("*.safetensors"))]
        if pickled:
            raise UnsafeCheckpoint(
                f"{base}: the weights of {', '.join(pickled)} are not .safetensors files; difftrain "
                "does not unpickle checkpoints to merge into them.",
                hint="Save the folder with safe_serialization=True (or convert it) first.",
            )
    else:
        parts = fam.parts_in_single_file(keys)
        if config is None:
            config = fam.single_file_architecture(keys)
    return fam, ModelConfig(path=base, config=config), parts, files


def _lora_parts(sd: dict[str, torch.Tensor], layout: str, prefixes=None) -> set[str]:
    """The parts (unet, text_encoder, ...) a LoRA file's keys adapt (``prefixes``: the family's kohya ones)."""
    if layout == "diffusers":
        return {k.partition(".")[0] for k in sd}
    found = set()
    for k in sd:
        hit = [part for part, prefix in (prefixes or kohya.PREFIXES).items() if k.startswith(prefix + "_")]
        found.add(hit[0] if hit else k.partition(".")[0])
    return found


def _check_fit(fam, mcfg: ModelConfig, layers: dict[str, dict[str, torch.Tensor]], lora: Path) -> None:
    """Every layer names a Linear/Conv2d of the base model and its ΔW has that layer's weight shape (checked on
    meta-device copies of the parts, before a weight is read); all that do not are named."""
    unmapped: list[str] = []
    wrong: list[str] = []
    for part, sd in layers.items():
        with torch.device("meta"):
            modules = dict(fam.empty_part(mcfg, part).named_modules())
        stray = [k for k in sd if lycoris.split(k) is None]
        unmapped.extend(f"{part}.{k}" for k in stray)
        for module, leaves in lycoris.modules(sd).items():
            m = modules.get(module)
            if not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                unmapped.extend(f"{part}.{module}{leaf}" for leaf in leaves)
                continue
            kind = lycoris.kind(leaves)
            need = {"lora": (_A, _B), "dora": (_A, _B, lycoris.MAG), "loha": _HADA}.get(kind, ())
            lacking = [leaf for leaf in need if leaf not in leaves]
            if kind == "lokr" and not (
                (".lokr_w1" in leaves or {".lokr_w1_a", ".lokr_w1_b"} <= set(leaves))
                and (".lokr_w2" in leaves or {".lokr_w2_a", ".lokr_w2_b"} <= set(leaves))
            ):
                lacking = ["a lokr_w1 or lokr_w2 factor"]
            if lacking:
                wrong.append(f"{part}.{module}: no {', '.join(x.strip('.') for x in lacking)}")
                continue
            if kind in ("lora", "dora"):
                down, up = leaves[_A], leaves[_B]
                if up.shape[1] != down.shape[0] or up.dim() != down.dim() or any(s != 1 for s in up.shape[2:]):
                    wrong.append(
                        f"{part}.{module}: down {tuple(down.shape)} and up {tuple(up.shape)} are not one LoRA "
                        "(rank or kernel differ)"
                    )
                    continue
            try:
                out, size = lycoris.out_and_size(leaves)
            except (RuntimeError, IndexError, KeyError) as e:
                wrong.append(f"{part}.{module}: its {kind} tensors are not one adapter ({e})")
                continue
            if out != m.weight.shape[0] or size != m.weight.numel():
                wrong.append(
                    f"{part}.{module}: ΔW of {out} rows and {size} elements, the model's weight {tuple(m.weight.shape)}"
                )
            elif kind == "dora" and leaves[lycoris.MAG].numel() != out:
                wrong.append(f"{part}.{module}: DoRA magnitude of {leaves[lycoris.MAG].numel()} rows, ΔW has {out}")
    if unmapped:
        more = f" (and {len(unmapped) - 8} more)" if len(unmapped) > 8 else ""
        raise CheckpointError(
            f"{lora.name} does not fit this model: {len(unmapped)} keys name no Linear/Conv2d module "
            f"of it: {', '.join(sorted(unmapped)[:8])}{more}.",
            hint="Is it a LoRA of this model family and architecture?",
        )
    if wrong:
        raise CheckpointError(
            f"{lora.name} does not fit this model ({len(wrong)} layers): {'; '.join(wrong[:5])}.",
            hint="Is it a LoRA of this architecture (e.g. SDXL base, not the refiner; SD3 medium, not "
            "SD3.5)? For a single file, --config names the bundled architecture.",
        )


def merge(
    base: Path,
    lora: Path,
    out: Path,
    scale: float = 1.0,
    family: str | None = None,
    config: str | None = None,
    precision: str | None = None,
) -> MergeResult:
    """Write ``base`` with ``lora`` (times ``scale``) merged into its weights as one single-file checkpoint.

    Each adapted weight becomes W + scale * ΔW, computed in fp32; the file is written in ``precision`` (fp16 |
    bf16 | fp32), else in the dtype most of the base is stored in. Everything that can be wrong with the
    LoRA is found before the base model is read, and ``out`` is written atomically.
    """
    from .files import read_lora_file

    base, lora, out = Path(base), Path(lora), Path(out)
    if out.suffix.lower() != ".safetensors" or out.is_dir():
        raise UsageError(
            f"-o {out}: the merged checkpoint is a single .safetensors file.", hint="Name it e.g. merged.safetensors."
        )
    if out.exists() and out.resolve() in (base.resolve(), lora.resolve()):
        raise UsageError(f"-o {out} is an input of the merge.", hint="Write the merged checkpoint to a new file.")
    if not math.isfinite(scale):
        raise UsageError(f"--scale {scale} is not a number.", hint="Give e.g. --scale 0.8.")
    sd, _ = _read(lora, "The LoRA")
    layout = _layout(sd, lora)
    fam, mcfg, parts, files = _base(base, family, config)
    adaptable = [p for p in parts if p == fam.denoiser or p in fam.text_encoders]
    found = _lora_parts(sd, layout, fam.kohya_prefixes)
    if fam.lora_native_prefix and all(k.startswith(fam.lora_native_prefix) for k in sd):
        found = {fam.denoiser}  # the model's own names under its prefix (Krea 2's second file)
    stray = sorted(found - set(adaptable))
    if stray:
        made_for = [_DENOISER_OF[p] for p in stray if p in _DENOISER_OF and p != fam.denoiser]
        why = f"it looks made for {made_for[0]}" if made_for else f"the base has no {', '.join(stray)} weights"
        raise CheckpointError(
            f"{lora.name} adapts {', '.join(stray)}, which the {fam.name.upper()} base {base.name} "
            f"does not have: {why}.",
            hint=f"Give a LoRA of this family ({fam.name}), or the base it was trained on.",
        )
    del sd
    layers, alphas = read_lora_file(lora, mcfg, fam, adaptable, label="The LoRA")
    _check_fit(fam, mcfg, layers, lora)
    stored = stored_float_dtype(files) or torch.float32
    out_dtype = to_dtype(precision) if precision else stored
    comps = fam.load(mcfg, parts, dtype=stored, device="cpu", tokenizers=False)
    sds = {p: comps[p].state_dict() for p in parts}
    counts = {}
    for part, sd_part in layers.items():
        adapted = lycoris.modules(sd_part)
        for module, leaves in adapted.items():
            key = module + ".weight"
            w = sds[part][key]
            # LoRA, DoRA, LoHa, LoKr: W + scale * (W' - W), ComfyUI's strength (and sd-scripts' merge ratio)
            sds[part][key] = w.float() + scale * lycoris.delta(leaves, alphas[part].get(module), w)
        counts[part] = len(adapted)
    fam.save_single_file(sds, fam.module_configs(comps), out, dtype=out_dtype)
    return MergeResult(out, fam.name, layout, out_dtype, counts)


# ------------------------------------------------------------------ resize
@dataclass
class LayerResize:
    name: str
    rank: int
    new_rank: int
    energy: float  # kept sum of sigma^2 / total
    total: float  # sum of sigma^2 of ΔW


@dataclass
class ResizeResult:
    path: Path
    layout: str
    layers: list[LayerResize] = field(default_factory=list)

    @property
    def overall(self) -> float:
        total = sum(r.total for r in self.layers)
        return sum(r.energy * r.total for r in self.layers) / total if total > 0 else 1.0

    @property
    def mean(self) -> float:
        return sum(r.energy for r in self.layers) / len(self.layers)

    @property
    def min(self) -> LayerResize:
        return min(self.layers, key=lambda r: r.energy)


def _pairs(sd: dict[str, torch.Tensor], meta: dict[str, str], layout: str) -> dict[str, tuple[str, str, float]]:
    """Each layer (its name in the file) -> (down key, up key, alpha)."""
    from .files import diffusers_alphas

    down_sfx, up_sfx = _SUFFIXES[layout][:2]
    out = {}
    if layout == "kohya":
        for key in sd:
            if key.endswith(down_sfx):
                name = key[: -len(down_sfx)]
                stored = sd.get(name + ".alpha")
                out[name] = (
                    key,
                    name + up_sfx,
                    float(stored.item()) if stored is not None else float(sd[key].shape[0]),
                )
        return out
    by_part: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        part, _, rest = key.partition(".")
        by_part.setdefault(part, {})[rest] = t
    for part, found in diffusers_alphas(meta, by_part).items():
        for module, alpha in found.items():
            name = f"{part}.{module}"
            out[name] = (name + down_sfx, name + up_sfx, alpha)
    return out


def _svd(down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, S, Vh of up @ down (flattened to 2-D), in fp64. The product has rank <= r, so it is taken from the SVD of the
    r x r core of two QR factors (up = Qu Ru, downᵀ = Qd Rd: up @ down = Qu (Ru Rdᵀ) Qdᵀ): exact, and milliseconds
    where the SVD of a 1280 x 5120 product takes a second."""
    qu, ru = torch.linalg.qr(up.flatten(1).double())
    qd, rd = torch.linalg.qr(down.flatten(1).double().T)
    u, s, vh = torch.linalg.svd(ru @ rd.T)
    return qu @ u, s, vh @ qd.T


def _new_rank(s2: torch.Tensor, rank: int | None, energy: float | None) -> int:
    total = float(s2.sum())
    if total <= 0:  # a zero ΔW: rank 1 (of zeros), as sd-scripts does
        return 1
    k = len(s2) if rank is None else min(rank, len(s2))
    if energy is not None:
        kept = torch.cumsum(s2, 0) / total
        k = min(k, int(torch.searchsorted(kept, torch.tensor(energy - 1e-12, dtype=kept.dtype))) + 1)
    return max(1, k)


def resize(lora: Path, out: Path, rank: int | None = None, energy: float | None = None) -> ResizeResult:
    """Write ``lora`` with each layer's ΔW cut to its best rank-k approximation (truncated SVD): k = ``rank``, or
    the smallest k that keeps ``energy`` of the layer's sum of sigma^2 (at most ``rank``). The scale is kept exact as
    sd-scripts' networks/resize_lora.py keeps it: up = U S, down = Vh, alpha = (old alpha / old rank) * k. Layout,
    key names, dtypes and metadata are kept (rank/alpha fields updated, stale hashes dropped); written atomically."""
    from safetensors.torch import save

    lora, out = Path(lora), Path(out)
    if rank is None and energy is None:
        raise UsageError(
            "lora resize needs --rank, --energy or both.", hint="e.g. --rank 8, or --energy 0.95 --rank 32."
        )
    if rank is not None and rank < 1:
        raise UsageError(f"--rank {rank}: a rank is at least 1.")
    if energy is not None and not 0 < energy <= 1:
        raise UsageError(f"--energy {energy}: the fraction of energy to keep is in (0, 1].", hint="e.g. --energy 0.95.")
    if out.suffix.lower() != ".safetensors" or out.is_dir():
        raise UsageError(
            f"-o {out}: the resized LoRA is a .safetensors file.", hint="Name it e.g. lora_r8.safetensors."
        )
    sd, meta = _read(lora, "The LoRA")
    layout = _layout(sd, lora)
    _refuse_other_adapters(sd, lora)
    pairs = _pairs(sd, meta, layout)
    missing = sorted(up for _, up, _ in pairs.values() if up not in sd)
    if missing or not pairs:
        raise CheckpointError(
            f"{lora.name}: "
            + (
                f"{len(missing)} layers have no up weight ({', '.join(missing[:3])})."
                if missing
                else "no LoRA layer found."
            ),
            hint="Is the file complete?",
        )
    old_max = max(sd[d].shape[0] for d, _, _ in pairs.values())
    if rank is not None and rank > old_max and energy is None:
        raise UsageError(
            f"--rank {rank} is above the LoRA's rank {old_max}: ΔW has rank <= {old_max}, a larger rank adds nothing.",
            hint=f"Give --rank {old_max} or less.",
        )
    result = ResizeResult(out, layout)
    new = dict(sd)
    new_alphas: dict[str, float] = {}
    for name, (dk, uk, alpha) in pairs.items():
        down, up = sd[dk], sd[uk]
        u, s, vh = _svd(down, up)
        s2 = s.square()
        k = _new_rank(s2, rank, energy)
        total = float(s2.sum())
        result.layers.append(
            LayerResize(
                name,
                down.shape[0],
                k,
                float(s2[:k].sum()) / total if total > 0 else 1.0,
                total * (alpha / down.shape[0]) ** 2,
            )
        )
        new[uk] = (u[:, :k] * s[:k]).reshape(up.shape[0], k, *up.shape[2:]).to(up.dtype).contiguous()
        new[dk] = vh[:k].reshape(k, *down.shape[1:]).to(down.dtype).contiguous()
        new_alphas[name] = alpha / down.shape[0] * k
        if layout == "kohya" and name + ".alpha" in sd:
            new[name + ".alpha"] = torch.tensor(new_alphas[name], dtype=sd[name + ".alpha"].dtype)
        elif layout == "kohya":
            new[name + ".alpha"] = torch.tensor(new_alphas[name], dtype=torch.float32)
    ranks = {r.name: r.new_rank for r in result.layers}
    with atomic_file(out) as f:
        f.write(save(new, metadata=_resized_metadata(meta, layout, ranks, new_alphas, old_max, rank, energy)))
    return result


#: why each adapter other than a plain LoRA has no exact smaller rank
_NO_RESIZE = {
    "loha": "a LoHa's ΔW is the Hadamard product of two rank-r products, whose rank is up to r², and no pair of "
    "smaller factors is its best approximation (an SVD cuts a product, not a Hadamard product of two)",
    "lokr": "a LoKr's ΔW is a Kronecker product, whose factors are not low-rank products an SVD could cut (its rank is "
    "the product of theirs)",
    "dora": "a DoRA's magnitude divides by the norm of each row of W + ΔW: cutting ΔW's rank changes every norm, so the "
    "file would no longer make its trained weights, and the cut cannot be measured without the base model",
}


def _refuse_other_adapters(sd: dict[str, torch.Tensor], lora: Path) -> None:
    """lora resize cuts a LoRA's up @ down by SVD: any other adapter is refused with the reason."""
    kinds = {lycoris.kind([k]) for k in sd}
    other = [k for k in ("dora", "loha", "lokr") if k in kinds]
    if other:
        k = other[0]
        raise UsageError(
            f"lora resize: {lora.name} is a {k.upper() if k != 'dora' else 'DoRA'} file, which has no exact smaller "
            f"rank: {_NO_RESIZE[k]}.",
            hint="Resize plain LoRA files only; for a smaller file, train again with a lower lora.rank (or lora merge "
            "it into the base model).",
        )


def _resized_metadata(
    meta: dict[str, str],
    layout: str,
    ranks: dict[str, int],
    alphas: dict[str, float],
    old_max: int,
    rank: int | None,
    energy: float | None,
) -> dict[str, str]:
    """The header with sd-scripts' fields as its resize_lora.py sets them, and (diffusers layout) the peft config
    each part is loaded with: the most common rank and alpha, the others in rank_pattern / alpha_pattern."""
    meta = {k: v for k, v in meta.items() if k not in _STALE}
    one = lambda values: f"{next(iter(values)):g}" if len(set(values)) == 1 else "Dynamic"
    comment = meta.get("ss_training_comment", "")
    how = (
        f"to {rank}"
        if energy is None
        else f"to keep {energy:g} of the energy (sv_fro {math.sqrt(energy):.4g}), rank <= {rank or old_max}"
    )
    meta.update(
        {
            "ss_network_dim": one(ranks.values()),
            "ss_network_alpha": one(alphas.values()),
            "ss_training_comment": f"dimension is resized from {old_max} {how}; {comment}".rstrip("; "),
        }
    )
    if layout == "diffusers" and "lora_adapter_metadata" in meta:
        try:
            flat = json.loads(meta["lora_adapter_metadata"])
        except json.JSONDecodeError:
            flat = {}
        for part in {n.partition(".")[0] for n in ranks}:
            mods = {n.partition(".")[2]: (ranks[n], alphas[n]) for n in ranks if n.partition(".")[0] == part}
            r = Counter(v[0] for v in mods.values()).most_common(1)[0][0]
            a = Counter(v[1] for v in mods.values()).most_common(1)[0][0]
            flat.update(
                {
                    f"{part}.r": r,
                    f"{part}.lora_alpha": a,
                    f"{part}.rank_pattern": {m: v[0] for m, v in mods.items() if v[0] != r},
                    f"{part}.alpha_pattern": {m: v[1] for m, v in mods.items() if v[1] != a},
                }
            )
        meta["lora_adapter_metadata"] = json.dumps(flat, indent=2, sort_keys=True)
    return meta
