"""GEGLU's backward in SDXL's transformer blocks (issue 24): inductor's fused kernel against alternatives.

The S2g profile put GEGLU's backward at 11.4 ms a step (70 calls), about twice its memory roofline. This times
the feed-forward of one block (GEGLU projection, gate, output projection; frozen bf16 weights, the input needing
a gradient, as under LoRA) at SDXL's two shapes with batch 4, compiled, in three forms:

- ``stock``: diffusers' GEGLU as it is;
- ``split``: the projection as two Linears (value, gate), so the backward writes two plain tensors, no concat;
- ``triton``: diffusers' GEGLU with difftrain's Triton backward for the gate (difftrain.geglu, speed.geglu).

It prints s per forward+backward, the GEGLU-backward kernel's time against its memory roofline, and the gradients'
difference from ``stock``; inductor's generated code goes to OUT/output_code.txt.

    TORCH_LOGS=output_code python3 benchmarks/geglu.py --out $OUT 2> $OUT/output_code.txt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"1280ch-32x32": (4 * 1024, 1280, 5120), "640ch-64x64": (4 * 4096, 640, 2560)}
HBM_BYTES_S = 3.35e12  # H100 SXM's HBM3


def roofline_ms(rows: int, inner: int) -> float:
    """Bytes GEGLU's backward must move: read the gradient (rows x inner) and the projection (rows x 2 inner), write
    the projection's gradient (rows x 2 inner), bf16."""
    return rows * inner * 5 * 2 / HBM_BYTES_S * 1e3


class Split(torch.nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.h, self.g = torch.nn.Linear(dim, inner), torch.nn.Linear(dim, inner)

    def forward(self, x):
        return self.h(x) * F.gelu(self.g(x))


def build(kind: str, dim: int, inner: int):
    from diffusers.models.activations import GEGLU

    from difftrain.speed import geglu as kg

    torch.manual_seed(0)
    act = ref = GEGLU(dim, inner)  # every kind starts from these weights
    if kind == "split":
        act = Split(dim, inner)
        with torch.no_grad():
            act.h.weight.copy_(ref.proj.weight[:inner]), act.h.bias.copy_(ref.proj.bias[:inner])
            act.g.weight.copy_(ref.proj.weight[inner:]), act.g.bias.copy_(ref.proj.bias[inner:])
    if kind == "triton":
        kg.use_fused(act)
    torch.manual_seed(1)
    m = torch.nn.Sequential(act, torch.nn.Linear(inner, dim)).cuda().to(torch.bfloat16).requires_grad_(False)
    return torch.compile(m)


def time_it(m, x, g, n=30) -> tuple[float, torch.Tensor]:
    for _ in range(3):
        x.grad = None
        m(x).backward(g)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        x.grad = None
        m(x).backward(g)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n, x.grad.clone()


def kernels(m, x, g) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            x.grad = None
            m(x).backward(g)
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / 5 / 1e3) for e in p.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kinds", default="stock,split,triton")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for shape, (rows, dim, inner) in SHAPES.items():
        torch.manual_seed(2)
        x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
        ref = None
        for kind in a.kinds.split(","):
            m = build(kind, dim, inner)
            ms, grad = time_it(m, x, g)
            ks = kernels(m, x, g)
            ref = grad if ref is None else ref
            diff = ((grad.float() - ref.float()).norm() / ref.float().norm()).item()
            pointwise = [k for k in ks if "triton" in k[0].lower()]  # inductor's kernels and ours
            results.append(
                {
                    "shape": shape,
                    "kind": kind,
                    "ms": round(ms, 4),
                    "rel_diff_vs_first": diff,
                    "roofline_bwd_ms": round(roofline_ms(rows, inner), 4),
                    "kernels": [(k, round(t, 4)) for k, t in ks[:12]],
                    "triton_ms": round(sum(t for _, t in pointwise), 4),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    (a.out / "geglu.json").write_text(json.dumps(results, indent=1))
    print("\n| shape | kind | ms fwd+bwd | Triton kernels ms | bwd roofline ms | grad rel. diff |")
    for r in results:
        print(
            f"| {r['shape']} | {r['kind']} | {r['ms']:.3f} | {r['triton_ms']:.3f} | {r['roofline_bwd_ms']:.3f} "
            f"| {r['rel_diff_vs_first']:.2e} |"
        )


if __name__ == "__main__":
    main()
