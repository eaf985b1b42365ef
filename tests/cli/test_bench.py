"""difftrain bench memory: random weights of a bundled architecture, random data of the real shapes."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open

from conftest import CliResult, clean_failure, console_script
from difftrain.config.load import resolve


def test_bench_memory_cli_on_the_tiny_architecture(cli, tmp_path):
    js = tmp_path / "bench.json"
    r = cli("bench", "memory", "--recipe", "tiny-sdxl-lora", "--steps", "4", "--warmup", "1", "--work", tmp_path,
            "--json", js)  # fmt: skip
    assert r.code == 0, r
    assert "step time" in r.err and "planned" in r.err
    assert "4 steps, 1 of them warm-up" in " ".join(r.err.split())
    got = json.loads(js.read_text())
    assert got["warmup"] == 1 and got["s_per_step"] > 0, got
    assert "not available yet" not in r.err  # validation exists: no stale row saying otherwise (issue 25)
    # speed auto's choice is a row of its own (the CPU: eager, and why)
    assert "speed: eager: auto: the device is cpu" in " ".join(r.err.split())
    # a random single file of the bundled architecture, and a cache of the shapes precompute writes
    with safe_open(str(tmp_path / "random-sdxl-tiny-unet.safetensors"), "pt") as f:  # only what training loads
        assert f.get_tensor("model.diffusion_model.input_blocks.0.0.weight").shape == (32, 4, 3, 3)
    from difftrain.data.cache import DataCache

    entry = DataCache(tmp_path / "cache-128-49").get("lat0")
    assert entry["latents"].shape == (4, 16, 16)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 4


def test_bench_memory_refuses_a_warmup_that_leaves_no_timed_step_through_the_console_script(tmp_path):
    args = ["bench", "memory", "--recipe", "tiny-sdxl-lora", "--steps", "3", "--warmup", "3", "--work", str(tmp_path)]
    r = subprocess.run([console_script(), *args], capture_output=True, text=True, timeout=300)
    clean_failure(CliResult(r.returncode, r.stdout, r.stderr), 2, "--warmup 3 leaves no timed step of --steps 3")
    assert not any(tmp_path.iterdir())  # refused before a random model or cache was written


def test_cache_shapes_of_the_real_architecture():
    from difftrain.families.sdxl import SDXL

    shapes = SDXL().cache_shapes("sdxl-base-1.0", 1024)
    assert shapes == {
        "latent": {"latents": (4, 128, 128), "crop": (2,)},
        "clip": {"prompt_embeds": (77, 2048), "pooled_prompt_embeds": (1280,)},
    }


@pytest.mark.gpu
def test_bench_memory_on_cuda_reports_gpu_peaks(tmp_path):
    from difftrain.flows.bench import bench_memory

    r = bench_memory(resolve(recipe="tiny-sdxl-lora", sets=["train.device=cuda"]).config, tmp_path, steps=4)
    assert (
        r.peak_after_load_gib is not None
        and 0 < r.peak_after_load_gib <= r.peak_train_alloc_gib <= r.peak_train_reserved_gib
    )
    assert torch.cuda.is_available()


@pytest.mark.slow
def test_bench_speed_times_the_config_against_its_eager_baseline(cli, tmp_path):
    """Both runs on the same random model and cache; FLOPs counted once (eager, no checkpointing); MFU is FLOP/s
    over the measured matmul peak, so the faster run has the higher MFU."""
    import json

    r = cli(
        "bench",
        "speed",
        "--recipe",
        "tiny-sdxl-lora",
        "--set",
        "memory.activations.kind=checkpoint",
        "--baseline-set",
        "memory.activations.kind=none",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--step-times",
        "--work",
        tmp_path,
    )
    assert r.code == 0, r
    assert "config vs eager baseline" in r.err and "MFU" in r.err
    out = json.loads((tmp_path / "bench_speed.json").read_text())
    base, cfg = out["rows"]
    # --step-times: every step's seconds, the timed ones summing to the timed mean
    for row in (base, cfg):
        assert len(row["step_s"]) == 4 and all(t > 0 for t in row["step_s"])
        assert sum(row["step_s"][1:]) / 3 == pytest.approx(row["s_per_step"], rel=1e-2)
    assert out["flops_exact"] is True and out["flops_per_step"] > 1e9  # the tiny UNet at batch 2, 128 px
    for row in (base, cfg):
        assert row["s_per_step"] > 0 and row["samples_per_s"] == pytest.approx(2 / row["s_per_step"], rel=1e-2)
        assert row["tflops"] == pytest.approx(out["flops_per_step"] / row["s_per_step"] / 1e12, rel=1e-2)
        assert row["mfu"] == pytest.approx(row["tflops"] / out["peak_tflops"], rel=1e-2)
    assert out["speedup"] == pytest.approx(base["s_per_step"] / cfg["s_per_step"], rel=1e-2)
    # each run trained warm-up + timed steps, its own metrics
    for run in ("eager", "config"):
        assert len((tmp_path / run / "metrics.jsonl").read_text().splitlines()) == 4


def test_bench_speed_baseline_keeps_only_the_speed_options_it_names(cli, tmp_path):
    """--baseline-set speed.X keeps the config's speed option X in the baseline (float8 against compiled bf16,
    max-autotune against compile's default); every other speed option is the eager diffusers-script way; a
    baseline that cannot run is refused with the reason, before anything is built."""
    from difftrain.flows.bench import EAGER, baseline_config

    cfg = resolve(
        recipe="tiny-sdxl-lora",
        sets=["speed.compile=true", "speed.cuda_graphs=true", "speed.attention=math", "speed.sync_seconds=5"],
    ).config
    b = baseline_config(cfg, {"compile", "attention"})
    assert b.speed.compile and b.speed.attention == "math" and not b.speed.cuda_graphs
    assert b.speed.sync_seconds == EAGER.sync_seconds == 0 and b.speed.optimizer_kernels == EAGER.optimizer_kernels
    assert b.model_dump(exclude={"speed"}) == cfg.model_dump(exclude={"speed"})
    assert baseline_config(cfg, set()).speed == EAGER
    r = cli(
        "bench",
        "speed",
        "--recipe",
        "tiny-sdxl-lora",
        "--set",
        "speed.compile=true",
        "--set",
        "speed.cuda_graphs=true",
        "--baseline-set",
        "speed.cuda_graphs=true",
        "--work",
        tmp_path,
    )
    assert r.code != 0 and "baseline" in r.err and "speed.compile" in r.err and "Traceback" not in r.err
    assert not list(tmp_path.iterdir())  # refused before the random model was built


def test_bench_speed_of_a_full_fine_tune_crosses_epochs_without_exporting(cli, tmp_path):
    """A full fine-tune's recipe exports every N epochs (sdxl-full: 5); bench speed's random checkpoint holds only
    what training loads (no VAE, no text encoders) and its few cached items make an epoch a step or two, so an
    export inside the timed steps failed on the H100 (S6-full-fp8). Bench runs save nothing; a trainer with no
    save.formats writes and loads nothing to export."""
    r = cli(
        "bench",
        "speed",
        "--recipe",
        "tiny-sdxl-lora",
        "--set",
        "train.method=full",
        "--set",
        "save.every_n_epochs=1",
        "--no-baseline",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--work",
        tmp_path,
    )
    assert r.code == 0, r
    assert not (tmp_path / "config" / "saved").exists()

    from difftrain.trainers.loop import Trainer

    cfg = resolve(recipe="tiny-sdxl-lora", sets=["train.method=full"]).config
    trainer = Trainer(cfg.model_copy(update={"save": cfg.save.model_copy(update={"formats": []})}))
    trainer.family = None  # export_model would reach the family to load the parts training lacks
    assert trainer.export_model("epoch-0001") == []


@pytest.mark.slow
def test_bench_speed_profiles_a_step_after_the_timed_ones(cli, tmp_path):
    """--profile adds the profiler's warm-up and profiled steps after the timed ones (so they do not slow the
    timing) and reports the profiled step's own duration and kernels by kind."""
    import json

    r = cli(
        "bench",
        "speed",
        "--recipe",
        "tiny-sdxl-lora",
        "--no-baseline",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--profile",
        "--work",
        tmp_path,
    )
    assert r.code == 0, r
    row = json.loads((tmp_path / "bench_speed.json").read_text())["rows"][0]
    assert len((tmp_path / "config" / "metrics.jsonl").read_text().splitlines()) == 1 + 2 + 2
    p = row["profile"]
    assert p["step_ms"] > 0 and isinstance(p["by_kind"], dict)
    # the profiled step's operators, not an empty cycle after it (a repeating schedule leaves only a synchronize)
    # (that left two rows: cudaDeviceSynchronize and the profiler's buffer request)
    table = (tmp_path / "profile-config.txt").read_text()
    assert table.count("aten::") >= 10, table[-3000:]


def test_bench_speed_size_of_an_image_family_is_one_bucket(cli, tmp_path):
    """--size HxW on an image family trains that shape (it was an unexpected TypeError: the image families'
    cache shapes take a square side); with --buckets too it is a usage error."""
    args = ("bench", "speed", "--recipe", "tiny-sdxl-lora", "--no-baseline", "--steps", "2", "--warmup", "1")
    r = cli(*args, "--size", "64x96", "--work", tmp_path)
    assert r.code == 0, r
    from difftrain.data.cache import DataCache

    caches = [p for p in tmp_path.iterdir() if p.name.startswith("cache-64x96")]
    assert len(caches) == 1
    entry = DataCache(caches[0]).get("lat0")
    assert entry["latents"].shape == (4, 8, 12)
    r = cli(*args, "--size", "64x96", "--buckets", "64x64", "--work", tmp_path)
    assert r.code == 2 and "--size and --buckets" in r.err, r
