"""Behaviour that needs a CUDA GPU (skipped elsewhere): run on the lent GPU with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train

pytestmark = pytest.mark.gpu


def _cfg(tiny_model, data, out, **extra):
    base = {"train.device": "cuda", "precompute.device": "cuda"}
    base.update(extra)
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, data, out, **base)).config


def test_full_finetune_with_bitsandbytes_adamw8bit(tiny_model, dataset, tmp_path):
    import bitsandbytes as bnb

    from difftrain.trainers.loop import Trainer

    cfg = _cfg(
        tiny_model,
        dataset,
        tmp_path,
        **{
            "train.method": "full",
            "memory.optimizer.kind": "adamw8bit",
            "memory.weights.kind": "bf16",
            "train.mixed_precision": "bf16",
            "train.max_steps": 30,
            "train.batch_size": 4,
            "train.learning_rate": 1e-3,
        },
    )
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    assert isinstance(t.parts.optimizer, bnb.optim.AdamW8bit)
    assert sum(r.losses[-5:]) / 5 < 0.85 * sum(r.losses[:5]) / 5
    # 8-bit state: a quarter of AdamW's fp32 moments, roughly
    state_bytes = sum(
        v.numel() * v.element_size() for s in t.parts.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    param_count = sum(p.numel() for p in t.parts.params)
    assert state_bytes < 3 * param_count  # AdamW fp32 would be 8 bytes per parameter


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bitsandbytes_adamw8bit_without_its_syncs_steps_bit_for_bit_as_its_own(monkeypatch, grad_dtype):
    """make_optimizer's bitsandbytes AdamW8bit (its per-parameter torch.cuda.synchronize left out: memory/optimizers.py
    without_syncs) moves every weight bit for bit as bitsandbytes' own class, with no synchronisation in its step;
    on a side stream, or paged, it keeps bitsandbytes' waits."""
    import bitsandbytes as bnb

    from difftrain.config.schema import MemoryConfig
    from difftrain.memory.optimizers import make_optimizer

    shapes = [(3072, 32), (32, 3072), (4096,), (7, 5)]  # LoRA-like, one 1-D, one under bitsandbytes' 4096 values

    def params():
        g = torch.Generator(device="cuda").manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(grad_dtype)) for s in shapes]

    waits = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (waits.append(1), real(*a, **k))[1])
    mem = MemoryConfig.model_validate({"optimizer": {"kind": "adamw8bit"}})
    ours, theirs = params(), params()
    o1 = make_optimizer(mem, [{"params": ours}], 1e-3)
    o2 = bnb.optim.AdamW8bit([{"params": theirs}], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    assert type(o1).__name__ == "AdamW8bit" and isinstance(o1, bnb.optim.AdamW8bit)
    assert o1.defaults["weight_decay"] == o2.defaults["weight_decay"] and o1.defaults["eps"] == o2.defaults["eps"]
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(6):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, device="cuda", generator=g).to(grad_dtype)
            b.grad = a.grad.clone()
        n = len(waits)
        o1.step()
        assert len(waits) == n, f"step {step}: our step waited for the device"
        o2.step()
        assert len(waits) > n  # bitsandbytes' own class waits (what is left out is really there)
    real()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        n = len(waits)
        o1.step()
        assert len(waits) > n  # bitsandbytes launches on the default stream: on another, its waits are kept
    torch.cuda.current_stream().wait_stream(side)
    paged = make_optimizer(
        MemoryConfig.model_validate({"optimizer": {"kind": "adamw8bit", "paged": True}}), [{"params": params()}], 1e-3
    )
    for p in paged.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    n = len(waits)
    paged.step()
    assert len(waits) > n


