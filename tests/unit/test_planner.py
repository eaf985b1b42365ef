"""The memory planner: its arithmetic, its error against GPU measurements, the recipe tiers, the --vram search."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from difftrain.config.load import resolve
from difftrain.config.recipes import recipe_gpus, recipe_header, recipe_names
from difftrain.memory.planner import COMPILED_ACTIVATIONS, GIB, ZERO3_MAX_LIVE, ZERO_BUCKET, estimate
from difftrain.planning.estimate import plan_memory

#: sdxl-full-3gb as it shipped until issue 50 retired it (over the host RAM budget of its tier): the pins below were
#: measured with it, and it still tests the planner's CPU-optimizer terms
RETIRED_FULL_3GB = Path(__file__).parents[1] / "fixtures" / "retired" / "sdxl-full-3gb.yaml"


def _hints(**over):
    h = {
        "parts": {"unet": {"total": 1000, "fp8_eligible": 800}},
        "trained_parts": ["unet"],
        "lora_params": 50,
        "largest_param": 100,
        "latent_pixels": 10,
        "activations": {"checkpoint": 2.0, "none": 20.0},
        "encode_captions": False,
    }
    h.update(over)
    return h


def test_terms_by_hand():
    lora = resolve(sets=["memory.weights.kind=bf16", "memory.activations.kind=checkpoint", "train.batch_size=3"]).config
    e = estimate(lora, _hints())
    assert e.gpu["weights"] * GIB == pytest.approx(1000 * 2 + 50 * 4)  # frozen bf16 + fp32 LoRA
    assert e.gpu["gradients"] * GIB == pytest.approx(50 * 4)
    assert e.gpu["optimizer state"] * GIB == pytest.approx(50 * 8)
    assert e.gpu["activations"] * GIB == pytest.approx(2.0 * 10 * 3)
    fp8 = resolve(sets=["memory.weights={kind: fp8}"]).config
    assert estimate(fp8, _hints()).gpu["weights"] * GIB == pytest.approx(800 * 1 + 200 * 2 + 50 * 4)
    full = resolve(
        sets=[
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer.kind=adamw8bit",
            "memory.activations={kind: checkpoint, every: 2}",
        ]
    ).config
    e = estimate(full, _hints())
    assert (e.gpu["weights"] * GIB, e.gpu["gradients"] * GIB, e.gpu["optimizer state"] * GIB) == pytest.approx(
        (2000, 2000, 2000)
    )
    assert e.gpu["activations"] * GIB == pytest.approx((2.0 + (20.0 - 2.0) / 2) * 10)
    off = resolve(
        sets=[
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer={kind: cpu_offload}",
            "train.max_grad_norm=null",
        ]
    ).config
    e = estimate(off, _hints())
    # torchao's host copy of each bf16 weight, its gradient and both moments in bf16: 8 bytes a weight
    assert e.gpu["optimizer state"] == 0 and e.host["optimizer state"] * GIB == pytest.approx(1000 * 8)
    assert "reading the checkpoint (file pages)" not in e.host  # a single file is read a tensor at a time


def test_a_diffusers_folder_counts_the_file_pages_of_mapped_reads_only(tmp_path):
    """A folder's diffusers models are read with private reads (no file pages); transformers' text encoders and
    ZeRO-3's partitioned denoiser through safetensors' mapping, whose pages count while they load."""
    h = _hints(parts={"unet": {"total": 1000}, "text_encoder": {"total": 300}, "vae": {"total": 80, "loaded": False}},
               denoiser="unet")  # fmt: skip
    folder = resolve(sets=[f"model.path={tmp_path}"]).config
    assert estimate(folder, h).host["reading the checkpoint (file pages)"] * GIB == pytest.approx(300 * 2)
    alone = _hints(parts={"unet": {"total": 1000}}, denoiser="unet")
    assert "reading the checkpoint (file pages)" not in estimate(folder, alone).host
    zero3 = resolve(sets=[f"model.path={tmp_path}", "train.method=full", "memory.weights.kind=bf16",
                          "memory.engine={kind: deepspeed, stage: 3}"]).config  # fmt: skip
    assert estimate(zero3, alone).host["reading the checkpoint (file pages)"] * GIB == pytest.approx(1000 * 2)


def test_block_swap_terms_by_hand():
    units = [300, 200, 100, 100]  # parameters per block, of the denoiser's 1000
    h = _hints(swap_units=units, denoiser="unet")
    base = resolve(sets=["memory.weights.kind=bf16"]).config
    swap = resolve(sets=["memory.weights.kind=bf16", "memory.offload={kind: block_swap, blocks_to_swap: 3}"]).config
    e0, e = estimate(base, h), estimate(swap, h)
    # the 3 largest (600 params: blocks 0, 1 and the later 100) leave the GPU; at the peak, where backward starts, the
    # last prefetch + 1 = 2 blocks in forward order are on it: of those only block 3 (100) is a swapped one
    assert (e0.gpu["weights"] - e.gpu["weights"]) * GIB == pytest.approx(600 * 2 - 100 * 2)
    assert e.host["swapped blocks (pinned)"] * GIB == pytest.approx(600 * 2)
    more = resolve(
        sets=["memory.weights.kind=bf16", "memory.offload={kind: block_swap, blocks_to_swap: 4, prefetch: 1}"]
    ).config
    assert (e0.gpu["weights"] - estimate(more, h).gpu["weights"]) * GIB == pytest.approx(700 * 2 - 200 * 2)
    prefetch2 = resolve(
        sets=["memory.weights.kind=bf16", "memory.offload={kind: block_swap, blocks_to_swap: 4, prefetch: 2}"]
    ).config
    assert (e0.gpu["weights"] - estimate(prefetch2, h).gpu["weights"]) * GIB == pytest.approx(700 * 2 - 400 * 2)
    # with CUDA graphs the blocks land in prefetch + 2 fixed slots of the largest swapped block (300) for the run
    graphs = resolve(
        sets=[
            "memory.weights.kind=bf16",
            "memory.offload={kind: block_swap, blocks_to_swap: 3}",
            "speed.compile=true",
            "speed.cuda_graphs=true",
        ]
    ).config
    assert (e0.gpu["weights"] - estimate(graphs, h).gpu["weights"]) * GIB == pytest.approx(600 * 2 - 3 * 300 * 2)


def test_speed_auto_with_lora_block_swap_plans_the_fixed_slots_graphs_need():
    # sdxl-lora-4gb ships with speed auto, which records CUDA graphs beside its block swap: the plan holds the
    # prefetch + 2 fixed slots, as with graphs named; with graphs off, only the blocks in flight at the peak
    auto = resolve(recipe="sdxl-lora-4gb").config
    named = resolve(recipe="sdxl-lora-4gb", sets=["speed.compile=true", "speed.cuda_graphs=true"]).config
    off = resolve(recipe="sdxl-lora-4gb", sets=["speed.cuda_graphs=false"]).config
    weights = {n: plan_memory(c).gpu["weights"] for n, c in (("auto", auto), ("named", named), ("off", off))}
    assert weights["auto"] == pytest.approx(weights["named"])
    assert weights["auto"] > weights["off"] + 0.1


@pytest.mark.slow
def test_plan_search_offers_block_swap_below_what_fp8_reaches(cli):
    r = cli("plan", "--recipe", "sdxl-lora-8gb", "--vram", "3GiB")
    assert r.code == 0, r
    assert "block_swap" in r.out
    sets = [line.split(" ", 1)[1].strip("'") for line in r.out.splitlines()]
    cfg = resolve(recipe="sdxl-lora-8gb", sets=sets).config
    assert plan_memory(cfg).card_total <= 3.0


# measured on an H200 with benchmarks/memory_tiers.py (docs/benchmarks.md): peak allocated GiB per case
MEASURED = {
    "L1": (["train.method=lora", "memory.weights.kind=bf16", "memory.activations.kind=checkpoint"], 5.853),
    "L2": (["train.method=lora", "memory.weights.kind=bf16", "memory.activations.kind=none"], 12.46),
    "L3": (["train.method=lora", "memory.weights={kind: fp8}", "memory.activations.kind=checkpoint"], 3.393),
    "L4": (
        ["train.method=lora", "memory.weights={kind: fp8}", "memory.activations={kind: checkpoint, every: 2}"],
        6.73,
    ),
    "L5": (
        ["train.method=lora", "memory.weights.kind=bf16", "memory.activations.kind=none", "train.batch_size=2"],
        19.698,
    ),
    "F1": (["train.method=full", "memory.weights.kind=bf16", "memory.optimizer.kind=adamw8bit"], 15.076),
    "F2": (
        [
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer.kind=adamw8bit",
            "memory.fused_backward=true",
            "train.max_grad_norm=null",
        ],
        11.033,
    ),
    "F3": (
        [
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
            "train.max_grad_norm=null",
        ],
        5.756,
    ),
    "F4": (
        [
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer.kind=adamw8bit",
            "full.train_text_encoder_1=true",
            "full.train_text_encoder_2=true",
        ],
        19.35,
    ),
}


def _sdxl_planned(sets: list[str]) -> float:
    """The planner's allocated peak for the benchmark's SDXL set-up (1024, LoRA r16, bf16, checkpointing) plus ``sets``."""
    cfg = resolve(
        sets=[
            "model.config=sdxl-base-1.0",
            "lora.rank=16",
            "data.resolution=1024",
            "train.mixed_precision=bf16",
            "memory.activations.kind=checkpoint",
            "speed.compile=false",  # the benchmark's cases ran eagerly: no CUDA graphs, no fixed block swap slots
            *sets,
        ]
    ).config
    return plan_memory(cfg).gpu_total


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_planner_within_ten_percent_of_measured(case):
    sets, measured = MEASURED[case]
    predicted = _sdxl_planned(sets)
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


# block swap (H200, same script; the tier recipes on the H100 agree): within 10 % since the planner counts the blocks
# on the GPU at the peak (the output end's) instead of the two largest (then +8-19 %)
MEASURED_SWAP = {
    "L9": (
        ["train.method=lora", "memory.weights.kind=bf16", "memory.offload={kind: block_swap, blocks_to_swap: 87}"],
        1.135,
    ),
    "L10": (
        ["train.method=lora", "memory.weights={kind: fp8}", "memory.offload={kind: block_swap, blocks_to_swap: 87}"],
        1.047,
    ),
    "F5": (
        [
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
            "train.max_grad_norm=null",
            "memory.offload={kind: block_swap, blocks_to_swap: 87}",
        ],
        1.041,
    ),
}


@pytest.mark.parametrize("case", sorted(MEASURED_SWAP))
def test_planner_block_swap_within_ten_percent(case):
    sets, measured = MEASURED_SWAP[case]
    predicted = _sdxl_planned(sets)
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


# SD3-medium LoRA r16 / full at 1024, H200, benchmarks/family_memory.py (activations seeded from shared/reference's
# H100 eager run, not fitted to these)
MEASURED_SD3 = {
    "S1": ("sd3-lora-8gb", [], 4.741),
    "S2": ("sd3-lora-8gb", ["memory.activations.kind=none"], 9.125),
    "S3": ("sd3-lora-8gb", ["memory.weights={kind: fp8}"], 2.847),
    "S4": ("sd3-lora-4gb", [], 1.252),
    "S5": (
        "sd3-lora-8gb",
        [
            "train.method=full",
            "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
            "train.max_grad_norm=null",
            "memory.offload={kind: block_swap, blocks_to_swap: 24}",
        ],
        1.257,
    ),
}


# CogVideoX LoRA r64 / full at 49x480x720 (H200, benchmarks/family_memory.py); 5b's checkpoint coefficient was fitted to C2
MEASURED_COG = {
    "C1": ("cogvideox-2b-lora-24gb", [], 7.695),
    "C2": ("cogvideox-5b-lora-24gb", [], 18.558),
    "C3": ("cogvideox-2b-lora-6gb", ["memory.optimizer.kind=adamw"], 4.728),  # measured before 8-bit (issue 23)
    "C4": ("cogvideox-5b-lora-12gb", [], 8.709),
    # C5: the recipe before issue 23 (AdamW on the CPU); C6: as shipped since (Adafactor in backward, block swap
    # written home), capped as a 12 GB card on an H100 (benchmarks/card_fit.py, 2026-11-24)
    "C5": (
        "cogvideox-5b-full-12gb",
        ["memory.optimizer={kind: cpu_offload, offload_gradients: true}", "memory.fused_backward=false"],
        8.676,
    ),
    "C6": ("cogvideox-5b-full-12gb", [], 8.966),
}


@pytest.mark.parametrize("case", sorted({**MEASURED_SD3, **MEASURED_COG}))
def test_planner_within_ten_percent_of_measured_recipes(case):
    recipe, sets, measured = {**MEASURED_SD3, **MEASURED_COG}[case]
    predicted = plan_memory(resolve(recipe=recipe, sets=sets).config).gpu_total
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


RECIPES_WITH_TIERS = [n for n in recipe_names() if re.search(r"^Tier: ", recipe_header(n), re.M)]


def test_tiered_recipes_exist():
    assert {
        "sdxl-lora-3gb",
        "sdxl-lora-4gb",
        "sdxl-lora-8gb",
        "sdxl-full-8gb",
        "sdxl-full-12gb",
        "sd3-lora-4gb",
        "sd3-lora-8gb",
    } <= set(RECIPES_WITH_TIERS)


@pytest.mark.parametrize("name", RECIPES_WITH_TIERS)
def test_recipe_planner_estimate_stays_under_its_tier(name):
    tier = float(re.search(r"^Tier: ([0-9.]+) GiB", recipe_header(name), re.M).group(1))
    e = plan_memory(resolve(recipe=name).config, recipe_gpus(name))  # one GPU's share where it names several
    # the tier is the card: torch's reserved peak plus the CUDA context, the libraries and a display margin
    assert e.card_total <= tier, f"{name}: {e.card_total:.2f} GiB on the card predicted for a {tier} GiB tier"
    assert "Measured peak" in recipe_header(name)


@pytest.mark.slow
def test_plan_cli_search(cli):
    r = cli("plan", "--recipe", "sdxl-lora-8gb", "--vram", "5GiB")  # the whole card (context, libraries, display)
    assert r.code == 0, r
    # measured: block swap costs 4 % of the step, fp8 20 %: bf16 weights with half the blocks swapped
    assert "--set 'memory.weights={kind: bf16}'" in r.out and "blocks_to_swap: 43" in r.out
    r = cli("plan", "--recipe", "sdxl-full", "--vram", "8GiB")
    # measured (sdxl-full-8gb): Adafactor inside backward with half the blocks swapped, 1.26 s/step, where AdamW on
    # the CPU took 1.74
    assert r.code == 0 and "fused_backward=true" in r.out and "train.max_grad_norm=null" in r.out
    m = resolve(recipe="sdxl-full", sets=[ln.split(" ", 1)[1].strip("'") for ln in r.out.splitlines()]).config.memory
    assert (m.optimizer.kind, m.offload.kind) == ("adafactor", "block_swap")
    r = cli("plan", "--recipe", "sdxl-full", "--vram", "1GiB")
    assert r.code == 1 and "Nothing difftrain offers" in r.err
    r = cli("plan", "--recipe", "sdxl-lora-8gb", "--vram", "lots")
    assert r.code == 2 and "Cannot read the size" in r.err


def test_strict_memory_refuses_before_loading(monkeypatch):
    import torch

    from difftrain.cli import train_cmd
    from difftrain.errors import DifftrainError

    cfg = resolve(recipe="sdxl-full").config
    monkeypatch.setattr(
        "difftrain.flows.doctor.host_ram_gib", lambda: (64.0, 60.0)
    )  # host RAM is not what is tested here
    monkeypatch.setattr("difftrain.utils.pick_device", lambda name="auto": torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * GIB, 80 * GIB))
    e = plan_memory(cfg)  # torch's reservation and the CUDA libraries still to load must be free
    msg = rf"needs about {e.free_needed:.1f} GiB of GPU memory \({e.gpu_reserved:.1f} reserved by torch, 0\.2 for the"
    with pytest.raises(DifftrainError, match=msg + r" CUDA libraries\) and 4\.0 GiB is free"):
        train_cmd.check_memory(cfg, strict=True)
    train_cmd.check_memory(cfg, strict=False)  # warns only
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))
    train_cmd.check_memory(cfg, strict=True)  # fits: nothing said


def test_each_process_under_torchrun_checks_its_own_share_before_loading(monkeypatch):
    """Under torchrun (WORLD_SIZE 2) a process of qwen-image-full-2x80gb checks its share of the sharded model
    against its GPU (67 GiB on an 80 GB card), not the whole model's 122 GiB as one process would hold it."""
    import torch

    from difftrain.cli import train_cmd
    from difftrain.errors import DifftrainError

    cfg = resolve(recipe="qwen-image-full-2x80gb").config
    monkeypatch.setattr("difftrain.flows.doctor.host_ram_gib", lambda: (64.0, 60.0))
    monkeypatch.setattr("difftrain.utils.pick_device", lambda name="auto": torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79 * GIB, 80 * GIB))
    monkeypatch.setenv("WORLD_SIZE", "2")
    train_cmd.check_memory(cfg, strict=True)  # its share fits: nothing said
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DifftrainError, match="of GPU memory"):
        train_cmd.check_memory(cfg, strict=True)


