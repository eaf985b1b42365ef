"""LyCORIS' adapters (LoHa, LoKr) and DoRA as tensors: their names in peft and in the kohya/LyCORIS layout, and the
weight change each makes, computed as ComfyUI's ``comfy/weight_adapter`` (loha.py, lokr.py, lora.py with base.py's
``weight_decompose``) and LyCORIS compute it.

peft and LyCORIS store LoHa and LoKr alike (peft's layers are ports of LyCORIS' modules): ``hada_w1_a`` [out, r],
``hada_w1_b`` [r, in * kh * kw] ... with ΔW = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r; ``lokr_w1`` (or ``lokr_w1_a``
@ ``lokr_w1_b``) and ``lokr_w2`` (or ``_a`` @ ``_b``) with ΔW = kron(w1, w2) * alpha / r. One difference: where both
LoKr factors are full, LyCORIS, ComfyUI and A1111 apply no scale (there is no rank to divide by), while peft still
multiplies by alpha / r; the file's ``lokr_w1`` then holds that scale (:func:`fold_full_lokr`).

DoRA: peft's ``lora_magnitude_vector`` is one magnitude per output row (the DoRA paper's; [out] for a Linear,
[1, out, 1, 1] for a Conv2d): W' = m * (W + ΔW) / ||W + ΔW|| with the norm of each output row. In the kohya layout
it is ``dora_scale`` shaped [out, 1] ([out, 1, 1, 1]): LyCORIS' ``wd_on_out`` layout, which ComfyUI and Forge tell
from its first dimension. (A1111's built-in extension reads only the input-axis form, [1, in], which peft does not
train; and ComfyUI up to now divides an output-axis dora_scale by the norm of W rather than of W + ΔW, a known bug,
Comfy-Org/ComfyUI#15458, which makes its result differ from LyCORIS' and peft's by that ratio.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

#: peft's name of each adapter tensor -> the kohya/LyCORIS layout's
LEAVES = {
    ".lora_A.weight": ".lora_down.weight",
    ".lora_B.weight": ".lora_up.weight",
    ".lora_magnitude_vector": ".dora_scale",
    **{f".{n}": f".{n}" for n in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")},
    **{f".{n}": f".{n}" for n in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")},
}
BACK = {v: k for k, v in LEAVES.items()}
ALPHA = ".alpha"
#: LyCORIS' (and ComfyUI's, and peft's) Tucker rebuild: core [r, r, kh, kw], w_b [r, in], w_a [r, out]
_TUCKER = "i j k l, j r, i p -> p r k l"
A, B, MAG = ".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector"


def split(key: str, leaves: Iterable[str] = LEAVES) -> tuple[str, str] | None:
    """``<module><leaf>`` -> (module, leaf) for a known leaf, else None."""
    for leaf in leaves:
        if key.endswith(leaf):
            return key[: -len(leaf)], leaf
    return None


def modules(sd: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """peft-named adapter tensors -> {module: {leaf: tensor}}; keys of no known leaf are left out."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        hit = split(key)
        if hit is not None:
            out.setdefault(hit[0], {})[hit[1]] = t
    return out


def kind(leaves: Iterable[str]) -> str:
    """ "lora", "dora", "loha" or "lokr": the adapter a module's (peft or kohya) leaves make."""
    names = " ".join(leaves)
    if "hada_" in names:
        return "loha"
    if "lokr_" in names:
        return "lokr"
    return "dora" if ("magnitude" in names or "dora_scale" in names) else "lora"


def rank(leaves: Mapping[str, torch.Tensor]) -> int | None:
    """The rank the file's alpha is divided by, as ComfyUI takes it (LoKr: that of the low-rank factor, w2's where
    both are; None where both LoKr factors are full: no scale)."""
    if A in leaves:
        return int(leaves[A].shape[0])
    if ".hada_w1_b" in leaves:
        return int(leaves[".hada_w1_b"].shape[0])
    if ".lokr_w2_b" in leaves:
        return int(leaves[".lokr_w2_b"].shape[0])
    if ".lokr_w1_b" in leaves:
        return int(leaves[".lokr_w1_b"].shape[0])
    return None


def full_lokr(leaves: Iterable[str]) -> bool:
    names = set(leaves)
    return ".lokr_w1" in names and ".lokr_w2" in names


