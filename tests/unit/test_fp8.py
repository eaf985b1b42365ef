"""fp8 base weights: same function as the high-precision layer within e4m3's error, a quarter of the bytes."""

from __future__ import annotations

import pytest
import torch

from difftrain.memory import fp8
from difftrain.memory.fp8 import FP8, Fp8Conv2d, Fp8Linear, convert


def _pair(make):
    torch.manual_seed(0)
    a, b = make(), make()
    b.load_state_dict(a.state_dict())
    a.requires_grad_(False)
    b.requires_grad_(False)
    return a, b


@pytest.mark.parametrize("per_channel", [False, True])
def test_linear_and_conv_match_reference_and_backward(per_channel):
    for make, x in (
        (lambda: torch.nn.Linear(64, 48), torch.randn(7, 64)),
        (lambda: torch.nn.Conv2d(8, 16, 3, padding=1, stride=2), torch.randn(2, 8, 12, 12)),
    ):
        q, ref = _pair(make)
        convert(torch.nn.Sequential(q), "cpu", per_channel=per_channel)
        assert q.weight.dtype == FP8 and isinstance(q, (torch.nn.Linear, torch.nn.Conv2d))
        assert type(q) in (Fp8Linear, Fp8Conv2d)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = q(xa), ref(xb)
        g = torch.randn_like(yb)
        ya.backward(g)
        yb.backward(g)
        rel = lambda u, v: ((u - v).norm() / v.norm()).item()
        assert rel(ya, yb) < 0.06  # e4m3: 3 mantissa bits
        assert rel(xa.grad, xb.grad) < 0.06
        assert rel(ya, yb) > 0  # really quantized


def test_per_channel_scale_helps_rows_of_different_magnitude():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight[0] *= 1e5  # one huge row squeezes the others into fp8's subnormals under one scale
    errs = {}
    for pc in (False, True):
        q, ref = _pair(lambda: torch.nn.Linear(64, 32))
        q.load_state_dict(lin.state_dict())
        ref.load_state_dict(lin.state_dict())
        convert(torch.nn.Sequential(q), "cpu", per_channel=pc)
        x = torch.randn(16, 64)
        errs[pc] = ((q(x) - ref(x))[:, 1:].norm() / ref(x)[:, 1:].norm()).item()
    assert errs[True] < errs[False] / 5


def test_convert_skips_trainable_and_named_layers_and_saves_bytes():
    torch.manual_seed(0)
    m = torch.nn.ModuleDict(
        {
            "conv_in": torch.nn.Conv2d(4, 8, 3),
            "proj": torch.nn.Linear(256, 256),
            "norm": torch.nn.LayerNorm(256),
            "lora": torch.nn.Linear(256, 4),
        }
    )
    m.requires_grad_(False)
    m["lora"].requires_grad_(True)
    before = sum(p.numel() * p.element_size() for p in m.parameters())
    counts = convert(m, "cpu", skip=("conv_in",))
    assert m["proj"].weight.dtype == FP8
    assert m["conv_in"].weight.dtype == torch.float32 and m["lora"].weight.dtype == torch.float32
    assert m["norm"].weight.dtype == torch.float32
    assert counts["fp8_params"] == 256 * 256
    after = sum(p.numel() * p.element_size() for p in m.parameters())
    assert before - after == 256 * 256 * 3  # 4 bytes -> 1 byte for the converted weight


