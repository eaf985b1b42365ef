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


@pytest.mark.parametrize("shape", [(4608, 6144), (7, 24576), (3, 100), (0, 64)])
def test_the_row_cast_kernel_gives_the_torch_ops_bits(shape):
    """memory/fp8.py's Triton row cast: the same e4m3 bytes and float32 scales as the torch ops it is to replace, on rows
    of any width (a masked tail), a zero row (the scale's floor), a row with one large value and a strided input."""
    from difftrain.memory import fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 casts need compute capability 8.9+")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    if shape[0] >= 3:
        x[0] = 0
        x[1, -1] = 3e4
    cases = [x]
    if shape[0]:
        cases.append(torch.randn(shape[1], shape[0], device="cuda", dtype=torch.bfloat16, generator=g).t())
    for xi in cases:
        q, s = fp8.rows_fp8_triton(xi)
        q_ref, s_ref = fp8.rows_fp8_torch(xi)
        assert q.dtype == torch.float8_e4m3fn and q.shape == xi.shape and s.shape == (xi.shape[0], 1)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, s_ref)


def test_the_row_cast_kernel_replays_in_a_cuda_graph():
    """CUDA graphs (speed.cuda_graphs) record the kernel: a replay casts the new contents of the same input."""
    from difftrain.memory import fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 casts need compute capability 8.9+")
    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    fp8.rows_fp8_triton(x)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = fp8.rows_fp8_triton(x)
    x.copy_(torch.randn_like(x) * 5)
    graph.replay()
    q_ref, s_ref = fp8.rows_fp8_torch(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
