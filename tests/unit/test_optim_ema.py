"""Our bf16 AdamW with stochastic rounding, the EMA, and the streaming safetensors writer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from difftrain.config.schema import MemoryConfig
from difftrain.errors import BackendUnavailable
from difftrain.memory.optimizers import AdamWBF16, make_optimizer, stochastic_round_bf16
from difftrain.trainers.ema import EMA
from difftrain.utils import stream_save_safetensors


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    g = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1.0 to the next bf16 (1 + 2^-7 ... step 2^-7)
    r = stochastic_round_bf16(x, g).float()
    lo, hi = 1.0, 1.0 + 2**-7
    assert set(r.unique().tolist()) == {lo, hi}
    assert r.mean().item() == pytest.approx(x[0].item(), abs=2e-5)
    neg = stochastic_round_bf16(-x, g).float()
    assert neg.mean().item() == pytest.approx(-x[0].item(), abs=2e-5)


def test_small_updates_survive_in_bf16_only_with_stochastic_rounding():
    """lr-sized steps below bf16's resolution: round-to-nearest loses them all."""
    w_sr = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    w_rn = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opts = [AdamWBF16([w], lr=1e-3, weight_decay=0, stochastic_rounding=sr) for w, sr in ((w_sr, True), (w_rn, False))]
    for _ in range(100):
        for w, o in zip((w_sr, w_rn), opts):
            w.grad = -torch.ones_like(w)  # Adam step ~ lr = 1e-3 < bf16 spacing at 1.0 (2^-7 ~ 7.8e-3)
            o.step()
    assert w_rn.float().mean().item() == 1.0
    assert w_sr.float().mean().item() == pytest.approx(1.1, abs=0.01)


