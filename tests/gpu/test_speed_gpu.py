"""The speed section on a CUDA GPU (tiny models): compiled and CUDA-graph runs train as eager ones do; torchao
float8 training runs a full fine-tune; the fused optimizer is chosen."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_cuda_config
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "extra",
    [
        {"speed.compile": "true", "memory.activations.kind": "checkpoint"},
        {"speed.compile": "true", "speed.cuda_graphs": "true"},
        # checkpointing inside the compiled blocks lets CUDA graphs replay them
        {"speed.compile": "true", "speed.cuda_graphs": "true", "memory.activations.kind": "checkpoint"},
        {"speed.attention": "flash", "speed.channels_last": "true"},
    ],
)
def test_speed_options_train_as_eager_on_cuda(tiny_model, dataset, tmp_path, extra):
    eager = tiny_cuda_config(
        tiny_model, dataset, tmp_path / "a", **{"memory.activations.kind": extra.get("memory.activations.kind", "none")}
    )
    precompute(eager)
    ref = train(eager)
    t = Trainer(tiny_cuda_config(tiny_model, dataset, tmp_path / "b", **extra))
    out = t.run()
    assert out.losses == pytest.approx(ref.losses, rel=3e-2, abs=3e-3)  # bf16 kernels differ in rounding
    assert t.parts.optimizer.defaults.get("fused") is True  # speed.optimizer_kernels auto on CUDA


def test_fp8_weights_compiled_with_cuda_graphs_train_as_eager(tiny_model, dataset, tmp_path):
    """The 4 GiB tier's way at full speed: fp8 frozen weights (custom ops under compile), checkpointing inside the
    compiled blocks, CUDA graphs: the losses of eager fp8 + checkpointing."""
    common = {"memory.weights.kind": "fp8", "memory.activations.kind": "checkpoint"}
    eager = tiny_cuda_config(tiny_model, dataset, tmp_path / "a", **common)
    precompute(eager)
    ref = train(eager)
    out = train(
        tiny_cuda_config(
            tiny_model, dataset, tmp_path / "b", **common, **{"speed.compile": "true", "speed.cuda_graphs": "true"}
        )
    )
    assert out.losses == pytest.approx(ref.losses, rel=3e-2, abs=3e-3)


def test_float8_full_finetune_trains(tiny_model, dataset, tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    cfg = tiny_cuda_config(
        tiny_model,
        dataset,
        tmp_path / "a",
        **{
            "train.method": "full",
            "speed.float8": "true",
            "speed.compile": "true",
            "train.learning_rate": 1e-5,
            "save.formats": "[]",
        },
    )
    precompute(cfg)
    t = Trainer(cfg)
    out = t.run()
    from torchao.float8.float8_linear import Float8Linear

    n = sum(isinstance(m, Float8Linear) for m in t.parts.comps["unet"].modules())
    assert n > 10 and all(x == x for x in out.losses)


def test_speed_auto_compiles_a_long_run_on_cuda_and_trains_as_eager(tiny_model, dataset, tmp_path):
    """The default (speed auto) on a CUDA GPU, weighed as a 5,000-step run: compiled with CUDA graphs over the
    dataset's several bucket shapes (each shape recorded on its second call, then replayed), the losses of the
    eager run; a 12-step run stays eager."""
    from difftrain.trainers.loop import Hooks

    eager_cfg = tiny_cuda_config(tiny_model, dataset, tmp_path / "a", **{"train.max_steps": 12})
    precompute(eager_cfg)
    short = Trainer(eager_cfg)
    ref = short.run()
    assert not short.speed.compile and "steps would save" in short.speed.reason
    t = Trainer(
        tiny_cuda_config(tiny_model, dataset, tmp_path / "b", **{"train.max_steps": 12}),
        hooks=Hooks(planned_steps=5000),
    )
    out = t.run()
    assert len(set(t.feed.bucket_keys())) > 1  # shapes change between steps
    assert t.speed.compile and t.speed.cuda_graphs, t.speed.reason
    assert out.losses == pytest.approx(ref.losses, rel=3e-2, abs=3e-3)


def test_fused_lora_and_channels_last_by_default_train_as_peft_eager(tiny_model, dataset, tmp_path):
    """What speed auto gives a long compiled SDXL LoRA on CUDA since channels-last auto and the fused LoRA kernel:
    both on, every LoRA Linear of the UNet fused, compiled with CUDA graphs; the losses of peft's eager run in the
    default layout."""
    from difftrain.trainers.loop import Hooks

    eager = tiny_cuda_config(
        tiny_model, dataset, tmp_path / "a", **{"speed.lora_kernel": "peft", "speed.channels_last": "false"}
    )
    precompute(eager)
    ref = train(eager)
    t = Trainer(tiny_cuda_config(tiny_model, dataset, tmp_path / "b"), hooks=Hooks(planned_steps=5000))
    out = t.run()
    sp = t.cfg.speed
    assert sp.compile and sp.cuda_graphs and sp.channels_last is True and sp.lora_kernel == "fused", sp
    from peft.tuners.lora.layer import Linear

    lora = [m for m in t.parts.comps["unet"].modules() if isinstance(m, Linear)]
    assert lora and all(type(m).__name__ == "FusedLoraLinear" for m in lora)
    assert out.losses == pytest.approx(ref.losses, rel=3e-2, abs=3e-3)


def test_speed_auto_records_graphs_under_lora_block_swap(tiny_model, dataset, tmp_path):
    """LoRA's block swap with speed auto on a CUDA GPU: each block's forward compiled, the swap hooks eager around
    it, CUDA graphs recorded with the swapped blocks in fixed slots; the losses of the eager block-swap run."""
    from difftrain.trainers.loop import Hooks

    common = {
        "memory.offload": "{kind: block_swap, blocks_to_swap: 4}",
        "memory.activations.kind": "checkpoint",
    }
    eager_cfg = tiny_cuda_config(tiny_model, dataset, tmp_path / "a", **common, **{"speed.compile": "false"})
    precompute(eager_cfg)
    ref = train(eager_cfg)
    t = Trainer(tiny_cuda_config(tiny_model, dataset, tmp_path / "b", **common), hooks=Hooks(planned_steps=50000))
    out = t.run()
    assert t.speed.compile and t.speed.cuda_graphs, t.speed.reason
    assert len(t.parts.block_swap.slots) == 3 and t.parts.block_swap.slot_conflicts == 0
    assert out.losses == pytest.approx(ref.losses, rel=3e-2, abs=3e-3)


def test_block_swap_with_cuda_graphs_named_replays_from_fixed_slots_and_trains_as_eager(tiny_model, dataset, tmp_path):
    """speed.cuda_graphs: true beside block swap: the swapped blocks land in fixed GPU slots and the graphs
    recorded around them train to the losses of the eager block-swap run (their speed: benchmarks/fast_default.py,
    case sdxl-lora-4gb-graphs)."""
    common = {
        "memory.offload": "{kind: block_swap, blocks_to_swap: 4}",
        "memory.activations.kind": "checkpoint",
        "train.max_steps": 10,
    }
    eager_cfg = tiny_cuda_config(tiny_model, dataset, tmp_path / "a", **common, **{"speed.compile": "false"})
    precompute(eager_cfg)
    ref = train(eager_cfg)
    t = Trainer(
        tiny_cuda_config(
            tiny_model, dataset, tmp_path / "b", **common, **{"speed.compile": "true", "speed.cuda_graphs": "true"}
        )
    )
    out = t.run()
    swap = t.parts.block_swap
    assert t.speed.cuda_graphs and len(swap.slots) == 3 and swap.slot_conflicts == 0
    assert all(b.device.type == "cuda" for b in swap.slots)
    assert out.losses == pytest.approx(ref.losses, rel=3e-2, abs=3e-3)


def test_auto_attention_leaves_cudnn_out_for_a_family_that_asks():
    """Flux's shapes failed in cuDNN's attention backward (H100, torch 2.11 + CUDA 13): speed.attention auto lets
    torch choose among the other kernels for it, and attention still runs forward and backward."""
    from difftrain.config.schema import SpeedConfig
    from difftrain.families.registry import get_family
    from difftrain.speed.attention import attention_context

    dev = torch.device("cuda")
    assert get_family("flux").avoid_cudnn_attention and not get_family("sd3").avoid_cudnn_attention
    q = torch.randn(1, 24, 4608, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)  # Flux at 1024 px
    with attention_context(SpeedConfig(attention="auto"), dev, avoid_cudnn=True):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
