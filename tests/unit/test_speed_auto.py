"""speed auto (issue 24): every reason to stay eager, when compiling pays, when CUDA graphs go with it, and that
explicit options override it. The platform is a :class:`Platform` the test builds, so each GPU case runs here."""

from __future__ import annotations

import sys

import pytest

from difftrain.config.load import resolve
from difftrain.config.schema import SpeedConfig
from difftrain.errors import BackendUnavailable
from difftrain.speed.auto import (
    MAX_GRAPH_SHAPES,
    PAYBACK,
    CompileCost,
    Platform,
    RunFacts,
    decide,
    graphs_possible,
    platform_facts,
)
from difftrain.speed.regional_compile import is_warm, mark_warm

COST = CompileCost(
    cold_s=120.0, warm_s=30.0, saved_s=0.8, saved_s_no_graphs=0.3, dynamic_s=3.0, shape_s=1.0, record_s=10.0
)
H100 = Platform(device="cuda", capability=(9, 0), triton="3.5.0")
AUTO = SpeedConfig()
LONG = RunFacts(steps=2000)


def test_auto_is_the_default():
    assert AUTO.compile == "auto" and AUTO.cuda_graphs == "auto"


def test_auto_compiles_with_cuda_graphs_on_a_capable_gpu_for_a_long_run():
    c = decide(AUTO, COST, H100, LONG)
    assert c.compile and c.cuda_graphs
    assert c.compile_s == COST.cold_s
    assert "Triton 3.5.0" in c.reason and "9.0" in c.reason
    assert c.line().startswith("speed: compiled + CUDA graphs: auto")


@pytest.mark.parametrize(
    ("platform", "run", "words"),
    [
        (Platform(device="cpu"), LONG, "the device is cpu"),
        (Platform(device="mps"), LONG, "the device is mps"),
        (Platform(device="cuda", capability=(9, 0), triton="3.5", dynamo_disabled=True), LONG, "TORCHDYNAMO_DISABLE"),
        (Platform(device="cuda", capability=(9, 0), triton="3.5", tracer="sys.settrace (pdb)"), LONG, "debugger"),
        (Platform(device="cuda", capability=(8, 6), triton=None, windows=True), LONG, "pip install triton-windows"),
        (Platform(device="cuda", capability=(8, 6), triton=None, triton_error="ImportError: x"), LONG, "ImportError"),
        (Platform(device="cuda", capability=(6, 1), triton="3.5"), LONG, "compute capability 6.1"),
        (H100, RunFacts(steps=2000, quantized="nf4"), "bitsandbytes"),
        (H100, RunFacts(steps=2000, deepspeed_stage=3), "ZeRO-3"),
        (H100, RunFacts(steps=50), "50 steps would save"),
    ],
)
def test_every_reason_to_stay_eager_is_named(platform, run, words):
    c = decide(AUTO, COST, platform, run)
    assert not c.compile and not c.cuda_graphs
    assert words in c.reason
    assert c.line().startswith("speed: eager: auto: ")


def test_the_step_count_weighs_the_compile_time_and_a_warm_cache_lowers_it():
    # with CUDA graphs a step saves 0.8 s: the cold compile and one recording (130 s) pay back PAYBACK times from
    # 204 steps
    need = int(PAYBACK * (COST.cold_s + COST.record_s) / COST.saved_s) + 1
    assert decide(AUTO, COST, H100, RunFacts(steps=need)).compile
    assert not decide(AUTO, COST, H100, RunFacts(steps=need - 2)).compile
    # the same short run compiles when this config's kernels are already in the cache
    assert decide(AUTO, COST, H100, RunFacts(steps=need - 2, warm=True)).compile
    assert "cache warm" in decide(AUTO, COST, H100, RunFacts(steps=need - 2, warm=True)).reason
    # without CUDA graphs (block swap of a full fine-tune's weights) a step saves less, so more steps are needed
    assert not decide(AUTO, COST, H100, RunFacts(steps=need, block_swap_trained=True)).compile
    swap_need = int(PAYBACK * COST.cold_s / COST.saved_s_no_graphs) + 1
    c = decide(AUTO, COST, H100, RunFacts(steps=swap_need, block_swap_trained=True))
    assert c.compile and not c.cuda_graphs and "block swap" in c.reason


