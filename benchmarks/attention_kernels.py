"""Attention kernels for training (forward + backward, bf16, no mask, head dim 64) at CogVideoX-2b's and SDXL's
shapes: torch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends against FlashAttention-4 (flash-attn-4, CuTe-DSL,
`flash_attn.cute.flash_attn_func`; on sm90 its flash_fwd_sm90 / flash_bwd_sm90 kernels).

    bash benchmarks/fa4_stage.sh   # installs the FA4 kit into /tmp/fa4site (two device calls: see that script)
    PYTHONPATH=/tmp/fa4site:$PYTHONPATH python benchmarks/attention_kernels.py --out DIR [--cases a,b]

Backends: sdpa_flash (the reference for the errors), sdpa_cudnn, fa4 (flash_attn_func called directly), sdpa_fa4
(SDPA's flash backend routed to FA4 by torch.nn.attention.activate_flash_attention_impl("FA4"), where torch has it)
and, only when asked for, flex_fa4 (compiled flex_attention with kernel_options={"BACKEND": "FLASH"}).
Tensors are [batch, seqlen, heads, head_dim] (FA4's layout); SDPA gets transposed views, as diffusers passes them.
Times are CUDA-event medians of --iters calls after --warmup; first_s is the wall time of the first forward+backward
(FA4's JIT compile included). FLOPs: forward 4*B*H*Sq*Sk*D; forward+backward counts 3x that (backward = 2x forward,
the recompute of QK^T not counted; FlashAttention's papers count 2.5x, i.e. x7/6). Errors: max |x - sdpa_flash| of
the output and dq, dk, dv. A backend that fails (import, compile, unsupported shape) is reported, not fatal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

CASES = {  # name: (batch, heads, seqlen_q, seqlen_k, head_dim)
    "cogvideox": (1, 30, 17776, 17776, 64),
    "sdxl_self_4096": (4, 10, 4096, 4096, 64),
    "sdxl_self_1024": (4, 20, 1024, 1024, 64),
    "sdxl_cross_4096": (4, 10, 4096, 77, 64),
    "sdxl_cross_1024": (4, 20, 1024, 77, 64),
}
BACKENDS = ("sdpa_flash", "sdpa_cudnn", "fa4", "sdpa_fa4", "flex_fa4")
DISTS = ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "cuda-bindings")


def fa4_func():
    for p in list(sys.path):  # a pip --target install skips nvidia_cutlass_dsl_packages.pth, which adds this folder
        dsl = Path(p) / "nvidia_cutlass_dsl" / "dsl_packages"
        if (Path(p) / "nvidia_cutlass_dsl_packages.pth").exists() and str(dsl) not in sys.path:
            sys.path.append(str(dsl))
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


def attention(backend: str, stack: contextlib.ExitStack):
    fa4 = fa4_func() if "fa4" in backend else None
    if backend == "fa4":
        return lambda q, k, v: fa4(q, k, v)[0]  # flash_attn_func returns (out, lse)
    t = lambda *xs: [x.transpose(1, 2) for x in xs]  # [B, S, H, D] views as [B, H, S, D]
    if backend == "flex_fa4":
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)  # a FLASH kernel per shape
        return lambda q, k, v: flex(*t(q, k, v), kernel_options={"BACKEND": "FLASH"}).transpose(1, 2)
    from torch.nn import attention as A

    if backend == "sdpa_fa4":  # process-wide: undone (restore) when this backend's measurement ends
        stack.callback(A.restore_flash_attention_impl)
        A.activate_flash_attention_impl("FA4")
    kind = A.SDPBackend.CUDNN_ATTENTION if backend == "sdpa_cudnn" else A.SDPBackend.FLASH_ATTENTION

    def run(q, k, v):
        with A.sdpa_kernel(kind):
            return F.scaled_dot_product_attention(*t(q, k, v)).transpose(1, 2)

    return run


def median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def measure(f, q, k, v, dout, flops: int, ref: list | None, args) -> tuple[dict, list]:
    def fwdbwd():
        out = f(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [x.detach() for x in fwdbwd()]
    torch.cuda.synchronize()
    row = {"first_s": time.perf_counter() - t0}
    if ref is not None:
        errs = [(x.float() - r.float()).abs().max().item() for x, r in zip(outs, ref)]
        row["max_err"] = dict(zip(("out", "dq", "dk", "dv"), errs))
    row["fwd_ms"] = median_ms(lambda: f(q, k, v), args.iters, args.warmup)
    row["fwdbwd_ms"] = median_ms(fwdbwd, args.iters, args.warmup)
    row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    row["fwdbwd_tflops"] = 3 * flops / row["fwdbwd_ms"] / 1e9
    return row, outs


def run_case(name: str, args) -> list[dict]:
    b, h, sq, sk, d = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for s in (sq, sk, sk))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    rows, ref = [], None
    for backend in args.backends.split(","):
        row = {"case": name, "backend": backend, "shape": [b, h, sq, sk, d]}
        try:
            with contextlib.ExitStack() as stack:
                t0 = time.perf_counter()
                f = attention(backend, stack)  # imports FA4 (tvm-ffi may JIT-build its torch DLPack addon once)
                row["setup_s"] = time.perf_counter() - t0
                result, outs = measure(f, q, k, v, dout, 4 * b * h * sq * sk * d, ref, args)
            row.update(result)
            ref = outs if backend == "sdpa_flash" else ref
        except Exception as e:  # noqa: BLE001 - an import, compile or unsupported-shape failure is this row's result
            row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
            tail = "".join(traceback.format_exc().splitlines(True)[-12:])
            print(f"[{name} {backend}] failed:\n{tail}", file=sys.stderr)
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def versions() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    info["gpu"] = torch.cuda.get_device_name()
    info["torch_dlpack_c_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")  # else tvm-ffi's slower path
    for dist in DISTS:
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return info


def table(rows: list[dict]) -> str:
    head = f"{'case':<16} {'backend':<10} {'first s':>8} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9}  max err vs sdpa_flash: out dq dk dv"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<16} {r['backend']:<10} FAILED {r['error']}")
            continue
        err = " ".join(f"{x:.1e}" for x in r["max_err"].values()) if "max_err" in r else "-"
        lines.append(
            f"{r['case']:<16} {r['backend']:<10} {r['first_s']:8.2f} {r['fwd_ms']:8.3f} {r['fwd_tflops']:9.1f} "
            f"{r['fwdbwd_ms']:8.3f} {r['fwdbwd_tflops']:9.1f}  {err}"
        )
    lines.append("TF/s: fwd 4*B*H*Sq*Sk*D per fwd time; f+b 3x that per f+b time (bwd = 2x fwd; x7/6 for 2.5x)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for attention_kernels.json")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--backends", default=",".join(BACKENDS[:4]), help=f"comma-separated, of: {', '.join(BACKENDS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    for arg, known in (("cases", CASES), ("backends", BACKENDS)):
        if unknown := [x for x in getattr(args, arg).split(",") if x not in known]:
            ap.error(f"unknown {arg}: {unknown}")
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py needs a CUDA GPU")
    info = versions()
    print(json.dumps(info), flush=True)
    rows = [row for name in args.cases.split(",") for row in run_case(name, args)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_kernels.json").write_text(json.dumps({"versions": info, "results": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
