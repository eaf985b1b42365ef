"""What the speed figures are measured against: the device's dense matmul peak (MFU's denominator), and a
device synchronisation for timing."""

from __future__ import annotations

import time

import torch


def peak_matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """The measured dense matmul peak in TFLOP/s (bf16 on CUDA, fp32 on the CPU): MFU's denominator, measured
    in the same run so a throttled or shared device is compared with itself."""
    if device.type != "cuda":
        n, reps = 1024, 5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