def test_train_checks_host_ram_before_loading(monkeypatch, capsys):
    """A plan over the host's available RAM: a warning naming the largest host term (an error with
    --strict-memory), on any device; with enough RAM nothing is said."""
    from difftrain.cli import train_cmd
    from difftrain.errors import DifftrainError

    cfg = resolve(recipe=str(RETIRED_FULL_3GB), sets=["train.device=cpu"]).config
    e = plan_memory(cfg)
    term = max(e.host, key=lambda k: e.host[k])
    assert term == "optimizer state"  # AdamW's state on the host: 4 copies of the weights
    monkeypatch.setattr("difftrain.flows.doctor.host_ram_gib", lambda: (32.0, 20.0))
    msg = rf"needs about {e.host_total:.1f} GiB of host RAM \(the largest term: optimizer state, "
    with pytest.raises(DifftrainError, match=msg + r".*and 20\.0 GiB is available"):
        train_cmd.check_memory(cfg, strict=True)
    capsys.readouterr()
    train_cmd.check_memory(cfg, strict=False)
    err = capsys.readouterr().err
    assert "of host RAM" in err and "--ram 20GiB" in err
    # the shipped full SDXL recipes whose measured host RAM fits 20 GiB, the smallest card first, with their figures
    from difftrain.config.recipes import recipe_measurements

    ram = {n: m["host_rss_gib"] for n, m in recipe_measurements()["recipes"].items()}
    fit = f"Recipes that fit it: sdxl-full-8gb ({ram['sdxl-full-8gb']:.1f} GiB measured), sdxl-full-12gb ("
    assert fit in " ".join(err.split())
    monkeypatch.setattr("difftrain.flows.doctor.host_ram_gib", lambda: (128.0, e.host_total + 1))
    train_cmd.check_memory(cfg, strict=True)
    assert "host RAM" not in capsys.readouterr().err
    monkeypatch.setattr("difftrain.flows.doctor.host_ram_gib", lambda: (None, None))  # unknown: nothing to compare
    train_cmd.check_memory(cfg, strict=True)


