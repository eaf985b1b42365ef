"""memory.weights int4 (memory/int4.py): the codes and their packing against the formulas written out, the layer's
forward and input gradient against the dequantized weight (eager and compiled), peft's LoRA over it, the planner's
bytes and what the config refuses."""

from __future__ import annotations

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.errors import ConfigError
from difftrain.memory import int4


def test_codes_and_packing_follow_the_affine_formula():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.linspace(0.1, 3, 8)[:, None]
    packed, scale, zero = int4.quantize(w, 16, torch.bfloat16)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32) and scale.shape == zero.shape == (8, 4)
    g = w.reshape(8, 4, 16)
    # written out: per group of 16 columns, scale (max - min) / 15 and zero min, both rounded to bf16 first
    s = ((g.amax(-1) - g.amin(-1)) / 15).to(torch.bfloat16)
    z = g.amin(-1).to(torch.bfloat16)
    assert torch.equal(scale, s) and torch.equal(zero, z)
    q = ((g - z.float()[..., None]) / s.float()[..., None]).round().clamp(0, 15).reshape(8, 64).to(torch.uint8)
    assert torch.equal(packed & 0x0F, q[:, 0::2]) and torch.equal(packed >> 4, q[:, 1::2])  # even column low
    back = int4.dequantize(packed, scale, zero, torch.float32)
    assert torch.equal(back, (q.reshape(8, 4, 16).float() * s.float()[..., None] + z.float()[..., None]).reshape(8, 64))
    step = s.float().repeat_interleave(16, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()  # within half a step of the weight


def _pair(bias=True):
    torch.manual_seed(1)
    a = torch.nn.Linear(64, 24, bias=bias).requires_grad_(False)
    b = torch.nn.Linear(64, 24, bias=bias).requires_grad_(False)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_layer_computes_with_the_dequantized_weight_forward_and_backward(compiled):
    _, lin = _pair()
    assert int4.convert(lin, "cpu", 16) == {"int4_params": 64 * 24, "kept_params": 24}
    assert isinstance(lin, int4.Int4Linear) and lin.in_features == 64 and lin.weight.shape == (24, 32)
    w = int4.dequantize(lin.weight, lin.int4_scale, lin.int4_zero, torch.float32)
    x = torch.randn(3, 5, 64, requires_grad=True)
    fn = torch.compile(lin, backend="aot_eager", fullgraph=True) if compiled else lin
    y = fn(x)
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.nn.functional.linear(x2, w, lin.bias)
    y2.square().sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)


def test_convert_keeps_the_named_and_the_ungroupable_layers():
    m = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 8), torch.nn.Linear(64, 8))
    m.requires_grad_(False)
    counts = int4.convert(m, "cpu", 16, skip=("2",))
    assert [type(x).__name__ for x in m] == ["Int4Linear", "Linear", "Linear"]  # 8 columns: no whole group
    assert counts["int4_params"] == 64 * 8


def test_peft_lora_over_an_int4_layer_trains_only_the_adapter():
    from peft import LoraConfig, get_peft_model

    base = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).requires_grad_(False)
    int4.convert(base, "cpu", 16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=4, target_modules=["0", "2"], init_lora_weights=False))
    x = torch.randn(4, 64)
    model(x).square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads) and all(g.abs().sum() > 0 for g in grads.values())
    layer = model.base_model.model[0]
    assert isinstance(layer.base_layer, int4.Int4Linear) and layer.base_layer.weight.dtype == torch.uint8
    assert layer.lora_A["default"].weight.dtype == torch.float32 and layer.lora_A["default"].in_features == 64


def test_the_planner_counts_half_a_byte_and_the_groups_scales(tmp_path):
    from difftrain.memory.planner import _part_bytes

    sets = [f"data.dir={tmp_path}", "memory.weights={kind: int4, group_size: 64}"]
    cfg = resolve(recipe="tiny-flux-lora", sets=sets).config
    hints = {
        "trained_parts": ["transformer"],
        "parts": {"transformer": {"total": 1000, "fp8_eligible": 900, "linear": 800}},
    }
    bytes_, _, _ = _part_bytes(cfg, hints, "bf16")
    assert bytes_["transformer"] == pytest.approx(800 * (0.5 + 4 / 64) + 200 * 2)


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["train.method=full"], "rounds a weight once"),
        (["lora.use_dora=true"], "DoRA"),
        (["lora.type=loha"], "packed"),
        (["memory.weights={kind: int4, group_size: 48}"], "group_size"),
    ],
)
def test_the_config_refuses_what_int4_cannot_train(tmp_path, sets, words):
    with pytest.raises(ConfigError) as e:
        resolve(recipe="tiny-flux-lora", sets=[f"data.dir={tmp_path}", "memory.weights={kind: int4}", *sets])
    assert words in str(e.value)


def test_block_swap_and_compile_with_int4_validate(tmp_path):
    sets = [f"data.dir={tmp_path}", "memory.weights={kind: int4}", "speed.compile=true",
            "memory.activations={kind: checkpoint}", "memory.offload={kind: block_swap, blocks_to_swap: 2}"]  # fmt: skip
    assert resolve(recipe="tiny-flux-lora", sets=sets).config.memory.weights.kind == "int4"


@pytest.mark.slow
def test_tiny_flux_trains_in_int4_with_and_without_block_swap(_dataset_master, tmp_path):
    """A LoRA over the int4 base trains alike with block swap and without (the packed codes move block by block),
    close to the bf16 base's run (the codes are within half a step of the weights)."""
    from conftest import tiny_sets
    from difftrain.families.registry import get_family
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import Trainer

    model = get_family("flux").build_tiny(tmp_path / "model", seed=0)
    runs = {}
    variants = {
        "bf16": ["memory.weights={kind: bf16}"],
        "int4": ["memory.weights={kind: int4, group_size: 16}", "memory.activations={kind: checkpoint}"],
        "int4-swap": ["memory.weights={kind: int4, group_size: 16}", "memory.activations={kind: checkpoint}",
                      "memory.offload={kind: block_swap, blocks_to_swap: 2}"],
    }  # fmt: skip
    for name, sets in variants.items():
        more = {"train.max_steps": 3, "report.to": "[]", "save.formats": "[]", "data.cache_dir": tmp_path / "cache",
                "train.mixed_precision": "bf16"}  # fmt: skip
        cfg = resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / name, **more) + sets)
        precompute(cfg.config)
        t = Trainer(cfg.config)
        runs[name] = t.run().losses
        if name.startswith("int4"):
            den = t.parts.comps["transformer"]
            assert sum(isinstance(m, int4.Int4Linear) for m in den.modules()) > 20
    assert runs["int4-swap"] == runs["int4"]
    assert runs["int4"] == pytest.approx(runs["bf16"], rel=0.01)
    assert runs["int4"] != runs["bf16"]