@pytest.mark.parametrize(
    ("run", "words"),
    [
        (RunFacts(steps=5000, block_swap_trained=True), "block swap of trained weights"),
        (RunFacts(steps=5000, fp8_weights=True), "fp8-stored weights"),
        (RunFacts(steps=5000, deepspeed_stage=2), "DeepSpeed"),
        (RunFacts(steps=5000, fsdp=True), "FSDP"),
        (RunFacts(steps=5000, fsdp=True, processes=2), "FSDP"),
        (RunFacts(steps=5000, shapes=MAX_GRAPH_SHAPES + 1), f"{MAX_GRAPH_SHAPES + 1} bucket shapes"),
    ],
)
def test_cuda_graphs_stay_off_where_they_do_not_fit_and_say_why(run, words):
    c = decide(AUTO, COST, H100, run)
    assert c.compile and not c.cuda_graphs
    assert words in c.reason


def test_lora_block_swap_records_cuda_graphs_and_a_full_fine_tunes_does_not():
    # LoRA's swapped blocks are frozen: they land in fixed GPU slots and the graphs replay (measured on
    # sdxl-lora-4gb); a full fine-tune's are stepped and copied home, not measured with graphs
    from difftrain.speed.auto import run_facts

    lora_facts = run_facts(resolve(recipe="sdxl-lora-4gb").config, steps=5000)
    assert not lora_facts.block_swap_trained and run_facts(resolve(recipe="sdxl-full-8gb").config, 5).block_swap_trained
    lora = decide(AUTO, COST, H100, lora_facts)
    assert lora.compile and lora.cuda_graphs and "no CUDA graphs" not in lora.reason
    assert graphs_possible(resolve(recipe="sdxl-lora-4gb").config)
    assert not graphs_possible(resolve(recipe="sdxl-full-8gb").config)
    # a family whose graphs measured no faster than compiled blocks alone (CogVideoX) never records them under auto,
    # so its plan holds no slots or pool for them
    flat = CompileCost(**{**COST.__dict__, "saved_s": COST.saved_s_no_graphs})
    assert graphs_possible(resolve(recipe="sdxl-lora-4gb").config, COST)
    assert not graphs_possible(resolve(recipe="sdxl-lora-4gb").config, flat)


def test_ddp_on_several_processes_records_cuda_graphs_beside_compiled_blocks():
    # DDP averages each gradient outside the recorded graphs (measured on SDXL full, 2 H200s); a sharded engine's
    # gathers inside the blocks keep them off
    ddp = decide(AUTO, COST, H100, RunFacts(steps=5000, processes=4))
    assert ddp.compile and ddp.cuda_graphs
    assert "no CUDA graphs" not in ddp.reason
    assert not decide(AUTO, COST, H100, RunFacts(steps=5000, processes=4, fsdp=True)).cuda_graphs
    assert not decide(AUTO, COST, H100, RunFacts(steps=5000, processes=4, deepspeed_stage=2)).cuda_graphs


def test_several_bucket_shapes_record_cuda_graphs_each_and_take_longer_to_compile():
    one = decide(AUTO, COST, H100, RunFacts(steps=5000, shapes=1))
    six = decide(AUTO, COST, H100, RunFacts(steps=5000, shapes=6))
    assert one.cuda_graphs and six.compile and six.cuda_graphs
    # the first step compiles the first shape; the reason counts every shape's recompile and recording
    assert six.compile_s == one.compile_s == COST.cold_s
    total = COST.cold_s + COST.dynamic_s + 5 * COST.shape_s + 6 * COST.record_s
    assert f"~{total:.0f} s compiling and recording" in six.reason
    # a run too short to pay back six recordings (~905 s of them here) compiles without graphs, and says so
    slow_rec = CompileCost(**{**COST.__dict__, "record_s": 100.0})
    c = decide(AUTO, slow_rec, H100, RunFacts(steps=1000, shapes=6))
    assert c.compile and not c.cuda_graphs
    assert "recording 6 bucket shapes would not pay back in 1000 steps" in c.reason
    # ... and a longer one records them
    assert decide(AUTO, slow_rec, H100, RunFacts(steps=3000, shapes=6)).cuda_graphs
    # at 1200 steps both pay and compiled alone gains more; graphs named by hand are not weighed away
    assert not decide(AUTO, slow_rec, H100, RunFacts(steps=1200, shapes=6)).cuda_graphs
    assert decide(SpeedConfig(cuda_graphs=True), slow_rec, H100, RunFacts(steps=1200, shapes=6)).cuda_graphs
    # a model whose graphs were measured to save nothing beyond compiling (CogVideoX) compiles without them
    flat = CompileCost(**{**COST.__dict__, "saved_s": COST.saved_s_no_graphs})
    c = decide(AUTO, flat, H100, RunFacts(steps=5000))
    assert c.compile and not c.cuda_graphs and "measured no faster than compiled alone" in c.reason