# peak host RSS of every tier recipe, capped as its card on the H100 (benchmarks/card_fit.py, 2026-11-24, the random
# model built beforehand in its own process, pinned copies packed into slabs). Not here: sdxl-full-te-24gb, 2.23
# measured where the plan says 1.90 (-15 %: its text encoders run every step; that term is not modelled yet). Nor the
# Wan recipes: their 8.0 and 8.6 GiB (2026-11-27) were measured before the offloaded checkpoints' host arena (exact
# slabs, each shared table copied once; the plan, 4.8 GiB, counts that), to be measured again on a GPU.
MEASURED_HOST = {
    "sdxl-lora-3gb": 6.80,
    "sdxl-lora-4gb": 6.56,
    "sdxl-lora-8gb": 1.99,
    "sdxl-full-8gb": 5.38,  # streamed (issue 50, 2026-11-27, an H200 capped as the card; 6.49 with the load before)
    str(RETIRED_FULL_3GB): 26.03,
    # Flux as shipped with the streaming load (issue 50, 2026-11-27; flux-full-24gb swapping 13 blocks, on an H200)
    "flux-lora-24gb": 2.10,
    "flux-lora-16gb": 6.62,
    "flux-lora-8gb": 13.36,
    "flux-full-24gb": 10.60,
    "cogvideox-5b-full-12gb": 12.40,
    "sd3-lora-4gb": 5.80,
    "cogvideox-5b-lora-12gb": 12.48,
    "cogvideox-2b-lora-6gb": 5.20,
    "sd3-lora-8gb": 1.81,
    "sd3-lora-16gb": 1.78,
    "sdxl-full": 2.06,
    "sdxl-full-12gb": 2.01,
    "cogvideox-2b-lora-24gb": 1.91,
    "cogvideox-5b-lora-24gb": 1.91,
    "cogvideox-5b-i2v-lora-24gb": 2.03,
    # Wan with the offloaded checkpoints' host arena (issue 51, 2026-11-27, an H200)
    "wan-1.3b-lora-8gb": 5.31,
    "wan-1.3b-full-24gb": 5.90,
    "wan-14b-lora-24gb": 15.46,
    "wan-5b-lora-16gb": 7.48,
    "wan-14b-lora-16gb": 22.50,  # 20 blocks swapped (2026-11-27, after the block swap fix)
    "wan-14b-lora-720p-24gb": 29.42,  # nf4, 2 blocks' inputs kept on the GPU (2026-11-27)
    # Z-Image, Krea 2 and FLUX.2 [klein] as shipped (issues 52-53, 2026-11-27, an H200 capped as the card)
    "zimage-lora-12gb": 2.16,
    "zimage-lora-6gb": 6.75,
    "krea2-lora-24gb": 2.07,
    "krea2-lora-12gb": 10.83,
    "krea2-lora-8gb": 14.32,
    "krea2-full-24gb": 18.01,
    "flux2-klein-4b-lora-8gb": 2.10,
    "flux2-klein-4b-lora-6gb": 4.10,
    "flux2-klein-9b-lora-16gb": 2.21,
    "flux2-klein-9b-lora-8gb": 8.97,
    "qwen-image-lora-16gb": 8.16,  # int4, 36 blocks swapped (issue 53, 2026-11-28, an H200 capped as the card)
    "qwen-image-lora-12gb": 8.11,  # the same settings capped as a 12 GB card (2026-11-28)
    "qwen-image-lora-24gb": 2.07,  # int4, no block swap (2026-11-28)
    "zimage-lora-24gb": 2.18,  # fp8, every second block checkpointed (issue 52, 2026-11-28)
    "zimage-lora-32gb": 1.99,  # fp8, nothing checkpointed (issue 52, 2026-11-28)
    "wan-1.3b-lora-24gb": 1.97,  # bf16, save_attention (issue 51, 2026-11-28)
    "wan-14b-lora-80gb": 1.99,  # bf16, save_attention (issue 51, 2026-11-28)
    "qwen-image-edit-lora-24gb": 2.05,  # int4, no block swap, one reference (issue 53, 2026-11-28)
    "qwen-image-edit-lora-16gb": 8.13,  # int4, 36 blocks swapped, one reference (issue 53, 2026-11-28)
    "krea2-lora-48gb": 2.29,  # fp8 with fp8 matmuls, no checkpointing (issue 52, 2026-11-28)
    "qwen-image-lora-48gb": 2.04,  # fp8, every second block checkpointed (issue 53, 2026-11-28)
    "flux2-klein-4b-full-24gb": 2.03,  # bf16, Adafactor in the backward, no block swap (issue 53, 2026-11-28)
    "flux2-klein-9b-lora-24gb": 2.13,  # fp8, every second block checkpointed (issue 53, 2026-11-28)
    "flux2-klein-9b-lora-48gb": 2.08,  # bf16, nothing checkpointed (issue 53, 2026-11-28)
    "flux2-klein-4b-lora-24gb": 2.08,  # bf16, nothing checkpointed (issue 53, 2026-11-28)
    "qwen-image-2.1-lora-24gb": 2.09,  # bf16, checkpointing (issue 53, 2026-11-28)
    "qwen-image-2.1-lora-16gb": 2.00,  # fp8, checkpointing (issue 53, 2026-11-28)
    "qwen-image-2.1-lora-12gb": 2.07,  # int4, checkpointing (issue 53, 2026-11-28)
    "qwen-image-edit-lora-80gb": 2.27,  # bf16, every second block checkpointed, 14 steps (issue 53, 2026-12-02)
    "flux2-dev-lora-96gb": 2.34,  # bf16, every second block checkpointed, 14 steps (issue 53, 2026-12-02)
}

