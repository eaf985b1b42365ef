"""speed.attention fa4 on a Hopper-or-newer GPU with flash-attn-4 installed (skipped elsewhere): FA4's output and
gradients follow torch's SDPA within bf16 rounding, eagerly and inside a compiled function, and a short call stays
on SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftrain.speed import fa4


def _fa4_ready() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fa4_ready(), reason="needs flash-attn-4 on a 9.0+ GPU")]


def _qkv(b=1, h=4, s=fa4.MIN_KEYS, d=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    # diffusers' layout: [batch, tokens, heads, head size] transposed to SDPA's
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2) for _ in "qkv"]


def _run(fn, q, k, v):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.float().square().mean().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("compiled", [False, True])
def test_fa4_follows_sdpa_forward_and_backward(compiled):
    q, k, v = _qkv()
    ref = _run(F.scaled_dot_product_attention, q, k, v)

    def routed(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    fn = torch.compile(routed) if compiled else routed
    with fa4.routed():
        got = _run(fn, q, k, v)
        assert fa4.eligible(q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert a.shape == b.shape, name
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * b.float().abs().max().item() + 1e-3, (name, err)


def test_a_short_call_stays_on_sdpa_bit_for_bit():
    q, k, v = _qkv(s=1024)
    with fa4.routed():
        got = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v))


def test_check_passes_on_this_gpu():
    fa4.check(torch.device("cuda"))


def test_auto_takes_fa4_on_this_gpu():
    from difftrain.config.schema import Config
    from difftrain.speed.auto import resolve_attention

    cfg, line = resolve_attention(Config.model_validate({"family": "sdxl"}), torch.device("cuda"))
    assert cfg.speed.attention == "fa4" and line is not None and "FlashAttention-4" in line