def fold_full_lokr(leaves: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A LoKr module with both factors full, as the file holds it: w1 times peft's alpha / r (readers apply none)."""
    if not full_lokr(leaves):
        return leaves
    return {**leaves, ".lokr_w1": leaves[".lokr_w1"] * scale}


def to_dora_scale(magnitude: torch.Tensor, ndim: int) -> torch.Tensor:
    """peft's magnitude ([out] or [1, out, 1, 1]) -> dora_scale [out, 1, ...] for a weight of ``ndim`` dimensions."""
    return magnitude.reshape(-1, *[1] * (ndim - 1))


def from_dora_scale(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """dora_scale [out, 1, ...] -> peft's magnitude: [out] for a Linear, [1, out, 1, 1] for a Conv2d."""
    flat = scale.reshape(-1)
    return flat if ndim == 2 else flat.reshape(1, -1, *[1] * (ndim - 2))


def product(leaves: Mapping[str, torch.Tensor], alpha: float | None, shape: torch.Size) -> torch.Tensor:
    """The adapter's low-rank product (before DoRA's normalisation) in fp32, shaped ``shape``, as ComfyUI's
    calculate_weight makes ``lora_diff * alpha``: LoRA up @ down, LoHa (w1a @ w1b) * (w2a @ w2b), LoKr kron(w1, w2),
    times alpha / rank (1 where ``alpha`` is None or both LoKr factors are full)."""
    f = {k: v.float() for k, v in leaves.items()}
    r = rank(leaves)
    scale = alpha / r if (alpha is not None and r is not None) else 1.0
    k = kind(leaves)
    if k == "loha" and ".hada_t1" in f:  # Tucker: a core [r, r, kh, kw] between the factors [r, out] and [r, in]
        diff = torch.einsum(_TUCKER, f[".hada_t1"], f[".hada_w1_b"], f[".hada_w1_a"]) * torch.einsum(
            _TUCKER, f[".hada_t2"], f[".hada_w2_b"], f[".hada_w2_a"]
        )
    elif k == "loha":
        diff = (f[".hada_w1_a"] @ f[".hada_w1_b"]) * (f[".hada_w2_a"] @ f[".hada_w2_b"])
    elif k == "lokr":
        w1 = f[".lokr_w1"] if ".lokr_w1" in f else f[".lokr_w1_a"] @ f[".lokr_w1_b"]
        if ".lokr_t2" in f:
            w2 = torch.einsum(_TUCKER, f[".lokr_t2"], f[".lokr_w2_b"], f[".lokr_w2_a"])
        else:
            w2 = f[".lokr_w2"] if ".lokr_w2" in f else f[".lokr_w2_a"] @ f[".lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        diff = torch.kron(w1, w2.contiguous())  # torch.kron fails on a strided 4-D factor (a Tucker rebuild's)
    else:
        diff = f[B].flatten(1) @ f[A].flatten(1)
    return (diff * scale).reshape(shape)


def delta(leaves: Mapping[str, torch.Tensor], alpha: float | None, weight: torch.Tensor) -> torch.Tensor:
    """W' - W in fp32 for the base weight ``weight``: the product, or for DoRA m * (W + ΔW) / ||W + ΔW|| - W with the
    norm of each output row (LyCORIS' wd_on_out, peft's DoRA)."""
    diff = product(leaves, alpha, weight.shape)
    if MAG not in leaves:
        return diff
    w = weight.float()
    merged = w + diff
    norm = merged.reshape(merged.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (w.dim() - 1))
    m = leaves[MAG].float().reshape(-1, *[1] * (w.dim() - 1))
    return merged * (m / norm) - w


def out_and_size(leaves: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(output rows, elements) of the ΔW a module's tensors make, to check them against a weight before it is read."""
    f = dict(leaves)
    k = kind(f)
    if k == "loha" and ".hada_t1" in f:
        out = int(f[".hada_w1_a"].shape[1])
        return out, out * int(f[".hada_w1_b"].shape[1]) * int(f[".hada_t1"][0, 0].numel())
    if k == "loha":
        return int(f[".hada_w1_a"].shape[0]), int(f[".hada_w1_a"].shape[0] * f[".hada_w1_b"].shape[1])
    if k == "lokr":
        w1 = f[".lokr_w1"].shape if ".lokr_w1" in f else (f[".lokr_w1_a"].shape[0], f[".lokr_w1_b"].shape[1])
        if ".lokr_t2" in f:
            w2 = (f[".lokr_w2_a"].shape[1], f[".lokr_w2_b"].shape[1], *f[".lokr_t2"].shape[2:])
        else:
            w2 = f[".lokr_w2"].shape if ".lokr_w2" in f else (f[".lokr_w2_a"].shape[0], f[".lokr_w2_b"].shape[1])
        rest = 1
        for s in w2[2:]:
            rest *= int(s)
        return int(w1[0] * w2[0]), int(w1[0] * w2[0] * w1[1] * w2[1] * rest)
    return int(f[B].shape[0]), int(f[B].shape[0] * f[A][0].numel())