#: measured host RAM over the plan by more than 10 %: the full fine-tune held 0.6 GiB more than the LoRA recipe of the
#: same shapes (5.90 against 5.31), which no host term of the plan names yet (not explained; both far under their
#: desktops' RAM). The plan may be under by up to this share
HOST_UNDER_PLANNED = {
    "wan-1.3b-full-24gb": 0.20,
    "krea2-full-24gb": 0.15,
    "qwen-image-edit-lora-80gb": 0.20,
    "flux2-dev-lora-96gb": 0.20,
}
# krea2-full-24gb (18.01 measured, 15.81 planned): 2.2 GiB more than its 16 swapped bf16 blocks, the libraries and the
# load, where flux-full-24gb (the same techniques) is within 2 % of its plan; not explained yet
# qwen-image-edit-lora-80gb and flux2-dev-lora-96gb (2.27 and 2.34 measured, 1.90 planned: 16 and 19 % under), both
# 2.3 GiB of a 64 GB machine's RAM. flux2-dev-lora-96gb's peak is its load's (2.34 at load and in training): bench's
# random [dev] file is fp8 (flux2's RANDOM_FP8_ABOVE_BYTES), and loading it in bf16 onto the GPU converts each tensor
# on the host on its way (torch's CPU-to-CUDA copy with a dtype change casts on the CPU first): the largest tensor's
# fp8 read (0.32 Gi elements) and its bf16 copy, 0.95 GiB, over the ~1.4 GiB the libraries hold at load. The plan
# counts no load term for bf16 loads. Edit's peak came in training (1.51 at load, 2.27 over 14 steps, where bf16
# recipes of the same plan held 2.08-2.09 over 3: flux2-klein-9b-lora-48gb, qwen-image-2.1-lora-24gb): not explained

#: measured host RAM under the plan by more than 10 %: Krea 2's largest tensor (226 M elements) is counted as read
#: and copied at once in bf16 (0.84 GiB); the run held less (1.86 GiB at its peak while loading); FLUX.2 klein 9B's
#: (2.21 measured, 2.46 planned) likewise, and krea2-lora-48gb's (2.29 measured, 2.74 planned: the same load). The plan
#: may be over by up to this share
HOST_OVER_PLANNED = {
    "krea2-lora-24gb": 0.35,
    "krea2-lora-48gb": 0.35,
    "flux2-klein-9b-lora-16gb": 0.15,
    "flux2-klein-9b-lora-24gb": 0.20,  # 2.13 measured, 2.46 planned: the same load as the 16 GB recipe
}


@pytest.mark.parametrize("name", sorted(MEASURED_HOST))
def test_planner_host_ram_within_ten_percent_of_measured(name):
    predicted = plan_memory(resolve(recipe=name).config).host_total
    under, over = HOST_UNDER_PLANNED.get(name, 0.10), HOST_OVER_PLANNED.get(name, 0.10)
    assert -under < (predicted - MEASURED_HOST[name]) / MEASURED_HOST[name] < over, (predicted, MEASURED_HOST[name])


def test_deepspeed_terms_by_hand():
    """ZeRO-3 with the weights offloaded keeps DeepSpeed's live-parameter budget of them on the GPU plus a prefetch
    bucket, and its gradients leave through a reduce bucket; ZeRO-2 with the optimizer offloaded: the allocator holds
    about the weights again (both measured, docs/benchmarks.md)."""
    from difftrain.memory.planner import ALLOCATOR_SLACK_GIB

    full = ["train.method=full", "memory.weights.kind=bf16", "memory.optimizer.kind=adamw"]
    z3 = resolve(
        sets=[
            *full,
            "memory.engine={kind: deepspeed, stage: 3, offload_optimizer_device: cpu, offload_param_device: cpu}",
        ]
    ).config
    big = _hints(parts={"unet": {"total": 3e9, "fp8_eligible": 2e9}})
    e = estimate(z3, big)
    assert e.gpu["weights"] * GIB == pytest.approx((ZERO3_MAX_LIVE + ZERO_BUCKET) * 2)
    assert e.gpu["gradients"] * GIB == pytest.approx((100 + ZERO_BUCKET) * 2)
    assert e.host["weights (ZeRO-3 offload)"] * GIB == pytest.approx((3e9 - ZERO3_MAX_LIVE - ZERO_BUCKET) * 2)
    small = estimate(z3, _hints())  # fewer weights than the live budget: all of them on the GPU
    assert small.gpu["weights"] * GIB == pytest.approx((1000 + ZERO_BUCKET) * 2)
    z2 = resolve(sets=[*full, "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: cpu}"]).config
    e2 = estimate(z2, _hints())
    assert e2.slack == pytest.approx(ALLOCATOR_SLACK_GIB + 1000 * 2 / GIB)
    on_gpu = resolve(sets=[*full, "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: none}"]).config
    assert estimate(on_gpu, _hints()).slack == pytest.approx(ALLOCATOR_SLACK_GIB)


def test_reserved_adds_the_family_slack_and_shares_of_the_allocated_and_the_activations():
    cfg = resolve(sets=["memory.weights.kind=bf16"]).config
    plain, sdxl_like = estimate(cfg, _hints()), estimate(cfg, _hints(allocator_slack=0.3))
    assert plain.gpu_reserved == pytest.approx(plain.gpu_total * 1.04 + 0.15 + 0.1 * plain.gpu["activations"])
    assert sdxl_like.gpu_reserved - plain.gpu_reserved == pytest.approx(0.15)
    expandable = resolve(sets=["memory.weights.kind=bf16", "memory.expandable_segments=true"]).config
    e = estimate(expandable, _hints(activations={"checkpoint": 2.0 * GIB, "none": 20.0}))
    assert e.gpu_reserved == pytest.approx(e.gpu_total * 1.04 + 0.15 + 0.05 * e.gpu["activations"])
    # the bundled SDXL data states its slack, SD3's does not (the default)
    assert plan_memory(resolve(recipe="sdxl-lora-8gb").config).slack == 0.3
    assert plan_memory(resolve(recipe="sd3-lora-8gb").config).slack == 0.15


