"""speed.fp8_matmul on a CUDA GPU of compute capability 8.9+ (skipped elsewhere): an fp8-stored Linear of a real
width computes its forward and input gradient through torch._scaled_mm's rowwise fp8 matmuls within a few percent of
the dequantized layer, and inductor's compiled layer gives what the eager one gives."""

from __future__ import annotations

import pytest
import torch

from conftest import fp8_matmul_run

pytestmark = pytest.mark.gpu


def test_fp8_matmul_on_the_gpu_tracks_the_dequantized_layer_and_compiles():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9+")
    x = torch.randn(1, 4608, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fast, y, g, rel_y, rel_g = fp8_matmul_run(3072, 3072, x)
    assert fast.fp8_matmul and rel_y < 0.05 and rel_g < 0.05
    x.grad = None
    y2 = torch.compile(fast, fullgraph=True)(x)
    y2.float().square().mean().backward()
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(x.grad, g)
