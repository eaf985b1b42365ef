"""The speed section on the CPU: a compiled run trains as the eager one does; losses are read back in batches.

torch.compile runs on the CPU too (inductor's C++ backend), so the compiled blocks' losses are compared with eager
ones here; what compile buys in time is measured on a GPU (benchmarks/speed.py, docs/benchmarks.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer, train


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from difftrain.families.sd3 import SD3

    return SD3().build_tiny(tmp_path_factory.mktemp("sd3") / "tiny-sd3", seed=0)


def _cfg(recipe, model, data, out, **extra):
    return resolve(recipe=recipe, sets=tiny_sets(model, data, out, **extra)).config


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_model_does(tiny_sd3, dataset, tmp_path, monkeypatch):
    """SD3 (every JointTransformerBlock compiled, LoRA inside, fp8 frozen weights, checkpointed inside the compiled
    blocks): the loss curve of 6 steps matches eager within float tolerance, the compiled blocks really ran
    compiled, and the LoRA exports the same names."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    common = {
        "train.max_steps": 6,
        "train.batch_size": 2,
        "train.checkpoint_every": 1000,
        "train.learning_rate": 3e-3,
        "memory.activations.kind": "checkpoint",
        "memory.weights.kind": "fp8",
        "data.cache_dir": tmp_path / "cache",
    }
    eager = _cfg("tiny-sd3-lora", tiny_sd3, dataset, tmp_path / "eager", **common)
    precompute(eager)
    ref = train(eager)
    compiled_cfg = _cfg(
        "tiny-sd3-lora", tiny_sd3, dataset, tmp_path / "compiled", **common, **{"speed.compile": "true"}
    )
    import torch._dynamo

    torch._dynamo.reset()
    trainer = Trainer(compiled_cfg)
    out = trainer.run()
    blocks = list(trainer.parts.comps["transformer"].transformer_blocks)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)  # Module.compile() in place
    # checkpointed inside each compiled block, diffusers' own checkpointing (around the blocks) switched off
    assert all("forward" in vars(b) for b in blocks) and not trainer.parts.comps["transformer"].gradient_checkpointing
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured graphs (it did not fall back to eager)
    assert out.losses == pytest.approx(ref.losses, rel=2e-3, abs=1e-4)
    a = json.loads((tmp_path / "eager" / "run" / "stats.json").read_text())
    assert a["s_per_step"] > 0
    from safetensors.torch import load_file

    la, lb = load_file(ref.lora_path), load_file(out.lora_path)
    assert la.keys() == lb.keys()  # no _orig_mod. in any name
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["speed.compile_regions=[]"], "speed.compile_regions is empty"),
        (
            ["speed.compile_regions=[Transformer2DModel]", "memory.offload={kind: block_swap, blocks_to_swap: 4}"],
            "with memory.offload block_swap",
        ),
        (
            ["speed.compile_regions=[Transformer2DModel]", "memory.engine={kind: fsdp}", "train.method=full"],
            "with memory.engine fsdp",
        ),
    ],
)
def test_compile_regions_that_cannot_work_are_refused_with_the_config(sets, needle):
    from difftrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        resolve(recipe="sdxl-lora-8gb", sets=sets)
    assert needle in str(e.value)


def test_compile_regions_alone_is_a_valid_config():
    cfg = resolve(recipe="sdxl-lora-8gb", sets=["speed.compile_regions=[Transformer2DModel, ResnetBlock2D]"]).config
    assert cfg.speed.compile_regions == ["Transformer2DModel", "ResnetBlock2D"]