# every GPU tier recipe as shipped, capped as its card on the H100 (benchmarks/card_fit.py): peak allocated and
# reserved GiB; the planner is within 10 % of both (issue 23). Measured 2026-11-24, before speed auto (eager), except:
# the block swap LoRA recipes, 2026-11-26, as shipped since speed auto records CUDA graphs beside block swap (compiled
# + graphs, or compiled alone for CogVideoX; sdxl-lora-4gb from `bench memory --card 4gb` over six buckets, 16 steps);
# Flux, 2026-11-25, as shipped (compiled, no graphs with fp8 or block swap; flux-lora-24gb from
# benchmarks/fast_default.py, same H100, uncapped: it used 15.65 of its 24 GiB)
MEASURED_CARD = {
    "sdxl-lora-3gb": (1.299, 1.76),
    "sdxl-lora-4gb": (2.04, 2.59),
    "sdxl-lora-8gb": (5.853, 6.348),
    str(RETIRED_FULL_3GB): (1.041, 1.457),
    "sdxl-full-8gb": (4.173, 4.479),
    "sdxl-full-12gb": (6.894, 7.625),
    "sdxl-full": (15.07, 15.79),
    "sdxl-full-te-24gb": (19.348, 20.162),
    "sd3-lora-4gb": (1.296, 1.664),
    "sd3-lora-8gb": (4.741, 4.984),
    "sd3-lora-16gb": (9.125, 9.719),
    "cogvideox-2b-lora-6gb": (4.095, 4.258),
    "cogvideox-5b-lora-12gb": (7.973, 8.535),
    "cogvideox-5b-full-12gb": (8.966, 10.16),
    "cogvideox-2b-lora-24gb": (7.75, 9.076),
    "cogvideox-5b-lora-24gb": (18.66, 20.561),
    "cogvideox-5b-i2v-lora-24gb": (18.762, 20.734),
    "flux-lora-24gb": (14.37, 15.65),
    "flux-lora-16gb": (10.01, 11.07),
    "flux-lora-8gb": (3.60, 4.55),
    "flux-full-24gb": (17.52, 19.44),  # 13 blocks swapped since issue 50 (2026-11-27, an H200 capped as the card)
    # Wan as shipped (compiled, offloaded split checkpoints with the attentions' token chunks, the host arena; issue 51,
    # 2026-11-27, an H200 capped as the card)
    "wan-1.3b-lora-8gb": (4.15, 5.32),
    "wan-1.3b-full-24gb": (5.20, 6.51),
    "wan-14b-lora-24gb": (19.61, 20.63),  # 3 steps (card_fit_wan.json's w14-24-so-x: the recipe's settings)
    "wan-5b-lora-16gb": (9.08, 9.37),  # 3 steps (card_fit_wan.json's w5-16-so: the recipe's settings)
    "wan-14b-lora-16gb": (13.43, 14.31),  # 3 steps (w14-16-bs20), after the block swap fix
    "wan-14b-lora-720p-24gb": (19.13, 21.09),  # 3 steps (w14-24-720-nf4-k2), eager as shipped (nf4)
    # Z-Image, Krea 2 and FLUX.2 [klein] as shipped, 3 steps (issues 52-53, 2026-11-27, an H200 capped as the card;
    # card_fit_zimage.json, card_fit_krea2.json, card_fit_flux2.json: the recipes' settings)
    "zimage-lora-12gb": (8.875, 9.955),
    "zimage-lora-6gb": (4.003, 4.666),
    "krea2-lora-24gb": (16.988, 17.873),
    "krea2-lora-12gb": (9.708, 10.373),
    "krea2-lora-8gb": (6.14, 6.68),
    "krea2-full-24gb": (17.063, 20.166),
    "flux2-klein-4b-lora-8gb": (6.10, 6.377),
    "flux2-klein-4b-lora-6gb": (4.386, 4.834),
    "flux2-klein-9b-lora-16gb": (12.219, 12.889),
    "flux2-klein-9b-lora-8gb": (6.125, 6.834),
    "qwen-image-lora-16gb": (9.103, 9.824),  # 3 steps (card_fit_qwen_image.json q16-int4-bs36), 2026-11-28
    "qwen-image-lora-12gb": (9.103, 9.824),  # 3 steps (q12-int4-bs36: the same settings capped at 12), 2026-11-28
    "qwen-image-lora-24gb": (14.487, 15.221),  # 3 steps (q24-int4), 2026-11-28
    "zimage-lora-24gb": (17.587, 19.883),  # 3 steps (card_fit_zimage.json z24-fp8-ck2), 2026-11-28
    "zimage-lora-32gb": (26.667, 29.672),  # 3 steps (card_fit_zimage.json z32-fp8-nock), 2026-11-28
    "wan-1.3b-lora-24gb": (14.135, 15.848),  # 3 steps, as shipped, 2026-11-28
    "wan-14b-lora-80gb": (63.957, 65.578),  # 3 steps, as shipped, 2026-11-28
    "qwen-image-edit-lora-24gb": (16.885, 17.727),  # 3 steps (card_fit_qwen_image.json qe24-int4), 2026-11-28
    "qwen-image-edit-lora-16gb": (11.501, 12.234),  # 3 steps (qe16-int4-bs36), 2026-11-28
    "krea2-lora-48gb": (40.436, 42.262),  # 3 steps (card_fit_krea2.json k48-fp8mm-nock), 2026-11-28
    # 2 H200s each capped as an 80 GB card (benchmarks/multi_gpu.py QF2, 8 steps), the larger rank's, 2026-11-28
    "qwen-image-full-2x80gb": (60.463, 65.102),
    "qwen-image-lora-48gb": (35.672, 36.398),  # 3 steps, as shipped, 2026-11-28
    "flux2-klein-4b-full-24gb": (9.826, 10.68),  # 3 steps (card_fit_flux2.json f4-24-full), 2026-11-28
    "flux2-dev-lora-24gb": (18.916, 20.99),  # 3 steps (card_fit_flux2.json fdev-24-int4-bs20), 2026-11-28
    "flux2-dev-lora-16gb": (12.517, 13.979),  # 3 steps (card_fit_flux2.json fdev-16-int4-bs48), 2026-11-28
    "flux2-klein-9b-lora-24gb": (21.553, 22.248),  # 3 steps (card_fit_flux2.json k9-24-fp8-ck2), 2026-11-28
    "flux2-klein-9b-lora-48gb": (38.731, 39.248),  # 3 steps (card_fit_flux2.json k9-48-bf16-nock), 2026-11-28
    "flux2-klein-4b-lora-24gb": (20.067, 20.645),  # 3 steps (card_fit_flux2.json k4-24-bf16-nock), 2026-11-28
    "qwen-image-2.1-lora-24gb": (16.448, 17.105),  # 3 steps (card_fit_qwen_image.json q21-24-bf16-ck), 2026-11-28
    "qwen-image-2.1-lora-16gb": (9.882, 10.492),  # 3 steps (card_fit_qwen_image.json q21-16-fp8-ck), 2026-11-28
    "qwen-image-2.1-lora-12gb": (7.038, 7.572),  # 3 steps (card_fit_qwen_image.json q21-12-int4), 2026-11-28
    "qwen-image-edit-lora-80gb": (69.539, 71.066),  # 14 steps (card_fit_qwen_image.json qe80-bf16-ck2), 2026-12-02
    "flux2-dev-lora-96gb": (91.962, 92.693),  # 14 steps (card_fit_flux2.json fdev-96-bf16-ck2), 2026-12-02
}

#: eager runs (speed.compile: false, as the block swap LoRA recipes shipped on 2026-11-24; Flux's 2026-11-25), against
#: the plan of the same recipe run eagerly
MEASURED_EAGER = {
    "sdxl-lora-3gb": (1.136, 1.529),
    "sdxl-lora-4gb": (1.851, 2.258),
    "sd3-lora-4gb": (1.252, 1.408),
    "cogvideox-2b-lora-6gb": (4.611, 4.922),
    "cogvideox-5b-lora-12gb": (8.8, 9.531),
    "flux-lora-24gb": (14.71, 15.42),
    "flux-lora-16gb": (10.35, 11.28),
    "flux-lora-8gb": (3.94, 4.75),
    "flux-full-24gb": (17.36, 19.44),  # 13 blocks swapped (2026-11-27, H100)
}

#: compiled CogVideoX holds less beside its allocated peak than the eager runs the planner's reserved terms were fitted
#: to (0.16 and 0.56 GiB against 0.31 and 0.73): its plan is over by up to 15 %, never under. sdxl-lora-3gb's run
#: recorded one bucket shape (card_fit.py's 4 steps) where the plan holds the graph pool of six (sdxl-lora-4gb's pool
#: over six shapes: 0.14 GiB, against 0.09 for one): over by up to 12 %
#: memory.activations.save_attention is counted at its outputs' full size (Wan: each block's self-attention output and
#: log-sum-exp), where the runs held 70 % (1.3B) and 83 % (14B) of that more than plain checkpointing: over by up to 15 %
#: qwen-image-2.1-lora-12gb: the same activations term as the 16 GB recipe's (planned 2.90 GiB; that plan is +7.7 %
#: over its run), over an int4 model's smaller total: +10.2 %, on the safe side
RESERVED_OVER = {
    "qwen-image-2.1-lora-12gb": 0.12,
    "cogvideox-2b-lora-6gb": 0.15,
    "cogvideox-5b-lora-12gb": 0.15,
    "sdxl-lora-3gb": 0.12,
    "wan-1.3b-lora-24gb": 0.15,
    "wan-14b-lora-80gb": 0.15,
}


def test_every_gpu_tier_recipe_was_measured_as_a_card():
    tiers = {n for n in recipe_names() if re.search(r"^Tier: ", recipe_header(n), re.M) and not n.startswith("tiny")}
    assert len(tiers) == 59 and tiers <= set(MEASURED_CARD), tiers - set(MEASURED_CARD)
    # and states its host RAM peak beside the GPU's
    assert not [n for n in tiers if not re.search(r"[0-9.]+ GiB\s+(host\s+)?RSS", recipe_header(n))]