def test_adamw_bf16_matches_torch_adamw_on_fp32_weights():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32))
    b = torch.nn.Parameter(a.detach().clone())
    oa = AdamWBF16([a], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ob = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for i in range(20):
        grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_optimizer_choice():
    fp32 = [torch.nn.Parameter(torch.zeros(2))]
    bf16 = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    assert type(make_optimizer(MemoryConfig(), [{"params": fp32}], 1e-3)) is torch.optim.AdamW
    assert type(make_optimizer(MemoryConfig(), [{"params": bf16}], 1e-3)) is AdamWBF16
    mem = MemoryConfig.model_validate({"optimizer": {"kind": "adamw8bit"}})
    with pytest.raises(BackendUnavailable):
        make_optimizer(mem, [{"params": fp32}], 1e-3)  # no bitsandbytes here, or no CUDA


def test_ema_by_hand():
    p = torch.nn.Parameter(torch.tensor([2.0, -4.0]))
    ema = EMA({"w": p}, decay=0.9, update_every=2, device="cpu")
    values = [torch.tensor([4.0, 0.0]), torch.tensor([10.0, 10.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    updated = []
    for step, v in enumerate(values, start=1):
        with torch.no_grad():
            p.copy_(v)
        updated.append(ema.update(step))
    assert updated == [False, True, False, True]
    # only steps 2 and 4 count: e = 0.9 * (0.9 * [2, -4] + 0.1 * [10, 10]) + 0.1 * [1, 1]
    expected = 0.9 * (0.9 * torch.tensor([2.0, -4.0]) + 0.1 * torch.tensor([10.0, 10.0])) + 0.1 * torch.tensor(
        [1.0, 1.0]
    )
    torch.testing.assert_close(ema.shadow["w"], expected)
    assert ema.shadow["w"].device.type == "cpu" and ema.shadow["w"].dtype == torch.float32


def test_stream_writer_round_trip_and_keeps_old_file_on_failure(tmp_path):
    d = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2, 2).bfloat16(), "s": torch.tensor(1.5)}
    # each tensor's bytes are written from its own buffer: fp8, a transposed (non-contiguous) one and an empty one too
    more = {"f8": torch.randn(6).to(torch.float8_e4m3fn), "t": torch.randn(3, 5).t(), "e": torch.empty(0, 4)}
    f = stream_save_safetensors(tmp_path / "x.safetensors", {**d, **more}, metadata={"k": "v"})
    back = load_file(f)
    assert all(torch.equal(back[k], d[k]) for k in d)
    assert back["f8"].view(torch.uint8).equal(more["f8"].view(torch.uint8))
    assert back["t"].equal(more["t"]) and back["t"].shape == (5, 3) and back["e"].shape == (0, 4)
    half = load_file(stream_save_safetensors(tmp_path / "h.safetensors", d, dtype=torch.float16))
    assert half["a"].dtype == torch.float16 and half["b"].dtype == torch.int64

    class Boom(torch.Tensor):
        pass

    bad = dict(d)
    bad["z"] = torch.randn(2).as_subclass(Boom)
    bad_to = Boom.to

    def explode(*a, **k):
        raise OSError("disk full")

    Boom.to = explode
    try:
        with pytest.raises(OSError):
            stream_save_safetensors(f, bad)
    finally:
        Boom.to = bad_to
    assert all(torch.equal(load_file(f)[k], d[k]) for k in d)  # the old file is intact
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


class _Packed(torch.Tensor):
    """A stand-in for torchao's quantized optimizer states: a wrapper subclass with inner tensors."""

    @staticmethod
    def __new__(cls, codes, scale, signed, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scale, signed, dtype):
        self.codes, self.scale, self.signed = codes, scale, signed

    def __tensor_flatten__(self):
        return ["codes", "scale"], [self.signed, self.dtype]

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size=None, outer_stride=None):
        return cls(inner["codes"], inner["scale"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)  # like torchao's states: no raw byte view of the wrapper


def test_checkpoint_state_stores_allowed_tensor_subclasses(tmp_path, monkeypatch):
    from difftrain.errors import CheckpointError
    from difftrain.trainers import state

    t = _Packed(torch.arange(6, dtype=torch.uint8).reshape(2, 3), torch.tensor([0.5, 2.0]), True, torch.bfloat16)
    obj = {"state": {0: {"exp_avg": t, "step": torch.tensor(3.0)}}}
    with pytest.raises(TypeError, match="tensor subclass"):
        state.save_tree(obj, tmp_path, "opt")  # not on the allowlist
    name = f"{_Packed.__module__}._Packed"
    monkeypatch.setattr(state, "SUBCLASSES", state.SUBCLASSES | {name})
    state.save_tree(obj, tmp_path, "opt")
    back = state.load_tree(tmp_path, "opt")["state"][0]["exp_avg"]
    assert type(back) is _Packed and back.signed is True and back.dtype == torch.bfloat16
    assert torch.equal(back.codes, t.codes) and torch.equal(back.scale, t.scale)
    monkeypatch.setattr(state, "SUBCLASSES", set())
    with pytest.raises(CheckpointError, match="unknown tensor class"):
        state.load_tree(tmp_path, "opt")


@pytest.fixture
def fake_bnb(monkeypatch):
    """A stand-in for bitsandbytes.optim.optimizer (not installed on CPU machines): its module-level sync_gpu, and
    an optimizer whose step calls it after each parameter as bitsandbytes 0.50's does."""
    import sys
    import types

    calls: list[str] = []
    mod = types.ModuleType("bitsandbytes.optim.optimizer")
    mod.sync_gpu = lambda t: calls.append("sync")  # type: ignore[attr-defined]

    class Fake8bit(torch.optim.Optimizer):
        is_paged = False

        def __init__(self, params, fail: bool = False):
            super().__init__(params, {"lr": 0.1})
            self.fail = fail

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.sub_(g["lr"] * p.grad)
                    sys.modules["bitsandbytes.optim.optimizer"].sync_gpu(p)
            if self.fail:
                raise RuntimeError("step failed")

    pkg, optim = types.ModuleType("bitsandbytes"), types.ModuleType("bitsandbytes.optim")
    pkg.optim, optim.optimizer = optim, mod  # type: ignore[attr-defined]
    for name, m in (("bitsandbytes", pkg), ("bitsandbytes.optim", optim), ("bitsandbytes.optim.optimizer", mod)):
        monkeypatch.setitem(sys.modules, name, m)
    return types.SimpleNamespace(mod=mod, cls=Fake8bit, calls=calls)


def _param_with_grad() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    return p


def test_bitsandbytes_step_runs_without_its_per_parameter_syncs_and_puts_them_back(fake_bnb):
    from difftrain.memory.optimizers import without_syncs

    real = fake_bnb.mod.sync_gpu
    cls = without_syncs(fake_bnb.cls)
    assert cls.__name__ == "Fake8bit" and issubclass(cls, fake_bnb.cls)
    ps = [_param_with_grad(), _param_with_grad()]
    opt = cls([{"params": ps}])
    opt.step()
    assert fake_bnb.calls == []  # not one wait
    assert all(torch.equal(p.detach(), torch.full((4,), 0.8)) for p in ps)  # the update itself ran
    assert fake_bnb.mod.sync_gpu is real
    fake_bnb.cls([{"params": [_param_with_grad()]}]).step()  # bitsandbytes' own class still waits
    assert fake_bnb.calls == ["sync"]
    failing = cls([{"params": [_param_with_grad()]}], fail=True)
    with pytest.raises(RuntimeError, match="step failed"):
        failing.step()
    assert fake_bnb.mod.sync_gpu is real  # put back when the step raises too


def test_paged_bitsandbytes_state_keeps_its_syncs(fake_bnb):
    from difftrain.memory.optimizers import syncs_needed, without_syncs

    class Paged(fake_bnb.cls):
        is_paged = True

    opt = without_syncs(Paged)([{"params": [_param_with_grad(), _param_with_grad()]}])
    assert syncs_needed(opt)
    opt.step()
    assert fake_bnb.calls == ["sync", "sync"]
    assert not syncs_needed(without_syncs(fake_bnb.cls)([{"params": [_param_with_grad()]}]))


def test_host_stack_and_the_families_collate_give_torch_stack_and_zero_padding():
    """families/base.py host_stack without pinning (a CPU trainer, or speed.pin_memory false) is torch.stack, and the
    families' collate_text give the same tensors as before it (pinning itself needs CUDA: tests/gpu/test_gpu.py)."""
    from difftrain.families.base import host_stack
    from difftrain.families.flux2 import Flux2
    from difftrain.families.zimage import ZImage

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 4, generator=g) for _ in range(2)]
    got = host_stack(xs)
    assert torch.equal(got, torch.stack(xs)) and not got.is_pinned()
    rows = [{"prompt_embeds": x} for x in xs]
    assert torch.equal(Flux2().collate_text("llm", rows)["prompt_embeds"], torch.stack(xs))
    states = [torch.randn(n, 4, generator=g) for n in (2, 5)]
    out = ZImage().collate_text("llm", [{"prompt_embeds": s} for s in states])
    want = torch.zeros(2, 5, 4)
    want[0, :2], want[1] = states[0], states[1]
    assert torch.equal(out["prompt_embeds"], want) and out["prompt_length"].tolist() == [2, 5]
