"""Flux.1 on a CUDA GPU (issue 27; skipped elsewhere): fp8 base weights on the tiny seeded Flux track bf16, and the
full-size FLUX.1 [dev] architecture (random weights, `difftrain bench memory` through the console script) trains with
fp8 + every block swapped and with nf4 base weights, each inside the memory its recipe claims."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.families.registry import get_family
from difftrain.precompute.run import precompute

pytestmark = pytest.mark.gpu


def test_fp8_flux_lora_tracks_bf16_and_block_swap_streams_it(_dataset_master, tmp_path):
    from difftrain.trainers.loop import Trainer

    model = get_family("flux").build_tiny(tmp_path / "tiny-flux")
    common = {"train.device": "cuda", "precompute.device": "cuda", "train.mixed_precision": "bf16",
              "train.max_steps": 6, "report.to": "[]"}  # fmt: skip
    a = resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / "a", **common,
                **{"memory.weights.kind": "bf16"})).config  # fmt: skip
    precompute(a)
    ra = Trainer(a).run()
    cache = {"data.cache_dir": tmp_path / "a" / "cache"}
    b = resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / "b", **common, **cache,
                **{"memory.weights": "{kind: fp8}"})).config  # fmt: skip
    tb = Trainer(b)
    rb = tb.run()
    assert rb.losses == pytest.approx(ra.losses, rel=0.05)
    frozen = [p for p in tb.parts.comps["transformer"].parameters() if not p.requires_grad and p.dim() == 2]
    assert any(p.dtype == torch.float8_e4m3fn for p in frozen)
    c = resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / "c", **common, **cache,
                **{"memory.weights": "{kind: fp8}", "memory.offload": "{kind: block_swap, blocks_to_swap: 3}",
                   "memory.activations.kind": "checkpoint"})).config  # fmt: skip
    tc = Trainer(c)
    rc = tc.run()
    assert len(tc.parts.block_swap.swapped) == 3 and all(math.isfinite(x) for x in rc.losses)
    assert rc.losses == pytest.approx(rb.losses, rel=1e-2)


WORK = Path(os.environ.get("DIFFTRAIN_FLUX_GPU_WORK", "/tmp/difftrain-flux-gpu"))  # one random 12B model, reused


@pytest.mark.parametrize(
    ("recipe", "sets", "reserved_below", "rss_below"),
    [
        # fp8 + all 57 blocks swapped (measured 4.75 GiB capped as the card); its fp8 blocks live pinned in host RAM
        ("flux-lora-8gb", [], 6.0, 16.0),
        # nf4 base: half fp8's weights (fp8 took 15.4); streamed into nf4, so host RAM stays under the 8 GiB target
        ("flux-lora-24gb", ["memory.weights.kind=nf4"], 14.0, 8.0),
    ],
    ids=["fp8-swap-all", "nf4"],
)
def test_full_size_flux_trains_in_its_memory(recipe, sets, reserved_below, rss_below, tmp_path):
    js = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "difftrain", "bench", "memory", "--recipe", recipe, "--steps", "3",
           "--work", str(WORK), "--json", str(js), "--set", "speed.compile=false"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = json.loads(js.read_text())
    if os.environ.get("DIFFTRAIN_GPU_TEST_OUT"):  # the figures, for docs/benchmarks.md
        Path(os.environ["DIFFTRAIN_GPU_TEST_OUT"], f"{recipe}-{'nf4' if sets else 'shipped'}.json").write_text(
            js.read_text()
        )
    assert got["peak_train_reserved_gib"] < reserved_below, got
    assert got["stats"]["peak_rss_gib_train"] < rss_below, got["stats"]
    rows = [json.loads(x) for x in (WORK / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), rows


def _flux_ds(model, data, out, engine, **extra):
    sets = {"train.device": "cuda", "precompute.device": "cuda", "train.mixed_precision": "bf16",
            "memory.weights.kind": "bf16", "train.batch_size": 4, "train.learning_rate": 1e-3,
            "train.max_steps": 12, "train.checkpoint_every": 1000, "report.to": "[]"}  # fmt: skip
    if engine:
        sets["memory.engine"] = engine
    sets.update(extra)
    return resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, data, out, **sets)).config


def test_deepspeed_zero2_flux_lora_tracks_the_plain_run(_dataset_master, tmp_path):
    """ZeRO-2 on Flux (one process): bf16 module weights with DeepSpeed's fp32 master copy, against plain AdamW."""
    from difftrain.trainers.loop import Trainer

    model = get_family("flux").build_tiny(tmp_path / "tiny-flux")
    cache = {"data.cache_dir": tmp_path / "cache"}
    plain = _flux_ds(model, _dataset_master, tmp_path / "plain", None, **cache)
    precompute(plain)
    ref = Trainer(plain).run().losses
    ds = _flux_ds(model, _dataset_master, tmp_path / "ds",
                  "{kind: deepspeed, stage: 2, offload_optimizer_device: none}", **cache)  # fmt: skip
    t = Trainer(ds)
    got = t.run().losses
    assert t.parts.engine is not None and t.parts.engine.zero_optimization_stage() == 2
    assert got[0] == pytest.approx(ref[0], rel=1e-3)  # the same first step: same data, noise and weights
    assert got == pytest.approx(ref, rel=0.05)


