"""speed.attention fa4 (issue 24, item 5): which SDPA calls go to FlashAttention-4, the custom ops' shapes as
torch.compile sees them, that SDPA is restored, and that a machine without FA4 or a Hopper GPU is told so before
anything loads (through the console script). FA4's kernels themselves run in tests/gpu/test_fa4_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import clean_failure, script_train, set_args, tiny_sets
from difftrain.errors import BackendUnavailable
from difftrain.speed import fa4


def _fake(*shape, device="cuda", dtype=torch.bfloat16):
    return torch.empty(*shape, device=device, dtype=dtype)


@pytest.fixture
def fake():
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def test_long_unmasked_self_attention_goes_to_fa4_and_everything_else_stays_on_sdpa(fake):
    q = _fake(1, 30, fa4.MIN_KEYS, 64)
    assert fa4.eligible(q, q, q)
    short = _fake(4, 20, fa4.MIN_KEYS // 4, 64)  # SDXL's 1,024-token layers: measured slower on FA4
    cross_k = _fake(4, 10, 77, 64)  # 77 text keys: slower too
    assert not fa4.eligible(short, short, short)
    assert not fa4.eligible(q, cross_k, cross_k)
    assert not fa4.eligible(q, q, q, attn_mask=_fake(1, 1, fa4.MIN_KEYS, fa4.MIN_KEYS, dtype=torch.bool))
    assert not fa4.eligible(q, q, q, dropout_p=0.1)
    assert not fa4.eligible(q, q, q, is_causal=True)
    assert not fa4.eligible(q, q, q, enable_gqa=True)
    assert not fa4.eligible(*[_fake(1, 30, fa4.MIN_KEYS, 64, dtype=torch.float32)] * 3)  # FA4: bf16 / fp16 only
    assert not fa4.eligible(*[_fake(1, 2, fa4.MIN_KEYS, 320)] * 3)  # head size over 256
    assert not fa4.eligible(*[_fake(1, 2, fa4.MIN_KEYS, 64, device="cpu")] * 3)
    kv = _fake(1, 10, fa4.MIN_KEYS, 64)  # fewer key/value heads than query heads
    assert not fa4.eligible(q, kv, kv)


def test_the_custom_ops_shapes_are_what_fa4_returns_in_its_own_layout(fake):
    # FA4 reads [batch, tokens, heads, head size]; out keeps it, the log-sum-exp is [batch, heads, tokens] fp32
    q, k, v = _fake(2, 4096, 30, 64), _fake(2, 5000, 30, 64), _fake(2, 5000, 30, 64)
    out, lse = torch.ops.difftrain.fa4_forward(q, k, v, 0.125)
    assert out.shape == (2, 4096, 30, 64) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (2, 30, 4096) and lse.dtype == torch.float32
    dq, dk, dv = torch.ops.difftrain.fa4_backward(q, k, v, out, out, lse, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # SDPA's layout in and out: [batch, heads, tokens, head size]
    sd = fa4.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert sd.shape == (2, 30, 4096, 64)


def test_routed_swaps_sdpa_for_the_router_and_restores_it_even_after_an_error():
    original = F.scaled_dot_product_attention
    q = torch.randn(1, 2, 16, 8)
    with fa4.routed():
        assert F.scaled_dot_product_attention is fa4.sdpa
        # a call FA4 does not take (the CPU) is torch's own, result for result
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), original(q, q, q))
    assert F.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="boom"), fa4.routed():
        raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original


def test_a_device_without_fa4_is_named_with_the_fix():
    with pytest.raises(BackendUnavailable, match="CUDA GPUs only"):
        fa4.check(torch.device("cpu"))
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="flash-attn-4") as e:
            fa4._interface()
        assert "pip install flash-attn-4" in (e.value.hint or "")


@pytest.mark.slow
def test_train_with_fa4_on_the_cpu_fails_cleanly_before_loading(tiny_model, dataset, tmp_path):
    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"speed.attention": "fa4", "train.device": "cpu"})
    r = script_train("--recipe", "tiny-sdxl-lora", "--no-precompute", *set_args(sets))
    clean_failure(r, 1, "speed.attention fa4 runs on CUDA GPUs only", "flash-attn-4")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_flop_counter_counts_fa4_as_it_counts_sdpa(fake):
    from torch.utils.flop_counter import FlopCounterMode

    q = _fake(1, 30, fa4.MIN_KEYS, 64)  # SDPA's layout
    with FlopCounterMode(display=False) as sd:
        torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, False)
    t = q.transpose(1, 2)
    with FlopCounterMode(display=False) as ours:
        out, lse = torch.ops.difftrain.fa4_forward(t, t, t, 0.125)
    assert ours.get_total_flops() == sd.get_total_flops() == 4 * 30 * fa4.MIN_KEYS**2 * 64
    with FlopCounterMode(display=False) as back:
        torch.ops.difftrain.fa4_backward(t, t, t, out, out, lse, 0.125)
    assert back.get_total_flops() == 2.5 * ours.get_total_flops()


def test_under_autocast_the_router_sees_what_sdpa_would_run_on(monkeypatch):
    # CogVideoX's q/k LayerNorms run in fp32 under autocast: SDPA receives fp32 queries and keys beside bf16 values
    # and casts them itself. FA4 must take that call too (a dtype check on the raw inputs sent it to SDPA: the
    # H100 step ran exactly as fast as cuDNN's, 0.847 against 0.848 s/step)
    seen = []
    monkeypatch.setattr(fa4, "eligible", lambda q, k, v, *a: seen.append((q.dtype, k.dtype, v.dtype)) or False)
    q = torch.randn(1, 2, 16, 8)
    v = q.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fa4.sdpa(q, q, v)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    fa4.sdpa(q, q, q)  # no autocast: the inputs as they are
    assert seen[-1] == (torch.float32,) * 3


def test_the_first_step_line_counts_the_calls_since_the_step_began(monkeypatch):
    monkeypatch.setattr(fa4, "calls", 7)
    ran, line = fa4.first_step_line(7)
    assert not ran and "no attention call" in line and "4,096 keys" in line
    ran, line = fa4.first_step_line(4)
    assert ran and "ran 3 attention calls" in line


def _cfg(attention="auto"):
    from difftrain.config.schema import Config

    return Config.model_validate({"family": "sdxl", "speed": {"attention": attention}})


def test_auto_takes_fa4_where_it_is_installed_and_runs_and_says_so(monkeypatch):
    from difftrain.speed import auto as speed_auto

    checked = []
    monkeypatch.setattr(fa4, "unavailable", lambda device: None)
    monkeypatch.setattr(fa4, "check", checked.append)
    cfg, line = speed_auto.resolve_attention(_cfg(), torch.device("cpu"))
    assert cfg.speed.attention == "fa4" and checked == [torch.device("cpu")]
    assert line is not None and "FlashAttention-4" in line and "4,096 keys" in line
    assert _cfg().speed.attention == "auto"  # the user's config is not changed, a resolved copy is returned


def test_auto_stays_on_sdpa_where_fa4_is_missing_or_fails(monkeypatch):
    from difftrain.speed import auto as speed_auto

    cpu = torch.device("cpu")
    cfg, line = speed_auto.resolve_attention(_cfg(), cpu)  # this machine: no GPU, no flash-attn-4
    assert cfg.speed.attention == "auto" and line is None
    assert fa4.unavailable(cpu) == "the device is cpu"

    def broken(device):
        raise BackendUnavailable("speed.attention fa4 does not run on this device: DSLRuntimeError: no sm_90a")

    monkeypatch.setattr(fa4, "unavailable", lambda device: None)
    monkeypatch.setattr(fa4, "installed", lambda: True)
    monkeypatch.setattr(fa4, "check", broken)
    cfg, line = speed_auto.resolve_attention(_cfg(), cpu)  # installed but its kernels do not run: said, not fatal
    assert cfg.speed.attention == "auto" and line is not None and "torch's SDPA" in line and "no sm_90a" in line


def test_an_explicit_kernel_is_checked_and_kept(monkeypatch):
    from difftrain.speed import auto as speed_auto

    monkeypatch.setattr(fa4, "unavailable", lambda device: pytest.fail("auto's probe ran for an explicit kernel"))
    cfg, line = speed_auto.resolve_attention(_cfg("math"), torch.device("cpu"))
    assert cfg.speed.attention == "math" and line is None
    with pytest.raises(BackendUnavailable, match="CUDA GPUs only"):
        speed_auto.resolve_attention(_cfg("fa4"), torch.device("cpu"))


def test_fa4_for_a_family_that_avoids_cudnn_keeps_cudnn_out_of_the_calls_left_to_sdpa(monkeypatch):
    from torch.nn.attention import SDPBackend

    from difftrain.config.schema import SpeedConfig
    from difftrain.speed import attention as speed_attention

    entered = []
    import torch.nn.attention as attention_mod

    monkeypatch.setattr(
        attention_mod, "sdpa_kernel", lambda backends, **kw: entered.append(list(backends)) or contextlib.nullcontext()
    )
    original = F.scaled_dot_product_attention
    sp = SpeedConfig(attention="fa4")
    with speed_attention.attention_context(sp, torch.device("cuda"), avoid_cudnn=True):
        assert F.scaled_dot_product_attention is fa4.sdpa
    assert F.scaled_dot_product_attention is original
    assert len(entered) == 1 and SDPBackend.CUDNN_ATTENTION not in entered[0]
    with speed_attention.attention_context(sp, torch.device("cuda")):
        assert F.scaled_dot_product_attention is fa4.sdpa
    assert len(entered) == 1  # no cuDNN restriction for the other families