@pytest.mark.parametrize("name", sorted(MEASURED_CARD) + [f"{n} eager" for n in sorted(MEASURED_EAGER)])
def test_planner_within_ten_percent_of_the_card_measurement(name):
    recipe = name.removesuffix(" eager")
    eager = name.endswith(" eager")
    alloc, reserved = (MEASURED_EAGER if eager else MEASURED_CARD)[recipe]
    e = plan_memory(resolve(recipe=recipe, sets=["speed.compile=false"] if eager else []).config, recipe_gpus(recipe))
    assert abs(e.gpu_total - alloc) / alloc < 0.10, (e.gpu_total, alloc)
    over = 0.10 if eager else RESERVED_OVER.get(recipe, 0.10)
    assert -0.10 < (e.gpu_reserved - reserved) / reserved < over, (e.gpu_reserved, reserved)


# faster settings of issue 53's recipes, uncapped (`difftrain bench speed` at 1024x1024 as benchmarks/fast_default.py
# runs them, 14 steps; an H200, 2026-12-02, docs/benchmarks.md "Qwen-Image-Edit, Qwen-Image 2.1 and FLUX.2 [dev]
# against their plain loops"): (recipe, sets) -> allocated, reserved GiB
MEASURED_UNCAPPED = {
    "qwen-image-2.1 nothing checkpointed": (
        ("qwen-image-2.1-lora-24gb", ["memory.activations.kind=none"]),
        (37.01, 38.91),
    ),
    "qwen-image-2.1 every second block checkpointed": (
        ("qwen-image-2.1-lora-24gb", ["memory.activations.every=2"]),
        (26.67, 27.59),
    ),
    "qwen-image-edit fp8, every second block": (
        ("qwen-image-edit-lora-24gb", ["memory.weights.kind=fp8", "memory.activations.every=2"]),
        (50.36, 52.14),
    ),
    "flux2-dev bf16, every block": (
        ("flux2-dev-lora-24gb", ["memory.weights.kind=bf16", "memory.offload.kind=none"]),
        (67.17, 69.27),
    ),
    "flux2-dev fp8, every second block": (
        ("flux2-dev-lora-24gb", ["memory.weights.kind=fp8", "memory.offload.kind=none", "memory.activations.every=2"]),
        (62.51, 63.62),
    ),
}


@pytest.mark.parametrize("name", sorted(MEASURED_UNCAPPED))
def test_planner_is_not_under_the_uncapped_runs_of_faster_settings(name):
    # a plan under a run is the one that lets a user pick a config that does not fit: at most 5 % under here (Qwen-Image
    # 2.1's figure without checkpointing, estimated from Krea 2's, planned these 6 % and 8 % under before it was
    # refitted to them), at most 10 % over
    (recipe, sets), (alloc, reserved) = MEASURED_UNCAPPED[name]
    e = plan_memory(resolve(recipe=recipe, sets=["data.resolution=1024", *sets]).config)
    assert -0.05 < (e.gpu_total - alloc) / alloc < 0.10, (e.gpu_total, alloc)
    assert -0.05 < (e.gpu_reserved - reserved) / reserved < 0.10, (e.gpu_reserved, reserved)


# DeepSpeed on one H100 (benchmarks/memory_tiers.py --cases F6,F7,L12, 2026-11-24): allocated, reserved GiB
MEASURED_DEEPSPEED = {
    "L12": (
        [
            "train.method=lora",
            "memory.weights.kind=bf16",
            "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: none}",
        ],
        (5.893, 6.371),
    ),
    "F6": (
        [
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer.kind=adamw",
            "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: cpu}",
        ],
        (9.633, 14.754),
    ),
    "F7": (
        [
            "train.method=full",
            "memory.weights.kind=bf16",
            "memory.optimizer.kind=adamw",
            "memory.engine={kind: deepspeed, stage: 3, offload_optimizer_device: cpu, offload_param_device: cpu}",
        ],
        (2.784, 3.389),
    ),
}


@pytest.mark.parametrize("case", sorted(MEASURED_DEEPSPEED))
def test_planner_within_ten_percent_of_deepspeed(case):
    sets, (alloc, reserved) = MEASURED_DEEPSPEED[case]
    cfg = resolve(
        sets=["model.config=sdxl-base-1.0", "lora.rank=16", "data.resolution=1024", "train.mixed_precision=bf16", *sets]
    ).config
    e = plan_memory(cfg)
    assert abs(e.gpu_total - alloc) / alloc < 0.10, (e.gpu_total, alloc)
    assert abs(e.gpu_reserved - reserved) / reserved < 0.10, (e.gpu_reserved, reserved)


def test_cuda_graphs_pool_is_reserved_where_graphs_may_be_recorded():
    """sdxl-lora-8gb as shipped (speed auto) may record CUDA graphs: their pool (+0.3 GiB reserved over six buckets on
    the H100) is in the reserved peak and the card's total, not in the allocated peak; graphs switched off, block swap
    or the CPU leave it out."""
    from difftrain.speed.auto import graphs_possible as graphs_expected

    def plan(*sets):
        cfg = resolve(recipe="sdxl-lora-8gb", sets=list(sets)).config
        return cfg, plan_memory(cfg)

    cfg, auto = plan()
    _, off = plan("speed.cuda_graphs=false")
    assert graphs_expected(cfg) and auto.graph_pool == pytest.approx(0.3)
    # where graphs may be recorded the activations are counted as compiled blocks hold them (9-11 % less measured)
    assert auto.gpu["activations"] == pytest.approx(COMPILED_ACTIVATIONS * off.gpu["activations"])
    assert {k: v for k, v in auto.gpu.items() if k != "activations"} == pytest.approx(
        {k: v for k, v in off.gpu.items() if k != "activations"}
    )
    shrink = (1 - COMPILED_ACTIVATIONS) * off.gpu["activations"]
    assert auto.gpu_reserved - off.gpu_reserved == pytest.approx(0.3 - shrink * 1.14)
    assert auto.card_total - off.card_total == pytest.approx(0.3 - shrink * 1.14)
    assert any("CUDA graphs" in n for n in auto.notes) and not any("CUDA graphs" in n for n in off.notes)
    for sets in (("speed.compile=false",), ("train.device=cpu",)):
        c, e = plan(*sets)
        assert not graphs_expected(c) and e.graph_pool == 0.0, sets
    # LoRA's block swap records only the blocks' forward: half the pool (measured 0.09-0.14 GiB)
    c, swap = plan("memory.offload={kind: block_swap, blocks_to_swap: 8}")
    assert graphs_expected(c) and swap.graph_pool == pytest.approx(0.15)
    # the card's promise still holds with the pool counted (measured 6.60 GiB reserved capped as an 8 GB card)
    assert auto.card_total < 8.0


def test_per_gpu_terms_on_several_processes():
    """One GPU's share of N: DDP adds its gradient buckets (a second copy of the gradients); ZeRO-2 divides the
    optimizer state and the gradients; ZeRO-3 the weights too, past what it gathers live."""
    h = _hints(parts={"unet": {"total": 4 * 10**9}}, largest_param=10**7)
    full = ["train.method=full", "memory.weights.kind=bf16", "train.mixed_precision=bf16"]
    ddp = resolve(sets=full).config
    one, two = estimate(ddp, h), estimate(ddp, h, processes=2)
    assert "DDP gradient buckets" not in one.gpu
    assert two.gpu["DDP gradient buckets"] == pytest.approx(one.gpu["gradients"])
    assert two.gpu_total == pytest.approx(one.gpu_total + one.gpu["gradients"])
    z2 = resolve(sets=[*full, "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: none}"]).config
    a, b = estimate(z2, h), estimate(z2, h, processes=4)
    assert b.gpu["optimizer state"] == pytest.approx(a.gpu["optimizer state"] / 4)
    assert b.gpu["gradients"] * GIB == pytest.approx(4e9 * 2 / 4 + ZERO_BUCKET * 2)
    assert b.gpu["weights"] == pytest.approx(a.gpu["weights"])  # stage 2 keeps the weights whole
    z3 = resolve(sets=[*full, "memory.engine={kind: deepspeed, stage: 3, offload_optimizer_device: none}"]).config
    c = estimate(z3, h, processes=4)
    assert c.gpu["weights"] * GIB == pytest.approx(4e9 * 2 / 4 + ZERO3_MAX_LIVE * 2 + ZERO_BUCKET * 2)
    assert "not measured" in " ".join(c.notes)