def test_explicit_options_override_auto():
    # false stays eager on the best platform, true compiles even where auto would not (a short run, the CPU)
    assert not decide(SpeedConfig(compile=False), COST, H100, LONG).compile
    assert decide(SpeedConfig(compile=True), COST, H100, RunFacts(steps=10)).compile
    cpu = decide(SpeedConfig(compile=True), COST, Platform(device="cpu"), LONG)
    assert cpu.compile and not cpu.cuda_graphs and "no CUDA graphs on cpu" in cpu.reason
    # auto compile with graphs switched off by hand
    c = decide(SpeedConfig(cuda_graphs=False), COST, H100, LONG)
    assert c.compile and not c.cuda_graphs and "speed.cuda_graphs: false" in c.reason
    # graphs asked for by hand: kept even past the shape limit
    c = decide(SpeedConfig(cuda_graphs=True), COST, H100, RunFacts(steps=5000, shapes=40))
    assert c.compile and c.cuda_graphs
    # ... and named as impossible where auto stays eager
    with pytest.raises(BackendUnavailable, match=r"speed\.compile auto stays eager here: the device is cpu"):
        decide(SpeedConfig(cuda_graphs=True), COST, Platform(device="cpu"), LONG)


def test_platform_facts_see_a_tracer_and_the_cpu():
    import torch

    p = platform_facts(torch.device("cpu"))
    assert p.device == "cpu" and p.capability is None and p.triton is None
    before = sys.gettrace()

    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        traced = platform_facts(torch.device("cpu"))
    finally:
        sys.settrace(before)
    assert traced.tracer is not None and (before is not None or p.tracer is None)


def test_platform_facts_read_torchdynamo_disable(monkeypatch):
    import torch

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert platform_facts(torch.device("cpu")).dynamo_disabled
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert not platform_facts(torch.device("cpu")).dynamo_disabled


def test_the_warm_marker_is_per_config_and_survives_damage(tmp_path):
    speed = SpeedConfig(compile_cache_dir=tmp_path / "cache")
    assert not is_warm(speed, "abc")
    mark_warm(speed, "abc")
    assert is_warm(speed, "abc") and not is_warm(speed, "def")
    mark_warm(speed, "def")
    assert is_warm(speed, "abc") and is_warm(speed, "def")
    (tmp_path / "cache" / "difftrain-compiled.json").write_text("{not json")
    assert not is_warm(speed, "abc")  # a damaged marker only makes the estimate cold
    mark_warm(speed, "abc")
    assert is_warm(speed, "abc")


def test_the_warm_key_follows_what_compiles():
    from difftrain.config.load import resolve
    from difftrain.speed.regional_compile import warm_key

    a = resolve(recipe="sdxl-lora-8gb").config
    b = resolve(recipe="sdxl-lora-8gb", sets=["train.learning_rate=3e-4"]).config
    c = resolve(recipe="sdxl-lora-8gb", sets=["lora.rank=32"]).config
    d = resolve(recipe="sdxl-lora-8gb", sets=["memory.weights.kind=fp8"]).config
    assert warm_key(a) == warm_key(b)  # the learning rate is not in the compiled graphs
    assert len({warm_key(a), warm_key(c), warm_key(d)}) == 3


def test_every_family_states_its_compile_cost():
    from difftrain.families.registry import get_family, names

    for name in names():
        cost = CompileCost(**get_family(name).compile_cost)
        assert cost.cold_s > cost.warm_s > 0 and cost.saved_s >= cost.saved_s_no_graphs > 0, name


def test_the_flux_fp8_recipe_compiles_without_cuda_graphs():
    """flux-lora-24gb stores the transformer in fp8: auto compiles it without graphs (with them the H100 step was
    10.2 s against 1.43 eager)."""
    from difftrain.config.load import resolve
    from difftrain.speed.auto import run_facts

    facts = run_facts(resolve(recipe="flux-lora-24gb").config, steps=2000)
    assert facts.fp8_weights and not run_facts(resolve(recipe="sd3-lora-8gb").config, steps=2000).fp8_weights
    c = decide(AUTO, COST, H100, facts)
    assert c.compile and not c.cuda_graphs and "fp8" in c.reason
