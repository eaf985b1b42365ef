"""speed.geglu triton on a CUDA GPU with Triton: the kernel's gradient follows the torch reference within bf16
rounding, eagerly and inside a compiled module replayed as CUDA graphs, and auto trains the tiny SDXL with it as
diffusers' ops train it."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_cuda_config
from difftrain.precompute.run import precompute
from difftrain.speed import geglu
from difftrain.trainers.loop import Trainer, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(4096, 10240), (3, 7, 2000), (5, 2 * 2560)])
def test_the_kernel_follows_the_reference(shape):
    geglu._ops()
    g = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    grad = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", dtype=torch.bfloat16, generator=g)
    got = torch.ops.difftrain.geglu_gate_backward(proj, grad)
    ref = geglu._backward_reference(proj, grad)
    assert got.shape == proj.shape and got.dtype == proj.dtype
    assert _rel(got, ref) < 1e-2
    # against autograd through diffusers' own ops in float32
    p32 = proj.float().requires_grad_()
    geglu.gate_reference(p32).backward(grad.float())
    assert _rel(got, p32.grad) < 1e-2


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_compiled_fused_gate_gives_diffusers_gradients(mode):
    from diffusers.models.activations import GEGLU

    torch.manual_seed(0)
    stock = torch.nn.Sequential(GEGLU(320, 1280), torch.nn.Linear(1280, 320)).cuda().to(torch.bfloat16)
    fused = copy.deepcopy(stock)
    assert geglu.use_fused(fused) == 1
    fused = torch.compile(fused, mode=mode) if mode else torch.compile(fused)
    x = torch.randn(4, 256, 320, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # CUDA graphs record on a later call: compare the replayed one
        xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        stock.zero_grad(), fused.zero_grad()
        stock(xs).float().square().mean().backward()
        fused(xf).float().square().mean().backward()
    assert _rel(xf.grad, xs.grad) < 2e-2
    assert _rel(fused._orig_mod[0].proj.weight.grad, stock[0].proj.weight.grad) < 2e-2


def test_auto_trains_the_tiny_sdxl_with_the_kernel_as_diffusers_ops_train_it(tiny_model, dataset, tmp_path):
    torch_ops = tiny_cuda_config(tiny_model, dataset, tmp_path / "a", **{"speed.geglu": "torch"})
    precompute(torch_ops)
    ref = train(torch_ops)
    t = Trainer(tiny_cuda_config(tiny_model, dataset, tmp_path / "b"))
    out = t.run()
    assert t.cfg.speed.geglu == "triton"  # auto, resolved on this GPU
    unet = t.parts.comps["unet"]
    assert geglu.count(unet) > 0
    assert all(type(m) is geglu.fused_class() for m in unet.modules() if "GEGLU" in type(m).__name__)
    assert out.losses == pytest.approx(ref.losses, rel=3e-2, abs=3e-3)
