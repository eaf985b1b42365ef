"""speed.lora_kernel: peft's LoRA Linear with difftrain's fused forward and backward (speed/lora_kernel.py). What it buys
is measured on a GPU (benchmarks/lora_block.py); here its arithmetic, its fall-backs to peft and the choice."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from peft import LoraConfig

from difftrain.config.load import resolve
from difftrain.speed import auto as speed_auto
from difftrain.speed import lora_kernel as fused
from difftrain.speed import regional_compile


def _net(dropout: float = 0.0, bias: bool = True) -> torch.nn.Module:
    from peft import inject_adapter_in_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 32, bias=bias), torch.nn.GELU(), torch.nn.Linear(32, 24, bias=bias))
    net.requires_grad_(False)
    net = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0", "2"]), net)
    with torch.no_grad():  # a trained adapter: B is not zero
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return net


def _run(net: torch.nn.Module, x: torch.Tensor, amp: torch.dtype | None, **kwargs):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
        y = net(x, **kwargs)
    y.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return y.detach().float(), x.grad.float(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("out", [5, 9])  # narrower and wider than the input (q, k, v in one)
def test_the_fused_function_has_the_gradients_of_its_formula(out):
    """float64 gradcheck of x w^T + bias + s (x a^T) b^T, every input needing a gradient (the base too)."""
    torch.manual_seed(0)
    args = [torch.randn(2, 3, 6), torch.randn(out, 6), torch.randn(out), torch.randn(2, 6), torch.randn(out, 2)]
    args = [t.double().requires_grad_(True) for t in args]
    assert torch.autograd.gradcheck(lambda *t: fused._LoraLinear.apply(*t, 0.7), args)
    x, w, bias, a, b = args
    expect = x @ w.t() + bias + 0.7 * (x @ a.t()) @ b.t()
    assert torch.allclose(fused._LoraLinear.apply(*args, 0.7), expect, atol=1e-12)


def test_under_bf16_autocast_it_computes_what_peft_does():
    """The same outputs and gradients as peft's forward within bf16 rounding, no further from fp32 than peft's."""
    ref = _net()
    fast = copy.deepcopy(ref)
    assert fused.use_fused(fast) == 2
    x = torch.randn(3, 10, 24)
    exact = _run(copy.deepcopy(ref), x, None)  # fp32, no autocast: peft's path in both
    peft_out, fused_out = _run(ref, x, torch.bfloat16), _run(fast, x, torch.bfloat16)
    assert fused_out[2].keys() == peft_out[2].keys() and len(fused_out[2]) == 4
    assert all(g.dtype == torch.float32 for g in fused_out[2].values())  # the adapter's own dtype
    for i in (0, 1):
        assert _rel(fused_out[i], peft_out[i]) < 2e-2
        assert _rel(fused_out[i], exact[i]) < 1.5 * _rel(peft_out[i], exact[i]) + 1e-3
    for name, g in fused_out[2].items():
        assert _rel(g, peft_out[2][name]) < 3e-2
        assert _rel(g, exact[2][name]) < 1.5 * _rel(peft_out[2][name], exact[2][name]) + 1e-3


def test_the_fused_path_runs_only_where_it_applies(monkeypatch):
    """Without autocast, with dropout, with the adapter disabled or merged, peft's own forward runs (the same
    numbers bit for bit); under autocast with one plain adapter the fused function runs."""
    calls = []
    real = fused._LoraLinear.apply
    monkeypatch.setattr(fused._LoraLinear, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 5, 24)

    def same(build, amp, change=None) -> bool:
        ref, fast = build(), build()
        fused.use_fused(fast)
        for net in (ref, fast):
            if change:
                change(net)
        a = torch.manual_seed(3) and _run(ref, x, amp)  # the same dropout masks in both
        b = torch.manual_seed(3) and _run(fast, x, amp)
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    assert same(_net, None) and not calls  # no autocast
    assert same(lambda: _net(dropout=0.5), torch.bfloat16) and not calls
    for change in (lambda n: [n[i].enable_adapters(False) for i in (0, 2)], lambda n: [n[i].merge() for i in (0, 2)]):
        assert same(_net, torch.bfloat16, change) and not calls
    assert not same(_net, torch.bfloat16) and len(calls) == 2  # fused: within rounding, not bit for bit


def test_use_fused_keeps_weights_names_and_pickles():
    net = _net(bias=False)
    keys = list(net.state_dict())
    assert fused.use_fused(net) == 2 and fused.use_fused(net) == 0  # already fused: nothing twice
    assert list(net.state_dict()) == keys
    from peft.tuners.lora.layer import Linear

    assert isinstance(net[0], Linear) and type(net[0]).__name__ == "FusedLoraLinear"
    back = pickle.loads(pickle.dumps(net))
    assert type(back[0]) is type(net[0]) and torch.equal(
        back[0].lora_A["default"].weight, net[0].lora_A["default"].weight
    )


def test_auto_takes_the_fused_kernel_on_cuda_without_checkpointing_only():
    cfg = resolve(recipe="sdxl-lora-8gb", sets=["memory.activations.kind=none"]).config
    assert cfg.speed.lora_kernel == "auto"
    assert speed_auto.lora_kernel_auto(cfg, torch.device("cpu")) == "peft"
    assert speed_auto.lora_kernel_auto(cfg, torch.device("cuda")) == "fused"
    # the recipe as shipped checkpoints: the fused backward's tensors would be kept (more memory than its card)
    assert speed_auto.lora_kernel_auto(resolve(recipe="sdxl-lora-8gb").config, torch.device("cuda")) == "peft"
    keep = resolve(recipe="sdxl-lora-8gb", sets=["memory.activations.kind=none", "speed.lora_kernel=peft"]).config
    assert speed_auto.lora_kernel_auto(keep, torch.device("cuda")) == "peft"
    named = resolve(recipe="sdxl-lora-8gb", sets=["speed.lora_kernel=fused"]).config
    assert speed_auto.lora_kernel_auto(named, torch.device("cuda")) == "fused"  # named: it stands
    assert regional_compile.warm_key(cfg) != regional_compile.warm_key(
        keep
    )  # another compiled graph: another cache entry


@pytest.mark.parametrize(
    ("recipe", "sets", "compiled", "device", "expect"),
    [
        ("sdxl-lora-8gb", [], True, "cuda", True),
        ("sdxl-lora-4gb", [], True, "cuda", True),
        ("sdxl-lora-8gb", [], False, "cuda", False),  # eager: not measured
        ("sdxl-lora-8gb", [], True, "cpu", False),
        ("sdxl-full-12gb", [], True, "cuda", False),  # full fine-tune: not measured
        ("sdxl-lora-8gb", ["memory.engine.kind=deepspeed"], True, "cuda", False),
        ("sdxl-lora-8gb", ["memory.weights.kind=fp8"], True, "cuda", False),  # fp8 convolutions: not measured
        ("sd3-lora-8gb", [], True, "cuda", False),  # a transformer: no convolutions
        ("sdxl-lora-8gb", ["speed.channels_last=false"], True, "cuda", False),
        ("sdxl-lora-8gb", ["speed.channels_last=true"], False, "cpu", True),
    ],
)
def test_channels_last_auto(recipe, sets, compiled, device, expect):
    from difftrain.families.registry import row

    cfg = resolve(recipe=recipe, sets=sets).config
    assert speed_auto.channels_last_auto(cfg, row(cfg.family).channels_last, compiled, torch.device(device)) is expect


def _block() -> torch.nn.Module:
    """A tiny SDXL transformer block (self-attention, cross-attention, GEGLU) with LoRA on SDXL's targets."""
    from diffusers.models.attention import BasicTransformerBlock
    from peft import inject_adapter_in_model

    torch.manual_seed(0)
    block = BasicTransformerBlock(32, 2, 16, cross_attention_dim=24, activation_fn="geglu", attention_bias=False)
    block.requires_grad_(False)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    block = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets), block)
    with torch.no_grad():
        for n, p in block.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return block


