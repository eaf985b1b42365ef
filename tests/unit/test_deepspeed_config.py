"""DeepSpeed ZeRO configured from the pydantic config: the generated JSON, the user file merged over it,
and the pairs the validator refuses (the engine itself runs on the GPU: tests/gpu)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from difftrain.config.load import resolve
from difftrain.errors import ConfigError
from difftrain.memory.deepspeed_engine import ds_config


def _cfg(*sets):
    return resolve(recipe="sdxl-full", sets=["memory.optimizer.kind=adamw", *sets]).config


def test_zero2_with_optimizer_offload_from_the_config():
    c = ds_config(
        _cfg(
            "memory.engine={kind: deepspeed}",
            "train.batch_size=2",
            "train.grad_accum=4",
            "train.max_grad_norm=0.5",
            "train.learning_rate=3e-6",
        )
    )
    z = c["zero_optimization"]
    assert (
        z["stage"] == 2 and z["offload_optimizer"] == {"device": "cpu", "pin_memory": True} and "offload_param" not in z
    )
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["gradient_clipping"]) == (
        2,
        4,
        0.5,
    )
    assert c["bf16"] == {"enabled": True}
    assert c["optimizer"]["type"] == "AdamW" and c["optimizer"]["params"]["lr"] == 3e-6


def test_zero3_parameter_offload_and_no_optimizer_block_without_offload():
    c = ds_config(
        _cfg("memory.engine={kind: deepspeed, stage: 3, offload_param_device: cpu, offload_optimizer_device: none}")
    )
    z = c["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and "offload_optimizer" not in z
    assert "optimizer" not in c  # a torch AdamW is handed to DeepSpeed instead (no CUDA compiler needed)


def test_a_deepspeed_json_can_still_be_passed_and_wins(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 123, "stage": 3}, "steps_per_print": 5}))
    c = ds_config(_cfg(f"memory.engine={{kind: deepspeed, config_file: {f}}}"))
    assert c["zero_optimization"]["reduce_bucket_size"] == 123 and c["zero_optimization"]["stage"] == 3
    assert c["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # generated keys the file left alone stay
    assert c["steps_per_print"] == 5
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ds_config(_cfg(f"memory.engine={{kind: deepspeed, config_file: {f}}}"))


def test_zero3_takes_the_familys_measured_settings_unless_told_not_to(tmp_path):
    """SDXL's ZeRO-3 tuning (families/sdxl.py zero3_settings, measured 1.8x faster on 2 H100s) lands in the
    generated config; family_settings false gives DeepSpeed's own; ZeRO-2 has nothing to tune; a user's file wins."""
    from difftrain.families.registry import get_family

    sdxl = get_family("sdxl").zero3_settings
    z3 = "memory.engine={kind: deepspeed, stage: 3, offload_optimizer_device: none"
    assert "leaf_module" not in ds_config(_cfg(z3 + "}"))["zero_optimization"]  # nothing handed in: DeepSpeed's own
    tuned = ds_config(_cfg(z3 + "}"), sdxl)["zero_optimization"]
    assert tuned["leaf_module"] == {"classes": ["Transformer2DModel", "ResnetBlock2D"]}
    assert tuned["stage3_param_persistence_threshold"] == 1_000_000 and tuned["stage3_max_live_parameters"] == 3e9
    plain = ds_config(_cfg(z3 + ", family_settings: false}"), sdxl)["zero_optimization"]
    assert tuned["memory_efficient_linear"] is False  # torch's own linear: DeepSpeed's is Python in backward
    assert "leaf_module" not in plain and plain["stage3_param_persistence_threshold"] == 1e5
    assert "memory_efficient_linear" not in plain
    assert "leaf_module" not in ds_config(_cfg("memory.engine={kind: deepspeed, stage: 2}"), sdxl)["zero_optimization"]
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 7}}))
    mine = ds_config(_cfg(z3 + f", config_file: {f}}}"), sdxl)["zero_optimization"]
    assert mine["stage3_param_persistence_threshold"] == 7 and "leaf_module" in mine
    # a family with nothing measured gets DeepSpeed's own settings
    assert not get_family("flux").zero3_settings and not get_family("cogvideox").zero3_settings
    # the leaf classes are SDXL's UNet's own (DeepSpeed matches them by class name): built on meta, no memory
    import torch
    from diffusers import UNet2DConditionModel

    import difftrain.families as fams

    conf = UNet2DConditionModel.load_config(str(Path(fams.__file__).parent / "configs" / "sdxl-base-1.0" / "unet"))
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(conf)
    assert set(tuned["leaf_module"]["classes"]) <= {type(m).__name__ for m in unet.modules()}


@pytest.mark.parametrize(
    "sets,needle",
    [
        (("memory.engine={kind: deepspeed, offload_param_device: cpu}",), "needs ZeRO stage 3"),
        (("memory.engine={kind: deepspeed}", "memory.optimizer.kind=adamw8bit"), "brings its own"),
        (
            ("memory.engine={kind: deepspeed}", "memory.fused_backward=true", "train.max_grad_norm=null"),
            "steps the optimizer itself",
        ),
        (("memory.engine={kind: deepspeed}", "memory.offload={kind: block_swap, blocks_to_swap: 4}"), "pick one"),
        (
            ("memory.engine={kind: deepspeed}", "train.method=lora", "memory.weights={kind: fp8}"),
            "casts every parameter",
        ),
        (
            ("memory.engine={kind: deepspeed}", "train.mixed_precision=no", "memory.weights.kind=fp32"),
            "mixed_precision bf16",
        ),
        (("memory.engine={kind: deepspeed}", "full.train_text_encoder_1=true"), "denoiser only"),
        (("memory.engine={kind: deepspeed, stage: 3}", "ema.enabled=true"), "partitioned"),
    ],
)
def test_incompatible_pairs_name_both_options(sets, needle):
    with pytest.raises(ConfigError) as e:
        _cfg(*sets)
    assert needle in str(e.value)


def test_without_deepspeed_installed_the_message_says_how(monkeypatch):
    import builtins

    from difftrain.errors import BackendUnavailable
    from difftrain.memory.deepspeed_engine import initialize

    real = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (_ for _ in ()).throw(ImportError()) if name == "deepspeed" else real(name, *a, **k),
    )
    with pytest.raises(BackendUnavailable) as e:
        initialize(_cfg("memory.engine={kind: deepspeed}"), None, [])
    assert "no-build-isolation" in e.value.hint


def test_deepcompile_in_a_config_file_compiles_the_engine(monkeypatch, tmp_path):
    """A config_file asking for DeepSpeed's DeepCompile gets the engine's compile() (the key alone does nothing in
    DeepSpeed); without it the engine is left as built. DeepSpeed is faked: it runs on CUDA only."""
    import types

    import torch

    from difftrain.memory import deepspeed_engine

    calls = []

    class Engine:
        def compile(self):
            calls.append(("compile", sys.getrecursionlimit()))

    fake = types.SimpleNamespace(initialize=lambda **kw: (calls.append(kw["config"]) or Engine(), None, None, None))
    monkeypatch.setattr(deepspeed_engine, "_deepspeed", lambda: fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    limit = sys.getrecursionlimit()
    module = torch.nn.Linear(2, 2)
    z3 = "memory.engine={kind: deepspeed, stage: 3, offload_optimizer_device: none}"
    deepspeed_engine.initialize(_cfg(z3), module, list(module.parameters()))
    assert calls and not [c for c in calls if isinstance(c, tuple)] and os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert sys.getrecursionlimit() == limit
    f = tmp_path / "dc.json"
    f.write_text(json.dumps({"compile": {"deepcompile": True}}))
    calls.clear()
    deepspeed_engine.initialize(_cfg(z3, f"memory.engine.config_file={f}"), module, list(module.parameters()))
    try:
        # compiled with a recursion limit deep enough for a whole UNet's graph (SDXL overran Python's default)
        assert calls[0]["compile"] == {"deepcompile": True} and calls[-1] == ("compile", 200_000)
    finally:
        sys.setrecursionlimit(limit)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"  # what DeepSpeed's op builder can read


def test_the_arch_list_deepspeeds_op_builder_reads_drops_arch_specific_suffixes():
    from difftrain.memory.deepspeed_engine import arch_list_for_deepspeed

    assert arch_list_for_deepspeed({"TORCH_CUDA_ARCH_LIST": "9.0a"}) == {"TORCH_CUDA_ARCH_LIST": "9.0"}
    assert arch_list_for_deepspeed({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a+PTX;10.0f"}) == {
        "TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX;10.0"
    }
    assert arch_list_for_deepspeed({"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}) == {}
    assert arch_list_for_deepspeed({}) == {}
