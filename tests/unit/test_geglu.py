"""speed.geglu: diffusers' GEGLU with difftrain's backward (speed/geglu.py). The Triton kernel itself runs on the GPU
(tests/gpu/test_geglu_gpu.py); here its torch reference, the module swap and the choice are checked on the CPU."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.errors import BackendUnavailable
from difftrain.speed import geglu


def _pair(dtype):
    from diffusers.models.activations import GEGLU

    torch.manual_seed(0)
    stock = GEGLU(16, 24).to(dtype)
    fused = copy.deepcopy(stock)
    assert geglu.use_fused(fused) == 1
    return stock, fused


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_gate_gives_diffusers_outputs_and_gradients(dtype, tol):
    stock, fused = _pair(dtype)
    torch.manual_seed(1)
    x = torch.randn(3, 5, 16, dtype=dtype) * 2
    g = torch.randn(3, 5, 24, dtype=dtype)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yf = stock(xs), fused(xf)
    assert torch.equal(ys, yf)  # the forward is diffusers' own
    ys.backward(g)
    yf.backward(g)
    for a, b in [(xs.grad, xf.grad), (stock.proj.weight.grad, fused.proj.weight.grad)]:
        rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
        assert rel < tol, rel


def test_the_reference_backward_is_the_gelu_gate_derivative_in_float64():
    torch.manual_seed(2)
    proj = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 5, dtype=torch.float64)
    geglu.gate_reference(proj).backward(grad)
    assert torch.allclose(geglu._backward_reference(proj.detach(), grad), proj.grad, atol=1e-12)


def test_the_swap_keeps_weights_names_and_copies():
    from diffusers.models.activations import GEGLU

    stock, fused = _pair(torch.float32)
    assert type(fused).__name__ == "FusedGEGLU" and isinstance(fused, GEGLU)
    assert stock.state_dict().keys() == fused.state_dict().keys()
    assert all(torch.equal(stock.state_dict()[k], v) for k, v in fused.state_dict().items())
    assert geglu.use_fused(fused) == 0  # already fused: nothing to do twice
    assert geglu.count(fused) == 1
    again = pickle.loads(pickle.dumps(fused))
    assert type(again) is type(fused)
    x = torch.randn(2, 16)
    assert torch.equal(again(x), stock(x))


def test_the_tiny_unet_has_its_gates_swapped(tiny_model):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    n = geglu.count(unet)
    assert n > 0
    assert geglu.use_fused(unet) == n
    assert all(type(m).__name__ == "FusedGEGLU" for m in unet.modules() if type(m).__name__.endswith("GEGLU"))


def test_auto_is_torch_off_cuda_and_triton_there_is_refused():
    cfg = resolve(recipe="sdxl-lora-8gb").config
    assert cfg.speed.geglu == "auto"
    cpu = torch.device("cpu")
    assert geglu.available(cpu) == "not a CUDA device"
    from difftrain.speed import auto as speed_auto

    assert speed_auto.resolve_geglu(cfg, cpu).speed.geglu == "torch"
    assert speed_auto.resolve_geglu(
        resolve(recipe="sdxl-lora-8gb", sets=["speed.geglu=torch"]).config, cpu
    ).speed.geglu == ("torch")
    with pytest.raises(BackendUnavailable, match=r"speed\.geglu triton needs a CUDA GPU and Triton") as e:
        speed_auto.resolve_geglu(resolve(recipe="sdxl-lora-8gb", sets=["speed.geglu=triton"]).config, cpu)
    assert "speed.geglu: auto" in (e.value.hint or "")


def test_a_gpu_older_than_triton_supports_keeps_diffusers_ops(monkeypatch):
    from difftrain.speed import auto as speed_auto

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    assert geglu.available(torch.device("cuda")) == "compute capability 6.1 (Triton needs 7.0 or newer)"
    cfg = resolve(recipe="sdxl-lora-8gb").config
    assert speed_auto.resolve_geglu(cfg, torch.device("cuda")).speed.geglu == "torch"


def test_auto_takes_triton_where_it_runs(monkeypatch):
    from difftrain.speed import auto as speed_auto
    from difftrain.speed import regional_compile

    monkeypatch.setattr(geglu, "available", lambda device: None)
    cfg = resolve(recipe="sdxl-lora-8gb").config
    assert speed_auto.resolve_geglu(cfg, torch.device("cuda")).speed.geglu == "triton"
    keep = resolve(recipe="sdxl-lora-8gb", sets=["speed.geglu=torch"]).config
    assert speed_auto.resolve_geglu(keep, torch.device("cuda")).speed.geglu == "torch"
    assert regional_compile.warm_key(speed_auto.resolve_geglu(cfg, torch.device("cuda"))) != regional_compile.warm_key(
        keep
    )


@pytest.mark.slow
def test_train_with_the_triton_gate_on_the_cpu_fails_cleanly_before_loading(tiny_model, dataset, tmp_path):
    from conftest import clean_failure, script_train, set_args, tiny_sets

    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"speed.geglu": "triton", "train.device": "cpu"})
    r = script_train("--recipe", "tiny-sdxl-lora", "--no-precompute", *set_args(sets))
    clean_failure(r, 1, "speed.geglu triton needs a CUDA GPU and Triton: not a CUDA device here", "speed.geglu: auto")
    assert not (tmp_path / "run" / "checkpoints").exists()