def test_batches_are_stacked_into_pinned_memory_and_reach_the_gpu_unchanged():
    """The feed's stack straight into pinned memory (trainers/feed.py stack_to_device, families/base.py host_stack)
    and the families' caption states collated into it (FLUX.2's stack, the language-model families' zero padding)
    give the tensors torch.stack and zero padding give, on the GPU; without speed.pin_memory nothing is pinned."""
    from types import SimpleNamespace

    from difftrain.families.flux2 import Flux2
    from difftrain.families.zimage import ZImage
    from difftrain.trainers.feed import Feed

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 8, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    for pinned in (True, False):
        speed = SimpleNamespace(pin_memory=pinned)
        feed = SimpleNamespace(device=torch.device("cuda"), cfg=SimpleNamespace(speed=speed), pins=pinned)
        feed.to_device = lambda x, f=feed: Feed.to_device(f, x)  # type: ignore[arg-type]
        got = Feed.stack_to_device(feed, xs)  # type: ignore[arg-type]
        assert got.device.type == "cuda" and torch.equal(got.cpu(), torch.stack(xs))
    states = [torch.randn(n, 32, generator=g) for n in (5, 9)]
    out = ZImage().collate_text("llm", [{"prompt_embeds": s} for s in states], pin=True)
    padded = out["prompt_embeds"]
    assert padded.is_pinned() and padded.shape == (2, 9, 32)
    assert torch.equal(padded[0, :5], states[0]) and not padded[0, 5:].any() and torch.equal(padded[1], states[1])
    assert out["prompt_length"].tolist() == [5, 9]
    assert not ZImage().collate_text("llm", [{"prompt_embeds": s} for s in states])["prompt_embeds"].is_pinned()
    rows = [{"prompt_embeds": torch.randn(512, 24, generator=g)} for _ in range(2)]
    stacked = Flux2().collate_text("llm", rows, pin=True)["prompt_embeds"]
    assert stacked.is_pinned() and torch.equal(stacked, torch.stack([r["prompt_embeds"] for r in rows]))


def test_bf16_lora_on_cuda_tracks_fp32(tiny_model, dataset, tmp_path):
    ref = _cfg(
        tiny_model,
        dataset,
        tmp_path / "a",
        **{"train.max_steps": 6, "memory.weights.kind": "fp32", "train.mixed_precision": "no"},
    )
    precompute(ref)
    a = train(ref).losses
    b = train(
        _cfg(
            tiny_model,
            dataset,
            tmp_path / "b",
            **{
                "train.max_steps": 6,
                "memory.weights.kind": "bf16",
                "train.mixed_precision": "bf16",
                "memory.activations.kind": "checkpoint",
                "data.cache_dir": tmp_path / "a" / "cache",
            },
        )
    ).losses
    assert b == pytest.approx(a, rel=0.05)


def test_single_file_loads_straight_to_cuda(tiny_model, tmp_path):
    from difftrain.config.schema import ModelConfig
    from difftrain.families.sdxl.family import PARTS, SDXL

    comps = SDXL().load(ModelConfig(path=tiny_model), PARTS)
    f = SDXL().save_single_file(
        {p: comps[p].state_dict() for p in PARTS}, SDXL.module_configs(comps), tmp_path / "m.safetensors"
    )
    back = SDXL().load(
        ModelConfig(path=f, config="sdxl-tiny", tokenizer_path=tiny_model),
        ["unet"],
        dtype=torch.bfloat16,
        device="cuda",
    )
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in back["unet"].parameters())


@pytest.mark.parametrize(
    "opt",
    [
        "{kind: adamw8bit, paged: true}",
        "{kind: adamw8bit, backend: torchao}",
        "{kind: adamw4bit}",
        "{kind: cpu_offload}",
        "{kind: cpu_offload, offload_gradients: true}",
    ],
)
def test_optimizers_on_cuda(tiny_model, dataset, tmp_path, opt):
    cfg = _cfg(
        tiny_model,
        dataset,
        tmp_path,
        **{
            "train.method": "full",
            "memory.optimizer": opt,
            "memory.weights.kind": "bf16",
            "train.mixed_precision": "bf16",
            "train.max_steps": 20,
            "train.batch_size": 4,
            "train.learning_rate": 1e-3,
            "train.max_grad_norm": "null",
            "train.lr_scheduler": "cosine",
            "train.warmup_steps": 2,
        },
    )
    precompute(cfg)
    r = train(cfg)
    assert all(torch.isfinite(torch.tensor(r.losses)))
    assert sum(r.losses[-5:]) / 5 < 0.9 * sum(r.losses[:5]) / 5


