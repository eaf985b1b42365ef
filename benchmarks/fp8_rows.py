"""speed.fp8_matmul's row casts (memory/fp8.py): the Triton kernel against the torch ops the fp8 matmul ops use
(``rows_fp8_torch``), and one fp8 Linear's forward + input gradient with each, against the bf16 Linear's, at
FLUX.2 [dev]'s widths (1024x1024: 4,608 tokens). Whether the ops should take the kernel is what this measures.

For each shape [rows, in] -> out it times, on the GPU (CUDA events, after warm-up):

- ``cast torch``: the row cast in torch ops (``rows_fp8_torch``: five of them, float32 copies);
- ``cast triton``: the kernel (``rows_fp8_triton``), with its memory roofline (read the row twice, write a byte);
- ``fp8 linear``: the fp8-stored Linear with fp8 matmuls, forward then input gradient (two casts, two matmuls),
  with each cast put in the ops' place;
- ``bf16 linear``: F.linear in bf16 and its input gradient, the plain loop's layer;

and checks that the kernel's bytes and scales equal the torch ops'. JSON to OUT/fp8_rows.json, a table last.

    python3 benchmarks/fp8_rows.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

# FLUX.2 [dev] (hidden 6144, MLP 18432): a single block's fused projection and its output, a double block's
# attention projection and MLP output; rows are 4096 image + 512 text tokens
SHAPES = {
    "single qkv+mlp in": (4608, 6144, 55296),
    "single out": (4608, 24576, 6144),
    "double q/k/v": (4096, 6144, 6144),
    "double mlp out": (4096, 18432, 6144),
}
HBM_BYTES_S = 4.8e12  # H200's HBM3e (an H100 SXM has 3.35e12)


def time_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def with_cast(fp8, cast, step) -> float:
    """``step`` timed with the fp8 matmul ops' row cast replaced by ``cast`` (the module's global, which they read
    on each call), then put back."""
    own = fp8._rows_fp8
    fp8._rows_fp8 = cast
    try:
        return time_ms(step)
    finally:
        fp8._rows_fp8 = own


def measure(name: str, rows: int, k: int, n: int) -> dict:
    from difftrain.memory import fp8

    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q_ref, s_ref = fp8.rows_fp8_torch(x)
    q, s = fp8.rows_fp8_triton(x)
    same = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref))
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    w = layer.weight.detach().clone()
    fp8.convert(layer, torch.device("cuda"))
    layer.fp8_matmul = fp8.fp8_matmul_ok(layer)
    assert layer.fp8_matmul, f"{name}: not an fp8 matmul layer"
    xg = x.clone().requires_grad_()
    gy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

    def fp8_step():
        xg.grad = None
        layer(xg).backward(gy)

    def bf16_step():
        xg.grad = None
        F.linear(xg, w).backward(gy)

    return {
        "shape": name,
        "rows": rows,
        "in": k,
        "out": n,
        "kernel_equals_torch": same,
        "cast_torch_ms": round(time_ms(lambda: fp8.rows_fp8_torch(x)), 4),
        "cast_triton_ms": round(time_ms(lambda: fp8.rows_fp8_triton(x)), 4),
        "cast_roofline_ms": round(rows * k * 5 / HBM_BYTES_S * 1e3, 4),
        "fp8_linear_ms": round(with_cast(fp8, fp8.rows_fp8_torch, fp8_step), 4),
        "fp8_linear_kernel_ms": round(with_cast(fp8, fp8.rows_fp8_triton, fp8_step), 4),
        "bf16_linear_ms": round(time_ms(bf16_step), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, (rows, k, n) in SHAPES.items():
        results.append(measure(name, rows, k, n))
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    (a.out / "fp8_rows.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| shape | rows x in -> out | cast torch ms | cast triton ms | roofline ms | same bits "
        "| fp8 fwd+dgrad ms (torch casts / kernel) | bf16 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['shape']} | {r['rows']} x {r['in']} -> {r['out']} | {r['cast_torch_ms']:.3f} | "
            f"{r['cast_triton_ms']:.3f} | {r['cast_roofline_ms']:.3f} | {r['kernel_equals_torch']} | "
            f"{r['fp8_linear_ms']:.3f} / {r['fp8_linear_kernel_ms']:.3f} | {r['bf16_linear_ms']:.3f} |"
        )


if __name__ == "__main__":
    main()