@pytest.mark.slow
def test_plan_for_several_gpus_searches_the_zero_stages_through_the_console_script():
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(sys.executable).parent / "difftrain")
    import os

    env = {**os.environ, "COLUMNS": "200"}  # rich wraps the table's title at a pipe's 80 columns
    r = subprocess.run([script, "plan", "--recipe", "sdxl-full", "--gpus", "2", "--vram", "16GiB"],
                       capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "one of 2 GPUs (deepspeed)" in out and "engine auto: DeepSpeed ZeRO-2" in out  # what train would pick
    said = " ".join(out.split())  # the scaling, said: offloaded ZeRO-2 is not measured on several GPUs
    assert "expected per GPU: ZeRO-2 with the optimizer offloaded not measured on several GPUs" in said
    assert "memory.engine={kind: deepspeed" in out and "fused_backward=true" not in out  # no DDP fits 16 GiB
    from difftrain.memory.planner import candidates

    cfg = resolve(recipe="sdxl-full").config
    engines = [c["memory"].get("engine") for c in candidates(cfg, processes=2)]
    assert {(e["kind"], e.get("stage")) for e in engines if e} == {("fsdp", None), ("deepspeed", 2), ("deepspeed", 3)}
    assert not any(c["memory"].get("engine") for c in candidates(cfg))  # one GPU: ZeRO is not offered
    fused = subprocess.run([script, "plan", "--recipe", "sdxl-full-12gb", "--gpus", "2"], capture_output=True,
                           text=True, timeout=300, env=env)  # fmt: skip
    assert fused.returncode == 0 and "memory.fused_backward on 2 processes" in fused.stdout + fused.stderr
    # the search on a recipe with fused backward and block swap: its ZeRO candidates drop both (DeepSpeed refuses them)
    r = subprocess.run([script, "plan", "--recipe", "sdxl-full-12gb", "--gpus", "2", "--vram", "12GiB"],
                       capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert "memory.engine={kind: deepspeed" in r.stdout and "memory.fused_backward=false" in r.stdout
    assert "memory.offload={kind: none}" in r.stdout


@pytest.mark.slow
def test_engine_auto_chooses_ddp_where_a_replica_fits_else_the_first_zero_stage_that_does():
    from difftrain.planning.engines import choose_engine

    full = resolve(recipe="sdxl-full").config  # AdamW8bit, checkpointing: ~22 GiB a replica on 2 GPUs
    assert full.memory.engine.kind == "auto"
    one, line = choose_engine(full, 1, 80.0)
    assert one.memory.engine.kind == "single" and line is None
    big, line = choose_engine(full, 2, 80.0)
    assert big.memory.engine.kind == "ddp" and "a replica fits each GPU" in line
    assert big.memory.optimizer.kind == "adamw8bit"  # the config's own techniques, untouched
    small, line = choose_engine(full, 2, 16.0)
    e = small.memory.engine
    assert (e.kind, e.stage) == ("deepspeed", 2) and "a replica does not fit" in line
    assert small.memory.optimizer.kind == "adamw" and "replaces memory.optimizer adamw8bit" in line
    assert plan_memory(small, 2).card_total <= 16.0 < plan_memory(big, 2).card_total
    # four such GPUs: FSDP's shares fit, and FSDP is the fastest sharded engine measured (before ZeRO-2)
    four, line = choose_engine(full, 4, 16.0)
    assert four.memory.engine.kind == "fsdp" and "FSDP (torch's sharding" in line and "12.7 GiB" in line
    assert four.memory.optimizer.kind == "adamw" and plan_memory(four, 4).card_total <= 16.0
    assert four.memory.engine.reshard_after_forward is True  # compiled, resharding measured faster than keeping
    wide, _ = choose_engine(full, 8, 16.0)  # more GPUs: the same first choice (it fits more easily)
    assert wide.memory.engine.kind == "fsdp" and wide.memory.engine.reshard_after_forward is True
    # what FSDP cannot train goes to ZeRO, and the line says why the faster engine was passed over
    shown, line = choose_engine(resolve(recipe="sdxl-full", sets=["validation.prompts=[a cat]"]).config, 4, 16.0)
    assert shown.memory.engine.kind == "deepspeed" and "FSDP, faster, was not taken" in line
    assert "validation.prompts" in line
    # a config DDP cannot train on several processes (fused backward) goes to a sharded engine where it fits
    fused, line = choose_engine(resolve(recipe="sdxl-full-12gb").config, 2, 24.0)
    assert fused.memory.engine.kind == "fsdp" and not fused.memory.fused_backward
    assert "DDP cannot train it (memory.fused_backward" in line
    # without a CUDA GPU there is nothing to weigh: DDP; and for what DDP cannot train, no choice (the caller refuses)
    lora = resolve(recipe="sdxl-lora-8gb").config
    assert choose_engine(lora, 2, None)[0].memory.engine.kind == "ddp"
    cpu_fused, line = choose_engine(resolve(recipe="sdxl-full-12gb").config, 2, None)
    assert cpu_fused.memory.engine.kind == "single" and line is None
    # a LoRA is never sharded: DDP, said to fit nowhere
    tight, line = choose_engine(lora, 2, 2.0)
    assert tight.memory.engine.kind == "ddp" and "nothing is planned to fit 2 GiB" in line
    # a named engine is kept
    named = resolve(recipe="sdxl-full", sets=["memory.engine.kind=single"]).config
    assert choose_engine(named, 2, 16.0) == (named, None)


def test_engine_auto_keeps_the_engine_a_resumed_checkpoint_was_made_with():
    from difftrain.planning.engines import choose_engine

    full = resolve(recipe="sdxl-full").config
    z3 = {"kind": "deepspeed", "stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "none",
          "config_file": None}  # fmt: skip
    kept, line = choose_engine(full, 1, 80.0, recorded=z3)  # even on one process: its state is DeepSpeed's
    assert (kept.memory.engine.kind, kept.memory.engine.stage) == ("deepspeed", 3) and "as the checkpoint" in line
    ddp, line = choose_engine(full, 4, 16.0, recorded={"kind": "ddp", "bucket_cap_mb": 25.0})
    assert ddp.memory.engine.kind == "ddp" and "torch's optimizer state" in line  # not ZeRO, though it would fit
    assert choose_engine(full, 1, 80.0, recorded={"kind": "single"})[0].memory.engine.kind == "single"


def test_plan_says_what_is_measured_of_each_engines_scaling():
    from difftrain.planning.engines import choose_engine, expected_scaling

    lora = resolve(recipe="sdxl-lora-8gb").config
    assert expected_scaling(lora, 1) is None
    ddp, _ = choose_engine(lora, 2, 80.0)
    assert "81 % on H100s, 86-98 % on H200s" in expected_scaling(ddp, 2) and "94 % at 4" in expected_scaling(ddp, 4)
    full = resolve(recipe="sdxl-full", sets=["memory.engine={kind: ddp}"]).config
    assert "0.90x at 2 H100s" in expected_scaling(full, 2) and "0.99x compiled with CUDA graphs" in expected_scaling(
        full, 2
    )

    def engine(e, *more):
        sets = [f"memory.engine={{{e}}}", "memory.optimizer.kind=adamw", "train.mixed_precision=bf16", *more]
        return resolve(recipe="sdxl-full", sets=sets).config

    z3 = "kind: deepspeed, stage: 3, offload_optimizer_device: none"
    assert "0.44x with SDXL's tuned settings" in expected_scaling(engine(z3), 2)
    assert "0.49-0.62x DDP's step with torch's own linear" in expected_scaling(engine(z3), 2)
    assert "0.24x with DeepSpeed's own" in expected_scaling(engine(z3 + ", family_settings: false"), 2)
    flux = engine(z3, "family=flux", "model.config=flux-dev")  # nothing tuned for Flux: SDXL's untuned figure
    assert "0.24x with DeepSpeed's own" in expected_scaling(flux, 2)
    assert "0.62x" in expected_scaling(engine("kind: deepspeed, stage: 2, offload_optimizer_device: none"), 2)
    assert "offloaded not measured" in expected_scaling(engine("kind: deepspeed, stage: 2"), 2)
    assert "~0.67x" in expected_scaling(engine("kind: fsdp"), 2) and "0.65x one GPU's recipe compiled" in (
        expected_scaling(engine("kind: fsdp"), 2)
    )
    assert "~0.72x" in expected_scaling(engine("kind: fsdp, reshard_after_forward: false"), 2)
    assert "(1.26x its eager step)" in expected_scaling(engine("kind: fsdp"), 2)
    assert "not measured on GPUs" in expected_scaling(engine("kind: fsdp, offload_params: true"), 2)


def test_fsdp_plan_shards_weights_gradients_and_adamw_over_the_gpus():
    """memory.engine fsdp: each GPU's fp32 master, gradient and AdamW shares shrink with the GPU count; what is
    gathered whole (the root and two blocks, in bf16) does not."""
    from difftrain.planning.estimate import plan_memory

    def est(n, **extra):
        sets = ["memory.engine={kind: fsdp}", "memory.optimizer.kind=adamw"] + [f"{k}={v}" for k, v in extra.items()]
        return plan_memory(resolve(recipe="sdxl-full", sets=sets).config, processes=n)

    one, two, four = est(1), est(2), est(4)
    assert one.gpu["optimizer state"] == pytest.approx(2 * two.gpu["optimizer state"], rel=1e-6)
    assert two.gpu["optimizer state"] == pytest.approx(2 * four.gpu["optimizer state"], rel=1e-6)
    assert one.gpu["optimizer state"] == pytest.approx(2.567e9 * 8 / 2**30, rel=0.01)  # SDXL's AdamW moments, fp32
    assert one.gpu["weights"] > two.gpu["weights"] > four.gpu["weights"] > 0
    keep = est(2, **{"memory.engine.reshard_after_forward": "false"})
    assert keep.gpu["weights"] > two.gpu["weights"]  # every block stays gathered between forward and backward
    off = est(2, **{"memory.engine.offload_params": "true"})
    assert off.gpu["optimizer state"] == 0 and off.host["FSDP shares (weights, gradients, AdamW)"] > 10


@pytest.mark.slow
def test_plan_with_vram_says_what_precompute_encodes_at_a_time_through_the_console_script():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(sys.executable).parent / "difftrain")
    env = {**os.environ, "COLUMNS": "300"}

    def plan(*args):
        r = subprocess.run([script, "plan", *args], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
        return " ".join((r.stdout + r.stderr).split())

    assert "the VAE encodes 2 1024x1024 image(s) at a time in bf16" in plan(
        "--recipe", "sdxl-lora-8gb", "--vram", "8gb"
    )
    assert "encodes 4 1024x1024 image(s) at a time" in plan("--recipe", "sdxl-lora-8gb", "--vram", "80gb")
    out = plan("--recipe", "sd3-lora-4gb", "--vram", "4gb", "--set", "precompute.vae_dtype=fp32")
    assert "one 1024x1024 image needs ~3.3 GiB with the VAE in fp32" in out and "vae_dtype: bf16" in out
    # T5-XXL's stage: nf4 measured 4.4 GiB, over what a 4 GB card leaves; int8 fits an 8 GB card
    assert "T5-XXL in nf4 takes ~4.4 GiB (measured), more than the 2.95 GiB" in out
    assert "T5-XXL in int8 fits this card" in plan("--recipe", "sd3-lora-8gb", "--vram", "8gb")


def test_plans_search_ranks_the_sharded_engines_as_measured():
    """plan --gpus N ranks what fits by speed_cost: on several GPUs, in the order measured on 2 GPUs (SDXL full):
    FSDP (compiled, resharding was faster than keeping gathered weights), FSDP keeping them, ZeRO-2, ZeRO-3 with
    the family's tuned settings, ZeRO-3 without them."""
    from difftrain.memory.planner import speed_cost

    def cost(engine, tuned=True):
        sets = [f"memory.engine={{{engine}}}", "memory.optimizer.kind=adamw", "train.mixed_precision=bf16"]
        return speed_cost(resolve(recipe="sdxl-full", sets=sets).config, 2, zero3_tuned=tuned)

    z3 = "kind: deepspeed, stage: 3, offload_optimizer_device: none"
    order = [cost("kind: fsdp"), cost("kind: fsdp, reshard_after_forward: false"),
             cost("kind: deepspeed, stage: 2, offload_optimizer_device: none"), cost(z3), cost(z3, tuned=False)]  # fmt: skip
    assert order == sorted(order) and len(set(order)) == 5
    assert cost(z3 + ", family_settings: false") == cost(z3, tuned=False)  # the user's choice of DeepSpeed's own


def test_split_checkpoints_plan_their_own_measurement_where_the_architecture_has_one():
    """memory.activations.split takes the architecture's checkpoint_split figure (Wan's segments); without it, or
    where an architecture has none (Flux), the whole blocks' checkpoint figure."""
    split = plan_memory(resolve(recipe="wan-1.3b-lora-8gb").config)
    whole = plan_memory(resolve(recipe="wan-1.3b-lora-8gb", sets=["memory.activations.split=false"]).config)
    assert 0 < split.gpu["activations"] < whole.gpu["activations"]
    flux = plan_memory(resolve(recipe="flux-lora-24gb").config)
    flux_split = plan_memory(resolve(recipe="flux-lora-24gb", sets=["memory.activations.split=true"]).config)
    assert flux.gpu["activations"] > 0 and flux_split.gpu["activations"] == pytest.approx(flux.gpu["activations"])


def test_fsdp_shares_follow_the_master_dtype_and_the_optimizers_bits():
    """memory.engine fsdp's shares per GPU: bf16 master weights and gradients are half fp32's, torchao's 8-bit AdamW
    moments a quarter of torch's fp32 ones (a scale per 256 values beside them); qwen-image-full-2x80gb's plan on
    its 2 GPUs is what 2 H200s capped as 80 GB cards measured within 10 % (MEASURED_CARD), and on one GPU it is
    over the card."""
    fp32 = ["memory.engine.master_dtype=fp32", "memory.optimizer.kind=adamw"]
    ours = resolve(recipe="qwen-image-full-2x80gb").config
    theirs = resolve(recipe="qwen-image-full-2x80gb", sets=fp32).config
    a, b = plan_memory(ours, 2), plan_memory(theirs, 2)
    import torch

    from difftrain.families.registry import get_family

    fam = get_family("qwen-image")
    with torch.device("meta"):  # the real architecture's count, no weight made
        numel = sum(p.numel() for p in fam.empty_part(ours.model, fam.denoiser).parameters())
    assert b.gpu["weights"] - a.gpu["weights"] == pytest.approx(numel * 2 / 2 / GIB, rel=1e-6)
    assert b.gpu["gradients"] - a.gpu["gradients"] == pytest.approx(numel * 2 / 2 / GIB, rel=1e-6)
    assert b.gpu["optimizer state"] / a.gpu["optimizer state"] == pytest.approx(8 / (2 + 8 / 256), rel=1e-6)
    assert plan_memory(ours, 1).card_total > 80 > a.card_total


def test_a_model_folder_without_its_vae_is_planned_at_the_bundled_vaes_factor(tmp_path):
    """bench's random folders hold only what training loads (no vae/): Qwen-Image 2.1's 16x VAE was then planned as
    8x, four times the activations (+8.7 GiB against the run on an H200, 2026-11-28). A folder's own VAE config still
    decides where it has one."""
    import json
    import shutil

    from difftrain.families.registry import get_family

    family = get_family("qwen-image-2.1")
    bundled = family.bundled("qwen-image-2.1")
    folder = tmp_path / "random"
    shutil.copytree(bundled / "transformer", folder / "transformer")
    cfg = resolve(
        recipe="tiny-qwen-image-2.1-lora",
        sets=["model.config=qwen-image-2.1", "data.max_side=2048", "data.resolution=1024"],
    ).config
    plain = plan_memory(cfg)
    cfg_folder = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": folder})})
    assert plan_memory(cfg_folder).gpu["activations"] == pytest.approx(plain.gpu["activations"])
    # a folder's own VAE config (here one that states 8x) is what the plan reads
    (folder / "vae").mkdir()
    vae = json.loads((bundled / "vae" / "config.json").read_text())
    (folder / "vae" / "config.json").write_text(json.dumps({**vae, "scale_factor_spatial": 8}))
    assert plan_memory(cfg_folder).gpu["activations"] == pytest.approx(4 * plain.gpu["activations"])