def test_fp8_lora_on_cuda_saves_memory_and_tracks_bf16(tiny_model, dataset, tmp_path):
    from difftrain.trainers.loop import Trainer

    common = {"train.max_steps": 6, "train.mixed_precision": "bf16"}
    a = _cfg(tiny_model, dataset, tmp_path / "a", **common, **{"memory.weights.kind": "bf16"})
    precompute(a)
    ta = Trainer(a)
    ra = ta.run()
    b = _cfg(
        tiny_model,
        dataset,
        tmp_path / "b",
        **common,
        **{"memory.weights": "{kind: fp8}", "data.cache_dir": tmp_path / "a" / "cache"},
    )
    tb = Trainer(b)
    rb = tb.run()
    assert rb.losses == pytest.approx(ra.losses, rel=0.05)
    bytes_of = lambda t: sum(
        p.numel() * p.element_size() for p in t.parts.comps["unet"].parameters() if not p.requires_grad
    )
    assert bytes_of(tb) < 0.6 * bytes_of(ta)
    assert all(p.is_cuda for p in tb.parts.comps["unet"].parameters())


@pytest.mark.parametrize("kind,tol", [("nf4", 0.1), ("int8", 0.1)])
def test_bitsandbytes_base_weights_lora_tracks_bf16(tiny_model, dataset, tmp_path, kind, tol):
    import bitsandbytes as bnb

    from difftrain.trainers.loop import Trainer

    common = {
        "train.max_steps": 8,
        "train.mixed_precision": "bf16",
        "lora.targets": "[to_q, to_k, to_v, to_out.0, proj_in, proj_out]",
    }
    a = _cfg(tiny_model, dataset, tmp_path / "a", **common, **{"memory.weights.kind": "bf16"})
    precompute(a)
    ra = train(a)
    b = _cfg(
        tiny_model,
        dataset,
        tmp_path / "b",
        **common,
        **{"memory.weights": f"{{kind: {kind}}}", "data.cache_dir": tmp_path / "a" / "cache"},
    )
    t = Trainer(b)
    rb = t.run()
    cls = bnb.nn.Linear4bit if kind == "nf4" else bnb.nn.Linear8bitLt
    assert any(isinstance(m, cls) for m in t.parts.comps["unet"].modules())
    assert rb.losses == pytest.approx(ra.losses, rel=tol)
    from safetensors.torch import load_file

    assert load_file(rb.lora_path).keys() == load_file(ra.lora_path).keys()  # the same LoRA layout, loadable as before