@pytest.mark.slow
def test_sdxl_compiled_by_larger_regions_trains_as_the_eager_model_does(tiny_model, dataset, tmp_path, monkeypatch):
    """speed.compile_regions: SDXL compiled by whole Transformer2DModels (their norm and projections too, the
    BasicTransformerBlocks inside inlined) gives eager's losses, with the inner blocks not compiled again and the
    family's default blocks (ResnetBlock2D) left out."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    common = {"train.max_steps": 3, "train.batch_size": 2, "train.learning_rate": 3e-3}
    common |= {"memory.activations.kind": "none", "data.cache_dir": tmp_path / "cache"}
    eager = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "eager", **common)
    precompute(eager)
    ref = train(eager)
    regions = {"speed.compile": "true", "speed.compile_regions": "[Transformer2DModel]"}
    import torch._dynamo

    torch._dynamo.reset()
    trainer = Trainer(_cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "regions", **common, **regions))
    out = trainer.run()
    unet = trainer.parts.comps["unet"]
    kinds = {}
    for m in unet.modules():
        kinds.setdefault(type(m).__name__, []).append(m._compiled_call_impl is not None)
    assert kinds["Transformer2DModel"] and all(kinds["Transformer2DModel"])
    assert not any(kinds["BasicTransformerBlock"])  # inside a compiled region: traced as part of it
    assert not any(kinds["ResnetBlock2D"])  # the named regions replace the family's blocks
    assert out.losses == pytest.approx(ref.losses, rel=2e-3, abs=1e-4)
    torch._dynamo.reset()


@pytest.mark.slow
def test_losses_read_back_in_batches_equal_per_step_reads(tiny_model, dataset, tmp_path, monkeypatch):
    """speed.sync_seconds: reading the losses every step or only at forced points (checkpoints, the end) gives the
    same losses and the same metrics records; the batched run flushes far less often."""
    common = {
        "train.max_steps": 6,
        "train.batch_size": 2,
        "train.checkpoint_every": 4,
        "data.cache_dir": tmp_path / "cache",
    }
    flushes = []
    real = Trainer._flush

    def counting(self):
        flushes.append(self.pos.step)
        return real(self)

    monkeypatch.setattr(Trainer, "_flush", counting)
    every = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "a", **common, **{"speed.sync_seconds": 0})
    precompute(every)
    a = train(every)
    flushed_every, flushes[:] = list(flushes), []
    batched = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "b", **common, **{"speed.sync_seconds": 1e6})
    b = train(batched)
    assert flushed_every == [1, 2, 3, 4, 5, 6]
    assert flushes == [1, 4, 6]  # the first step, the checkpoint at 4, the end
    assert a.losses == pytest.approx(b.losses, rel=1e-6)
    recs = [[json.loads(x) for x in (tmp_path / r / "run" / "metrics.jsonl").read_text().splitlines()] for r in "ab"]
    assert [r["step"] for r in recs[0]] == [r["step"] for r in recs[1]] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in recs[0]] == pytest.approx([r["loss"] for r in recs[1]], rel=1e-6)
    assert all(r["grad_norm"] > 0 for r in recs[1])  # max_grad_norm is set: its norm is logged too


def test_speed_options_that_cannot_work_together_are_refused():
    from difftrain.config.load import validate

    bad = [
        ({"speed": {"compile": False, "cuda_graphs": True}}, "set speed.compile: true"),
        ({"speed": {"compile": True}, "memory": {"weights": {"kind": "nf4"}}}, "do not compile"),
        ({"speed": {"float8": True}}, "train.method: full"),
        ({"family": "sd3", "speed": {"channels_last": True}}, "channels_last"),
        ({"speed": {"compile": True}, "memory": {"engine": {"kind": "deepspeed", "stage": 3}}}, "stage 2"),
    ]
    from pydantic import ValidationError

    for data, words in bad:
        with pytest.raises(ValidationError, match=words):
            validate(data)
    # CUDA graphs named beside block swap are taken: its blocks then land in fixed GPU slots
    swap = {"speed": {"cuda_graphs": True}, "memory": {"offload": {"kind": "block_swap", "blocks_to_swap": 2}}}
    assert validate(swap).speed.cuda_graphs is True


@pytest.mark.slow
def test_attention_and_optimizer_kernel_choices(tiny_model, dataset, tmp_path):
    """speed.attention math and speed.optimizer_kernels fused train to the same losses as the defaults (CPU);
    a kernel the CPU lacks is refused before the model loads, with the fix."""
    from difftrain.errors import BackendUnavailable

    # a small learning rate: Adam turns rounding-level gradient differences into whole lr-sized steps
    common = {
        "train.max_steps": 3,
        "train.batch_size": 2,
        "train.checkpoint_every": 1000,
        "data.cache_dir": tmp_path / "cache",
        "train.learning_rate": 1e-5,
    }
    base = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "a", **common)
    precompute(base)
    ref = train(base)
    fast = train(
        _cfg(
            "tiny-sdxl-lora",
            tiny_model,
            dataset,
            tmp_path / "b",
            **common,
            **{"speed.attention": "math", "speed.optimizer_kernels": "fused"},
        )
    )
    assert fast.losses == pytest.approx(ref.losses, rel=1e-4)
    with pytest.raises(BackendUnavailable, match="CUDA"):
        Trainer(
            _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "d", **common, **{"speed.attention": "cudnn"})
        ).run()


@pytest.mark.slow
def test_channels_last_unet_trains_as_the_default_layout(tiny_model, dataset, tmp_path):
    common = {
        "train.max_steps": 3,
        "train.batch_size": 2,
        "train.checkpoint_every": 1000,
        "data.cache_dir": tmp_path / "cache",
    }
    base = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "a", **common)
    precompute(base)
    ref = train(base)
    t = Trainer(
        _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "b", **common, **{"speed.channels_last": "true"})
    )
    out = t.run()
    conv = (
        t.parts.comps["unet"].conv_in.base_layer
        if hasattr(t.parts.comps["unet"].conv_in, "base_layer")
        else t.parts.comps["unet"].conv_in
    )
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
    assert out.losses == pytest.approx(ref.losses, rel=1e-4)


@pytest.mark.slow
def test_fused_lora_kernel_trains_as_peft_and_exports_the_same_file(tiny_model, dataset, tmp_path):
    """speed.lora_kernel fused (auto's choice on CUDA) under bf16 autocast: the same losses as peft's forward
    within bf16 rounding, every LoRA Linear of the UNet swapped and every attention's projections of one input run
    as one call, the same LoRA file names."""
    from safetensors import safe_open

    common = {
        "train.max_steps": 3,
        "train.batch_size": 2,
        "train.checkpoint_every": 1000,
        "train.mixed_precision": "bf16",
        "data.cache_dir": tmp_path / "cache",
    }
    base = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "a", **common, **{"speed.lora_kernel": "peft"})
    precompute(base)
    ref = train(base)
    t = Trainer(_cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "b", **common, **{"speed.lora_kernel": "fused"}))
    out = t.run()
    from peft.tuners.lora.layer import Linear

    lora = [m for m in t.parts.comps["unet"].modules() if isinstance(m, Linear)]
    assert lora and all(type(m).__name__ == "FusedLoraLinear" for m in lora)
    from difftrain.speed import lora_kernel as fused

    attentions = [m for m in t.parts.comps["unet"].modules() if hasattr(m, "processor")]
    assert attentions and fused.fused_attentions(t.parts.comps["unet"]) == len(attentions)
    assert out.losses == pytest.approx(ref.losses, rel=2e-2)
    assert out.losses != ref.losses  # the fused arithmetic ran (bf16 rounds it apart from peft's)
    files = sorted(p.name for p in ref.output_dir.glob("*.safetensors"))
    assert ref.lora_path is not None and ref.lora_path.name in files
    assert files == sorted(p.name for p in out.output_dir.glob("*.safetensors"))
    for name in files:
        with safe_open(ref.output_dir / name, "pt") as fa, safe_open(out.output_dir / name, "pt") as fb:
            assert sorted(fa.keys()) == sorted(fb.keys())


def test_compile_mode_follows_cuda_graphs_and_autotune(monkeypatch):
    """speed.cuda_graphs and regional_compile.compile_mode map onto torch.compile's four modes, and every block is compiled."""
    from difftrain.config.schema import SpeedConfig
    from difftrain.speed import regional_compile

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append((type(self).__name__, kw["mode"])))
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    expect = {
        ("default", False): None,
        ("default", True): "reduce-overhead",
        ("max-autotune", False): "max-autotune-no-cudagraphs",
        ("max-autotune", True): "max-autotune",
        ("max-autotune-no-cudagraphs", False): "max-autotune-no-cudagraphs",
        ("max-autotune-no-cudagraphs", True): "max-autotune",
    }
    for (mode, graphs), torch_mode in expect.items():
        seen.clear()
        assert (
            regional_compile.compile_blocks(
                net, ("Linear",), SpeedConfig(compile=True, compile_mode=mode, cuda_graphs=graphs)
            )
            == 2
        )
        assert seen == [("Linear", torch_mode)] * 2