def test_deepspeed_zero3_offload_flux_full_finetune_learns_and_saves_both_layouts(_dataset_master, tmp_path):
    """ZeRO-3 with weights and optimizer on the CPU (the partitioned build from mapped reads), full fine-tune of
    the tiny Flux: it learns, and the export is a BFL single file and a diffusers folder with the same weights."""
    from safetensors.torch import load_file

    from difftrain.trainers.loop import Trainer

    model = get_family("flux").build_tiny(tmp_path / "tiny-flux")
    engine = "{kind: deepspeed, stage: 3, offload_optimizer_device: cpu, offload_param_device: cpu}"
    extra = {"train.method": "full", "train.max_steps": 20, "save.formats": "[single_file, diffusers]",
             "save.precision": "fp32"}  # fmt: skip
    cfg = _flux_ds(model, _dataset_master, tmp_path, engine, **extra)
    precompute(cfg)
    t = Trainer(cfg)
    r = t.run()
    assert t.parts.engine.zero_optimization_stage() == 3
    assert sum(r.losses[-5:]) / 5 < 0.9 * sum(r.losses[:5]) / 5
    files = [Path(p) for p in r.saved]
    single = next(p for p in files if p.suffix == ".safetensors")
    sd = load_file(single)
    assert any(k.startswith("double_blocks.0.") for k in sd) and any(k.startswith("single_blocks.") for k in sd)
    folder = next(p for p in files if p.is_dir())
    ours = {}
    for f in folder.rglob("transformer/*.safetensors"):
        ours.update(load_file(f))
    base = {}
    for f in (model / "transformer").glob("*.safetensors"):
        base.update(load_file(f))
    assert ours.keys() == base.keys()
    moved = [k for k in ours if (ours[k].float() - base[k].float()).abs().max() > 1e-3]  # past bf16 rounding
    assert len(moved) > len(ours) // 2  # trained weights, not the base's
    # the same weights in both layouts: BFL's double_blocks.0.img_attn.proj is diffusers' attn.to_out.0
    assert torch.equal(sd["double_blocks.0.img_attn.proj.weight"].float(),
                       ours["transformer_blocks.0.attn.to_out.0.weight"].float())  # fmt: skip