def test_self_attention_q_k_v_run_as_one_fused_pass(monkeypatch):
    """use_fused gives the attentions the processor that computes the self-attention's to_q, to_k and to_v, and
    the cross-attention's to_k and to_v, as one fused call each; outputs and every adapter's gradient match peft's within bf16 rounding, no further
    from fp32 than peft's; the state dict and pickling are unchanged."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    ref = _block()
    fast = copy.deepcopy(ref)
    keys = list(fast.state_dict())
    assert fused.use_fused(fast) == 8
    assert type(fast.attn1.processor).__name__ == "FusedQKVAttnProcessor"
    assert type(fast.attn2.processor) is type(fast.attn1.processor)  # its key and value read the text: one call
    assert type(ref.attn1.processor) is AttnProcessor2_0
    assert fused.fused_attentions(fast) == 2 and fused.fused_attentions(ref) == 0
    assert list(fast.state_dict()) == keys
    widths = []
    real = fused._LoraLinear.apply
    monkeypatch.setattr(fused._LoraLinear, "apply", lambda *a: widths.append(a[1].shape[0]) or real(*a))
    x, ctx = torch.randn(2, 12, 32), torch.randn(2, 5, 24)
    exact = _run(copy.deepcopy(ref), x, None, encoder_hidden_states=ctx)
    peft_out, fused_out = (
        _run(ref, x, torch.bfloat16, encoder_hidden_states=ctx),
        _run(fast, x, torch.bfloat16, encoder_hidden_states=ctx),
    )
    # one 96-wide call for attn1's q, k, v, one 64-wide for attn2's k, v; the outputs and attn2's q one by one
    assert sorted(widths) == [32] * 3 + [64, 96]
    assert fused_out[2].keys() == peft_out[2].keys() and len(fused_out[2]) == 16
    for i in (0, 1):
        assert _rel(fused_out[i], peft_out[i]) < 2e-2
        assert _rel(fused_out[i], exact[i]) < 1.5 * _rel(peft_out[i], exact[i]) + 1e-3
    for name, g in fused_out[2].items():
        assert g.dtype == torch.float32
        assert _rel(g, peft_out[2][name]) < 3e-2, name
        assert _rel(g, exact[2][name]) < 1.5 * _rel(peft_out[2][name], exact[2][name]) + 1e-3, name
    back = pickle.loads(pickle.dumps(fast))
    assert type(back.attn1.processor) is type(fast.attn1.processor)
    widths.clear()
    for net in (fast, ref):  # one of the three not plain: diffusers' own processor path, bit for bit without autocast
        net.attn1.to_k.enable_adapters(False)
    assert torch.equal(
        _run(fast, x, None, encoder_hidden_states=ctx)[0], _run(ref, x, None, encoder_hidden_states=ctx)[0]
    )
    _run(fast, x, torch.bfloat16, encoder_hidden_states=ctx)
    assert sorted(widths) == [32] * 5 + [64]  # attn1's q, v and out one by one, its k through peft; attn2 as before


def test_the_one_pass_q_k_v_survive_torch_compile():
    """dynamo traces the processor's fused path (it once did not: a check that called a functools.cache'd class
    factory built a new class under tracing, so every compiled self-attention fell back to q, k, v one by one)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    block = _block()
    fused.use_fused(block)
    block.compile(backend=backend)
    _run(block, torch.randn(2, 12, 32), torch.bfloat16, encoder_hidden_states=torch.randn(2, 5, 24))
    assert len(graphs) == 1 and "block_diag" in graphs[0]