@pytest.mark.parametrize("fixed", [False, True], ids=["fresh", "fixed-slots"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_block_swap_on_cuda_streams_equals_plain(tiny_model, lora, fixed):
    """Pinned host copies, side-stream prefetch: gradients equal the plain run's, and swapped weights stay home."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_block_swap import _unet

    from difftrain.families.sdxl import SDXL
    from difftrain.memory.block_swap import BlockSwap

    def step(unet):
        g = torch.Generator("cuda").manual_seed(0)
        c = unet.config
        x = torch.randn(2, c.in_channels, 32, 32, generator=g, device="cuda")
        emb = torch.randn(2, 77, c.cross_attention_dim, generator=g, device="cuda")
        n_time = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        added = {
            "text_embeds": torch.randn(2, n_time, generator=g, device="cuda"),
            "time_ids": torch.full((2, 6), 32.0, device="cuda"),
        }
        unet(x, torch.tensor([10, 500], device="cuda"), encoder_hidden_states=emb, added_cond_kwargs=added).sample.pow(
            2
        ).mean().backward()
        return {n: p.grad.detach().cpu() for n, p in unet.named_parameters() if p.grad is not None}

    ref = _unet(tiny_model, lora).cuda()
    ref.enable_gradient_checkpointing()
    want = step(ref)
    unet = _unet(tiny_model, lora)
    unet.enable_gradient_checkpointing()
    units = SDXL().swap_blocks(unet)
    swap = BlockSwap(
        unet, units, blocks_to_swap=len(units), device=torch.device("cuda"), swap_trainable=not lora, fixed=fixed
    )
    assert all(p.is_pinned() for i in swap.swapped for p in swap.params[i])
    got = step(unet)
    if fixed:  # a second step through the same slots (each fetch waits for the slot's last user's kernels)
        unet.zero_grad(set_to_none=True)
        swap.end_backward()
        got = step(unet)
        assert swap.slot_conflicts == 0
    swap.end_backward()
    torch.cuda.synchronize()
    assert got.keys() == want.keys() and got
    for n in got:  # cuDNN's backward kernels are not bit-deterministic between two modules: fp32 tolerances
        torch.testing.assert_close(got[n], want[n])
    assert swap.peak_resident <= 2 and not swap.resident
    assert all(p.device.type == "cpu" for i in swap.swapped for p in swap.params[i])


def test_train_with_block_swap_and_cpu_offload_full(tiny_model, dataset, tmp_path):
    from difftrain.trainers.loop import Trainer

    cfg = _cfg(
        tiny_model,
        dataset,
        tmp_path,
        **{
            "train.method": "full",
            "memory.weights.kind": "bf16",
            "train.mixed_precision": "bf16",
            "train.max_grad_norm": "null",
            "memory.optimizer": "{kind: cpu_offload, offload_gradients: true}",
            "train.max_steps": 20,
            "train.batch_size": 4,
            "train.learning_rate": 1e-3,
            "memory.offload": "{kind: block_swap, blocks_to_swap: 20}",
            "save.formats": "[]",
            "memory.activations.kind": "checkpoint",
        },
    )
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    assert sum(r.losses[-5:]) / 5 < 0.85 * sum(r.losses[:5]) / 5  # the swapped weights do learn
    assert all(p.device.type == "cpu" for i in t.parts.block_swap.swapped for p in t.parts.block_swap.params[i])


def test_block_swap_with_fused_adafactor_matches_the_resident_run_and_resumes(tiny_model, dataset, tmp_path):
    """Full fine-tune, block swap + fused backward + Adafactor (sdxl-full-8gb's plan): the swapped units are stepped on
    the GPU and written home on the side stream; the run tracks the one without block swap, its host copies are
    pinned slab views, and a resume (the Adafactor state loaded beside host-resident weights) continues it."""
    from difftrain.trainers.loop import Trainer

    sets = {
        "train.method": "full",
        "memory.weights.kind": "bf16",
        "train.mixed_precision": "bf16",
        "train.max_grad_norm": "null",
        "memory.optimizer.kind": "adafactor",
        "memory.fused_backward": "true",
        "train.max_steps": 8,
        "train.batch_size": 4,
        "train.learning_rate": 1e-3,
        "save.formats": "[]",
        "memory.activations.kind": "checkpoint",
        "train.checkpoint_every": 4,
    }
    swap = {"memory.offload": "{kind: block_swap, blocks_to_swap: 20}"}
    ref_cfg = _cfg(tiny_model, dataset, tmp_path / "ref", **sets)
    precompute(ref_cfg)
    ref = Trainer(ref_cfg)
    want = ref.run()
    cfg = _cfg(tiny_model, dataset, tmp_path / "swap", **sets, **swap)
    precompute(cfg)
    t = Trainer(cfg)
    got = t.run()
    bs = t.parts.block_swap
    assert bs.write_back and all(p.is_pinned() and p.device.type == "cpu" for i in bs.swapped for p in bs.params[i])
    assert got.losses == pytest.approx(want.losses, rel=0.02)  # cuDNN's backward is not bit-deterministic
    w0 = dict(ref.parts.comps["unet"].named_parameters())
    diffs = [
        (p.detach().float().cpu() - w0[n].detach().float().cpu()).abs().max().item()
        for n, p in t.parts.comps["unet"].named_parameters()
    ]
    assert max(diffs) < 0.05
    resumed_cfg = _cfg(tiny_model, dataset, tmp_path / "swap2", **sets, **swap)
    precompute(resumed_cfg)
    train(resumed_cfg, stop_at=4)
    r = train(resumed_cfg, resume="latest")
    assert r.losses == pytest.approx(got.losses[4:], rel=0.02)


def test_pinned_limit_falls_back_to_pageable_and_still_learns(tiny_model, dataset, tmp_path, capsys):
    """memory.pinned_limit_gib below what block swap and the CPU optimizer pin: the rest is pageable, one warning,
    and the run trains as before (issue 23, Windows-like limits)."""
    from difftrain.memory import pinned
    from difftrain.trainers.loop import Trainer

    sets = {
        "train.method": "full",
        "memory.weights.kind": "bf16",
        "train.mixed_precision": "bf16",
        "train.max_grad_norm": "null",
        "memory.optimizer": "{kind: cpu_offload, offload_gradients: true}",
        "train.max_steps": 20,
        "train.batch_size": 4,
        "train.learning_rate": 1e-3,
        "memory.offload": "{kind: block_swap, blocks_to_swap: 20}",
        "save.formats": "[]",
        "memory.activations.kind": "checkpoint",
        "memory.pinned_limit_gib": 0.002,  # 2 MiB: part of the swapped blocks (~3 MB), none of the optimizer
    }
    cfg = _cfg(tiny_model, dataset, tmp_path, **sets)
    precompute(cfg)
    capsys.readouterr()
    t = Trainer(cfg)
    r = t.run()
    b = pinned.budget()
    assert 0 < b.pinned_bytes <= 0.002 * 2**30 < b.pinned_bytes + b.pageable_bytes
    assert capsys.readouterr().err.count("pinned_limit_gib") == 1
    home = [h for hs in t.parts.block_swap.home.values() for h in hs]
    assert any(h.is_pinned() for h in home) and not all(h.is_pinned() for h in home)
    assert sum(r.losses[-5:]) / 5 < 0.85 * sum(r.losses[:5]) / 5


def _ds(tiny_model, dataset, out, engine: str, **extra):
    sets = {
        "memory.weights.kind": "bf16",
        "train.mixed_precision": "bf16",
        "memory.engine": engine,
        "train.batch_size": 4,
        "train.learning_rate": 3e-3,
        "train.checkpoint_every": 1000,
    }
    sets.update(extra)
    return _cfg(tiny_model, dataset, out, **sets)


def test_deepspeed_zero2_lora_learns_and_exports(tiny_model, dataset, tmp_path):
    from difftrain.trainers.loop import Trainer

    cfg = _ds(
        tiny_model,
        dataset,
        tmp_path,
        "{kind: deepspeed, stage: 2, offload_optimizer_device: cpu}",
        **{"train.max_steps": 30},
    )
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    assert t.parts.engine is not None and t.parts.engine.zero_optimization_stage() == 2
    assert type(t.parts.optimizer).__name__ == "DeepSpeedCPUAdam"
    assert sum(r.losses[-5:]) / 5 < 0.85 * sum(r.losses[:5]) / 5
    from safetensors.torch import load_file

    assert any("lora" in k for k in load_file(r.lora_path))


def test_deepspeed_zero2_resumes_exactly(tiny_model, dataset, tmp_path):
    eng = "{kind: deepspeed, stage: 2, offload_optimizer_device: none}"
    a = _ds(tiny_model, dataset, tmp_path / "a", eng, **{"train.max_steps": 6, "data.cache_dir": tmp_path / "cache"})
    precompute(a)
    ref = train(a)
    b = _ds(
        tiny_model,
        dataset,
        tmp_path / "b",
        eng,
        **{
            "train.max_steps": 6,
            "train.checkpoint_every": 3,
            "data.cache_dir": tmp_path / "cache",
            "model.allow_pickle": "true",
        },
    )
    train(b, stop_at=3)
    assert train(b, resume="latest").losses == pytest.approx(ref.losses[3:], rel=1e-4)


def test_deepspeed_zero3_param_offload_full_finetune(tiny_model, dataset, tmp_path):
    from difftrain.trainers.loop import Trainer

    cfg = _ds(
        tiny_model,
        dataset,
        tmp_path,
        "{kind: deepspeed, stage: 3, offload_optimizer_device: cpu, offload_param_device: cpu}",
        **{"train.method": "full", "train.max_steps": 20, "train.learning_rate": 1e-3, "save.formats": "[single_file]"},
    )
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    assert t.parts.engine.zero_optimization_stage() == 3
    assert sum(r.losses[-5:]) / 5 < 0.9 * sum(r.losses[:5]) / 5
    assert r.saved and r.saved[0].stat().st_size > 1000


def test_sd3_lora_with_8bit_adam_and_int8_t5_precompute(dataset, tmp_path):
    import bitsandbytes as bnb

    from difftrain.families.sd3 import SD3
    from difftrain.trainers.loop import Trainer

    model = SD3().build_tiny(tmp_path / "tiny-sd3")
    sets = tiny_sets(
        model,
        dataset,
        tmp_path,
        **{
            "train.device": "cuda",
            "precompute.device": "cuda",
            "text_encoders.t5.precision": "int8",
            "memory.optimizer.kind": "adamw8bit",
            "memory.weights.kind": "bf16",
            "train.mixed_precision": "bf16",
            "train.max_steps": 20,
            "train.batch_size": 4,
            "train.learning_rate": 3e-3,
            "memory.activations.kind": "checkpoint",
        },
    )
    cfg = resolve(recipe="tiny-sd3-lora", sets=sets).config
    r = precompute(cfg)
    assert r.texts_encoded == 24
    t = Trainer(cfg)
    res = t.run()
    assert isinstance(t.parts.optimizer, bnb.optim.AdamW8bit)
    assert all(torch.isfinite(torch.tensor(res.losses)))
    assert sum(res.losses[-5:]) / 5 < sum(res.losses[:5]) / 5


def test_deepspeed_zero2_loss_tracks_the_plain_run(tiny_model, dataset, tmp_path):
    """Pinned-loss check for the engine: ZeRO-2 (bf16 module weights, fp32 master copy) against plain AdamW."""
    common = {
        "memory.weights.kind": "bf16",
        "train.mixed_precision": "bf16",
        "train.batch_size": 4,
        "train.learning_rate": 1e-3,
        "train.max_steps": 12,
        "train.checkpoint_every": 1000,
        "data.cache_dir": tmp_path / "cache",
    }
    plain = _cfg(tiny_model, dataset, tmp_path / "plain", **common)
    precompute(plain)
    ref = train(plain).losses
    ds = _cfg(
        tiny_model,
        dataset,
        tmp_path / "ds",
        **common,
        **{"memory.engine": "{kind: deepspeed, stage: 2, offload_optimizer_device: none}"},
    )
    got = train(ds).losses
    assert got[0] == pytest.approx(ref[0], rel=1e-3)  # the same first step: same data, noise and weights
    assert got == pytest.approx(ref, rel=0.05)


def test_cogvideox_lora_with_block_swap_on_cuda(dataset, tmp_path):
    from difftrain.families.cogvideox import CogVideoX
    from difftrain.trainers.loop import Trainer

    model = CogVideoX().build_tiny(tmp_path / "tiny-cog")
    sets = tiny_sets(
        model,
        dataset,
        tmp_path,
        **{
            "train.device": "cuda",
            "precompute.device": "cuda",
            "memory.weights.kind": "bf16",
            "train.mixed_precision": "bf16",
            "memory.activations.kind": "checkpoint",
            "memory.offload": "{kind: block_swap, blocks_to_swap: 2}",
            "train.max_steps": 10,
            "train.batch_size": 2,
        },
    )
    cfg = resolve(recipe="tiny-cogvideox-lora", sets=sets).config
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    assert len(t.parts.block_swap.swapped) == 2 and all(torch.isfinite(torch.tensor(r.losses)))


def test_validation_cpu_offload_keeps_one_extra_part_on_the_gpu(dataset, tmp_path):
    """With validation.cpu_offload, T5 is back on the CPU while the transformer denoises, the VAE visits
    for the I2V image and the decode, and the transformer being trained never leaves the GPU."""
    from PIL import Image

    from difftrain.families.cogvideox import CogVideoXI2V
    from difftrain.trainers.loop import Trainer
    from difftrain.trainers.validation import validate

    model = CogVideoXI2V().build_tiny(tmp_path / "tiny-i2v", seed=0)
    start = tmp_path / "start.png"
    Image.new("RGB", (64, 64), (200, 40, 40)).save(start)
    cfg = resolve(
        recipe="tiny-cogvideox-lora",
        sets=tiny_sets(
            model,
            dataset,
            tmp_path,
            **{
                "family": "cogvideox-i2v",
                "model.config": "cogvideox-tiny-i2v",
                "train.device": "cuda",
                "precompute.device": "cuda",
                "train.max_steps": 1,
                "validation.prompts": "[a red start]",
                "validation.images": f"[{start}]",
                "validation.num_inference_steps": 2,
                "validation.resolution": 64,
                "data.frames": 9,
            },
        ),
    ).config
    precompute(cfg)
    t = Trainer(cfg)
    t.run()
    plain = validate(t.validation_inputs(), "plain")
    seen = []
    tr = t.parts.comps["transformer"]
    loaded = {}
    real_load = t.family.load

    def spy_load(*a, **k):
        loaded.update(real_load(*a, **k))
        return loaded

    t.family.load = spy_load
    # on the first block: after the transformer's own pre-hooks (difftrain's offload among them) have run
    handle = tr.transformer_blocks[0].register_forward_pre_hook(
        lambda m, a: seen.append({n: next(loaded[n].parameters()).device.type for n in ("text_encoder", "vae")})
    )
    t.cfg.validation.cpu_offload = True
    try:
        offloaded = validate(t.validation_inputs(), "offloaded")
    finally:
        handle.remove()
        del t.family.load
    assert seen and all(d == {"text_encoder": "cpu", "vae": "cpu"} for d in seen)
    assert next(tr.parameters()).is_cuda and plain[0].stat().st_size > 0 and offloaded[0].stat().st_size > 0


def test_sweep_on_the_gpu_records_peak_memory_and_an_out_of_memory_trial(tiny_model, dataset, tmp_path):
    """One trial capped far below what it needs (train.gpu_memory_limit_gib) is recorded as oom; the other
    finishes with its peak GPU memory in the table."""
    import json

    from difftrain.flows.sweep import SweepSpec, run_sweep

    spec = SweepSpec(
        recipe="tiny-sdxl-lora",
        sets=tiny_sets(
            tiny_model, dataset, tmp_path, **{"train.device": "cuda", "precompute.device": "cuda", "train.max_steps": 3}
        ),
        grid={"train.gpu_memory_limit_gib": [0.001, 64]},
    )
    rows = {r["train.gpu_memory_limit_gib"]: r for r in run_sweep(spec, tmp_path / "sw", gpus=["0"])}
    assert rows[0.001]["status"] == "oom" and "memory" in rows[0.001]["error"].lower()
    assert rows[64]["status"] == "ok" and 0 < rows[64]["gpu_peak_alloc_gib"] < 2
    assert json.loads((tmp_path / "sw" / "trials" / rows[64]["trial"] / "result.json").read_text())["gpu"] == "0"


@pytest.mark.parametrize(("dtype", "planned"), [("fp32", 1), ("bf16", 2)])
def test_precompute_vae_encodes_1024px_within_an_8gb_card(dtype, planned):
    """SDXL's real-size VAE (random weights) with torch's allocator capped as an 8 GB card leaves it (6.95 GiB):
    the configured batch of four 1024x1024 images runs out of memory as one batch; precompute's encode plans the
    batch from free memory and gives the same latents."""
    import json
    from pathlib import Path

    from diffusers import AutoencoderKL

    import difftrain
    from difftrain.families.sdxl import SDXL
    from difftrain.precompute import encode
    from difftrain.utils import to_dtype

    cfg_file = Path(difftrain.__file__).parent / "families/configs/sdxl-base-1.0/vae/config.json"
    cfg = {k: v for k, v in json.loads(cfg_file.read_text()).items() if not k.startswith("_")}
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(cfg).to(dev, to_dtype(dtype)).eval()
    comps, fam = {"vae": vae}, SDXL()
    pix = torch.rand(4, 3, 1024, 1024, generator=torch.Generator().manual_seed(0)).to(dev) * 2 - 1
    with torch.no_grad():
        ref = fam.encode_images(comps, pix[:1]).cpu()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(6.95 * 2**30 / total, dev)
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        with torch.no_grad():
            if dtype == "fp32":  # what precompute did before: the whole batch at once
                with pytest.raises(torch.OutOfMemoryError):
                    fam.encode_images(comps, pix)
                torch.cuda.empty_cache()
            chunk = encode._Chunk(4)
            # precompute.device "cuda" has no index (the first GPU test missed it: torch wants one for the cap)
            out = encode._encode_images(fam, comps, pix, torch.device("cuda"), dtype, chunk)
        assert chunk.size == planned and out.shape[0] == 4
        assert torch.cuda.max_memory_reserved(dev) <= 6.95 * 2**30
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    assert torch.allclose(out[:1].cpu(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