@pytest.mark.parametrize("opt", ["adamw8bit", "cpu_offload"])
def test_flux_lora_with_the_8bit_and_cpu_offload_optimizers_tracks_adamw(_dataset_master, tmp_path, opt):
    """bitsandbytes' AdamW8bit and torchao's CPU-offload AdamW on the tiny Flux: they learn as AdamW does."""
    from difftrain.trainers.loop import Trainer

    model = get_family("flux").build_tiny(tmp_path / "tiny-flux")
    cache = {"data.cache_dir": tmp_path / "cache", "train.max_grad_norm": "null"}  # cpu_offload cannot clip
    ref_cfg = _flux_ds(model, _dataset_master, tmp_path / "ref", None, **cache)
    precompute(ref_cfg)
    ref = Trainer(ref_cfg).run().losses
    t = Trainer(_flux_ds(model, _dataset_master, tmp_path / opt, None, **cache, **{"memory.optimizer.kind": opt}))
    got = t.run().losses
    assert type(t.parts.optimizer).__name__ in {"AdamW8bit", "PagedAdamW8bit", "CPUOffloadOptimizer"}
    assert got[0] == pytest.approx(ref[0], rel=1e-3)  # the same first step: same data, noise and weights
    assert got == pytest.approx(ref, rel=0.05)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_flux_on_two_gpus_trains_as_one_gpu_with_the_global_batch(_dataset_master, tmp_path, engine):
    """Flux through `difftrain train --gpus 2` on NCCL: LoRA under DDP, and a full fine-tune under ZeRO-3 (built
    partitioned, filled by rank 0); 2 GPUs x batch 2 follow 1 GPU x batch 4 (same global batch) within bf16 noise."""
    from safetensors.torch import load_file

    model = get_family("flux").build_tiny(tmp_path / "tiny-flux")
    base = {"train.device": "cuda", "precompute.device": "cuda", "train.mixed_precision": "bf16",
            "memory.weights.kind": "bf16", "train.learning_rate": 1e-4, "train.max_steps": 8,
            "train.checkpoint_every": "null", "report.to": "[]", "report.html": "false",
            "data.cache_dir": tmp_path / "cache"}  # fmt: skip
    if engine == "zero3":
        base.update({"memory.engine.kind": "deepspeed", "memory.engine.stage": 3, "train.method": "full",
                     "memory.engine.offload_optimizer_device": "none", "save.formats": "[diffusers]",
                     "save.precision": "fp32", "memory.optimizer.kind": "adamw"})  # fmt: skip
    else:
        base["memory.engine.kind"] = "ddp"
    precompute(resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / "p", **base)).config)

    def run(out: str, batch: int, *extra: str) -> Path:
        sets = tiny_sets(model, _dataset_master, tmp_path / out, **{**base, "train.batch_size": batch})
        cmd = [sys.executable, "-m", "difftrain", "train", "--recipe", "tiny-flux-lora", *extra]
        r = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True,
                           env={**os.environ, "DIFFTRAIN_PROGRESS": "0"}, timeout=900)  # fmt: skip
        assert r.returncode == 0, r.stderr[-4000:]
        return tmp_path / out / "run"

    two, one = run("two", 2, "--gpus", "2"), run("one", 4)

    def losses(run_dir: Path) -> list[float]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return [r["loss"] for r in rows if "loss" in r]

    assert len(losses(one)) == 8 and losses(two) == pytest.approx(losses(one), rel=0.02)
    if engine == "ddp":  # the LoRA is the change itself (its B starts at zero)
        a, b = (load_file(d / "pytorch_lora_weights.safetensors") for d in (two, one))
        z = {k: torch.zeros_like(v) for k, v in a.items()}
    else:  # the fine-tuned transformer, as the change from the base weights
        a, b, z = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
                   for d in (two / "diffusers" / "transformer", one / "diffusers" / "transformer",
                             model / "transformer"))  # fmt: skip
    assert a.keys() == b.keys() == z.keys() and len(a) > 0
    da, db = (torch.cat([x[k].float().flatten() - z[k].float().flatten() for k in sorted(x)]) for x in (a, b))
    assert db.norm() > 0 and ((da - db).norm() / db.norm()).item() < (0.02 if engine == "ddp" else 0.2)