def test_compile_regions_compiles_the_named_outer_modules_not_the_blocks_inside_them(monkeypatch):
    """speed.compile_regions: a region inside another named one is compiled as part of it (compiling it as well
    would nest two compiled regions); a name the model lacks is refused, naming it."""
    from difftrain.config.schema import SpeedConfig
    from difftrain.errors import ConfigError
    from difftrain.speed import regional_compile

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(type(self).__name__))
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    net = torch.nn.ModuleList([inner, torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2))])
    sp = SpeedConfig(compile=True, compile_regions=["Sequential", "Linear"])
    assert regional_compile.compile_blocks(net, tuple(sp.compile_regions), sp) == 3
    assert sorted(seen) == ["Linear", "Sequential", "Sequential"]  # the Linears inside the Sequentials are not
    seen.clear()
    sp = SpeedConfig(compile=True, compile_regions=["Sequential", "Transformer2DModel"])
    with pytest.raises(ConfigError, match="Transformer2DModel") as e:
        regional_compile.compile_blocks(net, tuple(sp.compile_regions), sp)
    assert "Sequential" not in str(e.value.message) and seen == []


@pytest.mark.slow
def test_compiled_trainers_count_model_flops_eagerly_without_compiling(tiny_model, dataset, tmp_path):
    """bench speed's FLOP count of a compiled config (a compiled baseline, as float8 against compiled bf16 needs):
    the compiled blocks run eagerly under the counter, so it sees the same matmuls as the eager model, and nothing
    is compiled for it; with checkpointing inside the compiled blocks the recompute is estimated, taken off and said
    to be."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from difftrain.flows.bench import step_flops

    common = {"train.batch_size": 1, "memory.activations.kind": "none", "data.cache_dir": tmp_path / "cache"}
    precompute(_cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "p", **common))
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]  # process-wide: earlier tests compiled too
    counts = {}
    for name, extra in {
        "eager": {},
        "compiled": {"speed.compile": "true"},
        "compiled-ckpt": {"speed.compile": "true", "memory.activations.kind": "checkpoint"},
    }.items():
        trainer = Trainer(_cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / name, **{**common, **extra}))
        trainer.setup()
        counts[name] = step_flops(trainer)
    assert counts["eager"][0] > 1e8 and counts["eager"][1] is True
    assert counts["compiled"] == counts["eager"]
    # checkpointed inside the blocks: each block's forward is counted again in backward, and taken off again as a
    # no-grad forward's count (the blocks are nearly all of it): an estimate near the count without checkpoints
    assert counts["compiled-ckpt"][1] is False
    assert 0.9 * counts["eager"][0] < counts["compiled-ckpt"][0] < 1.02 * counts["eager"][0], counts
    assert counters["stats"]["unique_graphs"] == graphs  # the counter ran the compiled blocks eagerly
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("python", [False, True])
def test_the_profile_environment_profiles_the_named_step_and_training_goes_on(
    tiny_model, dataset, tmp_path, monkeypatch, python
):
    """DIFFTRAIN_PROFILE_DIR / _STEP (a developer's multi-rank profiler): the named step is profiled on this rank,
    its summary written, and the run trains every step as without it. DIFFTRAIN_PROFILE_PYTHON=1: the host's
    Python over that step alone (cProfile), by own and cumulative time."""
    monkeypatch.setenv("DIFFTRAIN_PROFILE_DIR", str(tmp_path / "prof"))
    monkeypatch.setenv("DIFFTRAIN_PROFILE_STEP", "3")
    monkeypatch.setenv("DIFFTRAIN_PROFILE_PYTHON", "1" if python else "")
    cfg = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "a", **{"train.max_steps": 4,
               "train.checkpoint_every": 1000, "data.cache_dir": tmp_path / "cache"})  # fmt: skip
    precompute(cfg)
    r = train(cfg)
    assert len(r.losses) == 4
    got = json.loads((tmp_path / "prof" / "profile.rank0.json").read_text())
    assert got["step"] == 3 and got["wall_ms"] > 0
    table = (tmp_path / "prof" / "profile.rank0.txt").read_text()
    if not python:
        assert got["cpu_ops"] > 10
        assert "aten::convolution" in table or "aten::conv2d" in table  # the UNet's step, not an empty window
        return
    assert got["python"] is True
    assert "===== by tottime" in table and "===== by cumulative" in table
    assert "backward" in table  # the step's own work was recorded
    assert "save_checkpoint" not in table and "precompute" not in table  # and nothing outside the step


@pytest.mark.slow
def test_speed_attention_fa4_says_after_the_first_step_whether_any_attention_reached_it(
    tiny_model, dataset, tmp_path, monkeypatch, capsys
):
    """A run whose attention silently stayed on SDPA measured exactly as fast as cuDNN (H100): with fa4 named, the
    first step's end says how many calls FA4 ran, or warns that none did. FA4's kernels need a GPU: here the device
    check is skipped and, in the second run, the kernel is SDPA behind FA4's call counter."""
    import torch.nn.functional as F

    from difftrain.speed import fa4

    common = {"train.max_steps": 2, "train.checkpoint_every": 1000, "data.cache_dir": tmp_path / "cache",
              "speed.attention": "fa4"}  # fmt: skip
    monkeypatch.setattr(fa4, "check", lambda device: None)
    first = _cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "a", **common)
    precompute(first)
    train(first)  # on the CPU no call is eligible
    err = " ".join(capsys.readouterr().err.split())
    assert "no attention call of the first step reached FlashAttention-4" in err

    def counted(q, k, v, scale=None):
        fa4.calls += 1
        return fa4._SDPA(q, k, v, scale=scale)

    monkeypatch.setattr(fa4, "eligible", lambda q, k, v, *a: k.shape[-2] > 8)  # the tiny UNet's self-attention
    monkeypatch.setattr(fa4, "attention", counted)
    train(_cfg("tiny-sdxl-lora", tiny_model, dataset, tmp_path / "b", **common))
    out = " ".join(capsys.readouterr().err.split())
    assert "FlashAttention-4 ran" in out and "no attention call" not in out
    assert F.scaled_dot_product_attention is fa4._SDPA  # restored after the run