def test_follows_autocast_dtype():
    q = torch.nn.Linear(16, 8)
    q.requires_grad_(False)
    convert(torch.nn.Sequential(q), "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert q(torch.randn(2, 16)).dtype == torch.bfloat16
    assert q(torch.randn(2, 16)).dtype == torch.float32


def test_conv_op_keeps_its_fake_kernels_strides_in_channels_last():
    """speed.channels_last turns an fp8 convolution's input and weight channels-last; the op's outputs keep the
    strides its fake kernels promise (compiled graphs check them: an H200 run failed on this before)."""
    from difftrain.memory.fp8 import fp8_conv2d, fp8_conv2d_grad_input, quantize

    torch.manual_seed(0)
    w8, scale = quantize(torch.randn(16, 8, 3, 3), per_channel=True)
    w8 = w8.to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 12, 12).to(memory_format=torch.channels_last).requires_grad_()
    conf = ([2, 2], [1, 1], [1, 1], 1)
    torch.library.opcheck(fp8_conv2d, (x, w8, scale, None, *conf), test_utils="test_faketensor")
    gy = torch.randn(2, 16, 6, 6).to(memory_format=torch.channels_last)
    torch.library.opcheck(fp8_conv2d_grad_input, (gy, w8, scale, [2, 8, 12, 12], *conf), test_utils="test_faketensor")
    assert fp8_conv2d(x, w8, scale, None, *conf).is_contiguous()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_matmul_forward_and_input_gradient_track_the_dequantized_layer(compiled):
    """speed.fp8_matmul: the activations (and the output gradient) cast to e4m3 per row and multiplied by the stored
    weight through torch._scaled_mm: within a few percent of the dequantized bf16 layer, not equal to it (the fp8
    path runs), the same compiled as eager."""
    from conftest import fp8_matmul_run

    x = torch.randn(4, 33, 256, dtype=torch.bfloat16, requires_grad=True)  # 132 rows: not a multiple of 16
    fast, y, g, rel_y, rel_g = fp8_matmul_run(256, 128, x, seed=3)
    assert fast.fp8_matmul  # fp8_matmul_ok: one scale, sizes of 16
    assert 0 < rel_y < 0.05 and 0 < rel_g < 0.05
    if compiled:
        x.grad = None
        y2 = torch.compile(fast, backend="aot_eager", fullgraph=True)(x)
        y2.float().square().mean().backward()
        assert torch.equal(y2, y) and torch.equal(x.grad, g)


def test_fp8_matmul_counts_the_flops_of_the_linear_it_replaces():
    """bench speed's MFU counts model FLOPs with torch.utils.flop_counter, to which the fp8 matmul ops are opaque:
    they count as the bf16 Linear's forward and input gradient (Krea 2 with fp8 matmuls was reported at 9 % MFU)."""
    from torch.utils.flop_counter import FlopCounterMode

    from conftest import fp8_matmul_run

    x = torch.randn(2, 24, 256, dtype=torch.bfloat16, requires_grad=True)
    fast, *_ = fp8_matmul_run(256, 128, x, seed=3)
    assert fast.fp8_matmul
    plain = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    counts = []
    for layer in (fast, plain):
        with FlopCounterMode(display=False) as fc:
            layer(x).float().square().mean().backward()
        counts.append(fc.get_flop_counts()["Global"])
    rows = 2 * 24
    assert sum(counts[0].values()) == sum(counts[1].values()) == 2 * (2 * rows * 256 * 128)


def test_fp8_matmul_takes_one_scale_a_tensor_and_sizes_of_sixteen():
    per_channel = torch.nn.Linear(256, 128).requires_grad_(False)
    fp8.convert(per_channel, "cpu", per_channel=True)
    assert not fp8.fp8_matmul_ok(per_channel)  # a per-channel scale lies along the input gradient's inner dimension
    odd = torch.nn.Linear(40, 24).requires_grad_(False)
    fp8.convert(odd, "cpu")
    assert not fp8.fp8_matmul_ok(odd) and not fp8.fp8_matmul_ok(torch.nn.Linear(32, 32))


@pytest.mark.parametrize("weights", ["{kind: bf16}", "{kind: fp8, scale: channel}"])
def test_fp8_matmul_is_refused_without_fp8_weights_of_one_scale(tmp_path, weights):
    from difftrain.config.load import resolve
    from difftrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        resolve(recipe="tiny-flux-lora", sets=[f"data.dir={tmp_path}", "speed.fp8_matmul=true",
                                               f"memory.weights={weights}"])  # fmt: skip
    assert "speed.fp8_matmul" in str(e.value) and "scale: tensor" in str(e.value)
