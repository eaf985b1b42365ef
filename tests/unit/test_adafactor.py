"""memory.optimizer adafactor (issue 23: what fits SDXL's full fine-tune in a real 12 GB card): the same steps as
transformers' Adafactor in sd-scripts' settings, small updates kept in bf16, exact resume, the planner's state term,
sd-scripts' options converted."""

from __future__ import annotations

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.config.schema import MemoryConfig
from difftrain.memory.optimizers import AdafactorBF16, FusedBackward, make_optimizer
from difftrain.planning.estimate import plan_memory


def _grads(shape, i):
    return torch.randn(shape, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("shape", [(48, 32), (8, 4, 3, 3), (40,)])  # a matrix, a convolution, a vector
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_transformers_adafactor_on_fp32_weights(shape, wd):
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(shape))
    b = torch.nn.Parameter(a.detach().clone())
    oa = AdafactorBF16([a], lr=1e-2, weight_decay=wd)
    ob = Adafactor([b], lr=1e-2, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=wd)
    for i in range(15):
        a.grad, b.grad = _grads(shape, i), _grads(shape, i)
        oa.step()
        ob.step()
    assert not torch.equal(a.detach(), torch.randn(shape, generator=torch.Generator().manual_seed(0)))  # it moved
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_is_factored_for_matrices():
    w, v = torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(7))
    o = AdafactorBF16([w, v], lr=1e-3)
    w.grad, v.grad = torch.ones_like(w), torch.ones_like(v)
    o.step()
    assert o.state[w]["exp_avg_sq_row"].shape == (64,) and o.state[w]["exp_avg_sq_col"].shape == (32,)
    assert "exp_avg_sq" not in o.state[w] and o.state[v]["exp_avg_sq"].shape == (7,)


def test_small_updates_survive_in_bf16_only_with_stochastic_rounding():
    w_sr = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    w_rn = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    opts = [AdafactorBF16([w], lr=1e-3, stochastic_rounding=sr) for w, sr in ((w_sr, True), (w_rn, False))]
    for _ in range(100):
        for w, o in zip((w_sr, w_rn), opts):
            w.grad = -torch.ones_like(w)  # a normalised step of lr = 1e-3, below bf16's spacing at 1.0 (7.8e-3)
            o.step()
    assert w_rn.float().mean().item() == 1.0
    assert w_sr.float().mean().item() == pytest.approx(1.1, abs=0.01)


def test_resume_is_exact_in_bf16():
    """Half the steps, the state through a state_dict into a new optimizer, the rest: the same bits."""

    def run(split: int | None):
        torch.manual_seed(1)
        w = torch.nn.Parameter(torch.randn(32, 16).bfloat16())
        o = AdafactorBF16([w], lr=1e-2, seed=3)
        for i in range(10):
            if i == split:
                sd = o.state_dict()
                o = AdafactorBF16([w], lr=1e-2, seed=3)
                o.load_state_dict(sd)
                assert o.state[w]["exp_avg_sq_row"].dtype == torch.float32  # not cast to the weight's bf16
            w.grad = _grads((32, 16), i).bfloat16()
            o.step()
        return w.detach()

    assert torch.equal(run(None), run(5))


def test_config_builds_it_inside_and_outside_the_fused_backward_pass():
    p = [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))]
    mem = MemoryConfig.model_validate({"optimizer": {"kind": "adafactor", "clip_threshold": 2.0}})
    o = make_optimizer(mem, [{"params": p}], 1e-5)
    assert type(o) is AdafactorBF16 and o.param_groups[0]["clip_threshold"] == 2.0 and o.param_groups[0]["lr"] == 1e-5
    fused = make_optimizer(mem.model_copy(update={"fused_backward": True}), [{"params": p}], 1e-5)
    assert isinstance(fused, FusedBackward) and type(fused.inner[p[0]]) is AdafactorBF16


def test_fused_backward_adafactor_steps_during_backward():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).bfloat16()
    before = lin.weight.detach().clone()
    mem = MemoryConfig.model_validate({"optimizer": {"kind": "adafactor"}, "fused_backward": True})
    make_optimizer(mem, [{"params": list(lin.parameters())}], 1e-2)
    lin(torch.randn(4, 8).bfloat16()).square().sum().backward()
    assert lin.weight.grad is None and not torch.equal(lin.weight.detach(), before)


def test_planner_counts_the_factored_state():
    from difftrain.families.common import read_json
    from difftrain.families.sdxl.family import _new_module, bundled_config_dir

    cfg = resolve(recipe="tiny-sdxl-lora", sets=["train.method=full", "memory.optimizer={kind: adafactor}"]).config
    e = plan_memory(cfg)
    with torch.device("meta"):
        unet = _new_module("unet", read_json(bundled_config_dir(cfg.model.config) / "unet" / "config.json"))
    # the state the optimizer builds on its first step, counted from its own shapes
    w = torch.nn.Parameter(torch.zeros(3, 5, 2, 4))
    probe = AdafactorBF16([w], lr=1e-5)
    w.grad = torch.ones_like(w)
    probe.step()
    per_shape = sum(t.numel() for k, t in probe.state[w].items() if k != "step")
    assert per_shape == 3 * 5 * 2 + 3 * 5 * 4
    expected = 0
    for p in unet.parameters():
        s = p.shape
        expected += s.numel() if len(s) < 2 else s[:-1].numel() + (s[:-2] + s[-1:]).numel()
    assert e.gpu["optimizer state"] * 2**30 == pytest.approx(expected * 4)
    adamw = plan_memory(resolve(recipe="tiny-sdxl-lora", sets=["train.method=full"]).config)
    assert e.gpu["optimizer state"] < adamw.gpu["optimizer state"] / 4


def test_sd_scripts_options_convert():
    from difftrain.config.sdscripts import convert

    c = convert(["sdxl_train.py", "--optimizer_type=Adafactor", "--fused_backward_pass", "--full_bf16"])
    cfg = resolve(extra=c.config, sets=["train.max_grad_norm=null"]).config
    assert cfg.memory.optimizer.kind == "adafactor" and cfg.memory.fused_backward is True
