"""A tier is the card (issue 23): the planner's card terms, the card size parser, what a card leaves to torch, and
`bench memory --card` / `plan --vram` through the real console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from difftrain.config.load import resolve
from difftrain.memory import card
from difftrain.planning.estimate import plan_memory

# the console script the package installs; the GPU machine runs the tree from PYTHONPATH, without one
_SCRIPT = Path(sys.executable).with_name("difftrain")
DIFFTRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "difftrain"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DIFFTRAIN, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("text", "gib"), [("4gb", 4.0), ("8GB", 8.0), ("12 GiB", 12.0), ("24", 24.0), ("5.5g", 5.5), ("6Gi", 6.0)]
)
def test_parse_card(text, gib):
    assert card.parse_card(text) == gib


@pytest.mark.parametrize("text", ["", "lots", "4tb", "0gb", "-4gb", "4 gb 8"])
def test_parse_card_refuses(text):
    with pytest.raises(ValueError, match="write it like 4gb"):
        card.parse_card(text)


def test_stored_overhead_by_name_else_the_largest(tmp_path, monkeypatch):
    rows = {"H100": {"context_gib": 0.5, "libraries_gib": 0.25}, "RTX 4060": {"context_gib": 0.3, "libraries_gib": 0.1}}
    f = tmp_path / "card_overhead.json"
    f.write_text(json.dumps({"devices": rows}))
    monkeypatch.setattr(card, "_MEASURED", f)
    o = card.stored_overhead("NVIDIA GeForce RTX 4060 Laptop GPU")
    assert (o.context_gib, o.libraries_gib, o.source) == (0.3, 0.1, "RTX 4060")
    o = card.stored_overhead("NVIDIA GeForce GTX 1650")  # not measured: the most the context was seen to take
    assert (o.total_gib, o.source) == (0.75, "H100 (largest measured)")
    assert card.stored_overhead().total_gib == 0.75


def test_the_shipped_measurement_is_read():
    o = card.stored_overhead("NVIDIA H100 80GB HBM3")
    assert o.source == "H100" and 0.3 < o.total_gib < 1.5  # a CUDA context is hundreds of MiB, never zero


def test_allocator_budget_takes_the_context_libraries_and_display_off():
    o = card.Overhead(0.5, 0.25, "test")
    assert card.allocator_budget(4, o) == pytest.approx(4 - 0.75 - card.DISPLAY_MARGIN_GIB)
    assert card.allocator_budget(4, o, display=False) == pytest.approx(3.25)


def test_estimate_card_total_and_what_must_be_free():
    e = plan_memory(resolve(recipe="sdxl-lora-8gb").config)
    terms = card.card_terms()
    assert set(e.card) == {card.CONTEXT, card.LIBRARIES, card.DISPLAY} and e.card == terms
    assert e.card_total == pytest.approx(e.gpu_reserved + sum(terms.values()))
    # once this process has its context (what mem_get_info sees), the display is already out of the free figure
    assert e.free_needed == pytest.approx(e.gpu_reserved + terms[card.LIBRARIES])
    assert e.gpu_reserved < e.free_needed < e.card_total


def test_largest_term_names_the_technique_that_cuts_it():
    from difftrain.flows.bench import largest_term

    e = plan_memory(resolve(recipe="sdxl-full").config)
    name = max(e.gpu, key=lambda k: e.gpu[k])
    advice = largest_term(e)
    assert advice.startswith(f"{name} ({e.gpu[name]:.2f} GiB planned)") and "memory." in advice


@pytest.mark.slow
def test_plan_prints_the_card_rows_and_fits_the_whole_card():
    p = _run("plan", "--recipe", "sdxl-lora-8gb")
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    e = plan_memory(resolve(recipe="sdxl-lora-8gb").config)
    for row in (card.CONTEXT, card.LIBRARIES, card.DISPLAY, "total on the card"):
        assert row in out
    assert f"{e.card_total:.2f}" in out
    # --vram is the card: a plan whose torch reservation alone would fit but whose card total does not is refused
    limit = (e.gpu_reserved + e.card_total) / 2
    p = _run("plan", "--recipe", "sdxl-lora-8gb", "--set", "memory.offload.kind=none", "--vram", f"{limit:.2f}GiB")
    assert p.returncode == 0, p.stderr
    picked = resolve(recipe="sdxl-lora-8gb", sets=[ln.split(" ", 1)[1].strip("'") for ln in p.stdout.splitlines()])
    assert plan_memory(picked.config).card_total <= limit
    assert "on the card" in p.stderr and "reserved by torch" in p.stderr


@pytest.mark.slow
def test_bench_memory_card_needs_a_cuda_gpu(tmp_path):
    p = _run("bench", "memory", "--recipe", "tiny-sdxl-lora", "--card", "4gb", "--steps", "2", "--work", str(tmp_path))
    assert p.returncode == 2, p.stderr
    assert "no CUDA GPU" in p.stderr and "difftrain plan --vram" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_bench_memory_card_refuses_a_size_it_cannot_read(tmp_path):
    p = _run("bench", "memory", "--recipe", "tiny-sdxl-lora", "--card", "big", "--work", str(tmp_path))
    assert p.returncode == 2 and "--card" in p.stderr and "write it like 4gb" in p.stderr
    assert "Traceback" not in p.stderr and not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.gpu
def test_bench_memory_card_on_cuda(tmp_path):
    """The tiny recipe fits a 4 GB card with room; a card smaller than the context itself does not, and says which
    term to cut."""
    js = tmp_path / "r.json"
    p = _run(
        "bench",
        "memory",
        "--recipe",
        "tiny-sdxl-lora",
        "--set",
        "train.device=cuda",
        "--card",
        "4gb",
        "--steps",
        "3",
        "--work",
        str(tmp_path / "w"),
        "--json",
        str(js),
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(js.read_text())["card"]
    assert r["fits"] and r["overhead"]["context_gib"] > 0 and r["budget_gib"] < 4 - 0.3
    assert 0 < r["headroom_gib"] < r["budget_gib"]
    p = _run(
        "bench",
        "memory",
        "--recipe",
        "tiny-sdxl-lora",
        "--set",
        "train.device=cuda",
        "--card",
        "1.05gb",
        "--steps",
        "3",
        "--work",
        str(tmp_path / "w"),
        "--json",
        str(js),
    )
    assert p.returncode == 1 and "does not fit" in p.stderr and "cut first" in p.stderr, p.stderr
    assert json.loads(js.read_text())["card"]["fits"] is False


@pytest.mark.slow
def test_a_renamed_tier_says_where_it_went():
    old, new = "sdxl-lora-2gb", "sdxl-lora-3gb"
    p = _run("plan", "--recipe", old)
    assert p.returncode == 2 and f"is now {new!r}" in p.stderr and f"--recipe {new}" in p.stderr
    assert "2 GB card" in p.stderr and "Traceback" not in p.stderr
    assert _run("plan", "--recipe", new).returncode == 0


@pytest.mark.parametrize("old", ["sdxl-full-3gb", "sdxl-full-2gb"])  # the second was renamed to the first before
def test_a_retired_recipe_says_why_and_what_to_use(old):
    p = _run("train", "--recipe", old, "--data-dir", "nowhere")
    assert p.returncode == 2 and f"{old!r} was retired" in p.stderr and "26 GiB of host RAM" in p.stderr, p.stderr
    assert "--recipe sdxl-full-8gb" in p.stderr and "Traceback" not in p.stderr


def test_expandable_segments_is_set_only_on_cuda(monkeypatch):
    import torch

    from difftrain.trainers import setup

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(setup.dist_, "init", lambda world, device: None)
    cfg = resolve(recipe="cogvideox-2b-lora-6gb").config
    assert cfg.memory.expandable_segments  # the 6 GB tier measured to need it
    no_cap = cfg.model_copy(update={"train": cfg.train.model_copy(update={"gpu_memory_limit_gib": None})})
    setup.prepare_process(no_cap, setup.dist_.World(), torch.device("cpu"))
    assert calls == []
    setup.prepare_process(
        no_cap, setup.dist_.World(), torch.device("cuda", 0)
    )  # nothing else in it touches the GPU without a cap
    assert calls == ["expandable_segments:True"]
    off = no_cap.model_copy(update={"memory": cfg.memory.model_copy(update={"expandable_segments": False})})
    setup.prepare_process(off, setup.dist_.World(), torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]


def test_the_gpu_cap_is_the_limit_over_the_cards_memory_and_only_on_cuda(monkeypatch):
    import types

    import torch

    from difftrain import utils

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, idx: calls.append((f, idx)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx: types.SimpleNamespace(total_memory=80 * 2**30))
    utils.cap_gpu_memory(torch.device("cuda", 1), 1.95)  # a 3 GB card's share of an 80 GiB GPU
    assert calls == [(pytest.approx(1.95 / 80), 1)]
    utils.cap_gpu_memory(torch.device("cuda", 0), 120.0)  # more than the GPU has: the whole of it, not above
    assert calls[-1] == (1.0, 0)
    utils.cap_gpu_memory(torch.device("cuda", 0), None)
    utils.cap_gpu_memory(torch.device("cpu"), 1.95)
    assert len(calls) == 2


@pytest.mark.slow  # three plan searches in subprocesses (~35 s); the fast tier searches in test_plan_prints_...
def test_plan_searches_the_card_and_the_host_ram():
    """--ram: a plan must fit both. SDXL's full fine-tune on an 8 GB card needs host RAM for swapped blocks (6.8 GiB
    with Adafactor and half the blocks swapped) or the CPU-offload optimizer (~25 GiB), so 4 GiB of RAM has no plan and
    16 GiB has Adafactor with block swap; a 12 GB card with 16 GiB of RAM gets Adafactor too."""
    p = _run("plan", "--recipe", "sdxl-full", "--vram", "8GiB", "--ram", "4GiB")
    assert p.returncode == 1 and "fit a 8 GiB card with 4 GiB of host RAM" in p.stderr and "or more RAM" in p.stderr
    for vram, ram, kind in (("8GiB", "16GiB", "adafactor"), ("12GiB", "16GiB", "adafactor")):
        p = _run("plan", "--recipe", "sdxl-full", "--vram", vram, "--ram", ram)
        assert p.returncode == 0, p.stderr
        cfg = resolve(recipe="sdxl-full", sets=[ln.split(" ", 1)[1].strip("'") for ln in p.stdout.splitlines()]).config
        e = plan_memory(cfg)
        assert (
            cfg.memory.optimizer.kind == kind and e.host_total <= float(ram[:-3]) and e.card_total <= float(vram[:-3])
        )


def test_plan_searches_offloaded_checkpoints_and_nf4_and_never_activations_it_cannot_count():
    """Wan 14B at 720x1280x81 on a 24 GB card: the planner has no measurement of Wan's blocks without checkpointing,
    so a search once 'fitted' activations none (counted as nothing). Now such candidates are skipped; with 32 GiB of
    host RAM the fit it finds keeps the checkpoints in host RAM (Wan states their bytes) over nf4 weights (fp8's
    swapped blocks do not fit the RAM beside them), as wan-14b-lora-720p-24gb ships."""
    sets = ["--set", "data.resolution=960"]
    uncapped = _run("plan", "--recipe", "wan-14b-lora-24gb", *sets, "--vram", "24GiB")
    desktop = _run("plan", "--recipe", "wan-14b-lora-24gb", *sets, "--vram", "24GiB", "--ram", "32GiB")
    for p in (uncapped, desktop):
        assert p.returncode == 0, p.stderr
        chosen = [ln.split(" ", 1)[1].strip("'") for ln in p.stdout.splitlines()]
        cfg = resolve(recipe="wan-14b-lora-24gb", sets=["data.resolution=960", *chosen]).config
        assert cfg.memory.activations.kind == "checkpoint" and cfg.memory.activations.every == 1, chosen
        e = plan_memory(cfg)
        assert not e.unknown_activations and e.card_total <= 24
    assert cfg.memory.activations.offload and cfg.memory.weights.kind == "nf4" and e.host_total <= 32, chosen
    # the offloaded candidates come only where the family states the checkpoints' bytes; a config that offloads gets
    # on-GPU candidates that say so (a candidate of the same kind merges into the config's section)
    from difftrain.memory.planner import candidates

    wan = resolve(recipe="wan-14b-lora-24gb").config
    acts = [c["memory"]["activations"] for c in candidates(wan, offload_blocks=40)]
    assert {a.get("keep_on_gpu") for a in acts if a.get("offload")} == {0, 2, 4, 8}
    assert all(a.get("offload") is False for a in acts if a["kind"] == "checkpoint" and not a.get("offload"))
    sdxl = [c["memory"]["activations"] for c in candidates(resolve(recipe="sdxl-lora-8gb").config)]
    assert not [a for a in sdxl if "offload" in a]


def test_the_language_model_stage_margins_reproduce_t5s_measured_precompute():
    """The language-model encoders' precompute is estimated as T5-XXL's was measured: the same arithmetic on T5-XXL's
    own parameters (built on the meta device) plus LLM_MARGIN_GIB gives its measured stage at each precision."""
    import torch
    from transformers import T5Config, T5EncoderModel

    from difftrain.families.common import configs_root, read_json
    from difftrain.memory.planner import T5_PRECOMPUTE_GIB, llm_stage_gib

    with torch.device("meta"):
        t5 = T5EncoderModel(T5Config(**read_json(configs_root() / "flux-dev" / "text_encoder_2" / "config.json")))
    linear = sum(m.weight.numel() for m in t5.modules() if isinstance(m, torch.nn.Linear))
    other = sum(p.numel() for p in t5.parameters()) - linear
    for prec in ("int8", "nf4", "bf16"):
        got = llm_stage_gib(linear, other, prec, other_bytes=2)  # T5's other parameters in bf16
        assert got == pytest.approx(T5_PRECOMPUTE_GIB[prec], abs=0.02), prec


@pytest.mark.slow  # four console processes, one building a 24 B model on the meta device
def test_plan_says_which_card_precomputes_a_language_model_encoder():
    """FLUX.2 [dev]'s Mistral 3 (24 B, of which precompute loads the 31 layers the pipeline taps: 19.0 B): in nf4 a
    12 GB card cannot hold its precompute stage and a 16 GB card can; in int8 a 16 GB card cannot, and the note names
    nf4, and a 24 GB card can. Estimated from its parameters (no GPU measurement yet)."""
    base = ["--recipe", "tiny-flux2-lora", "--set", "model.config=flux2-dev", "--set", "data.max_side=2048",
            "--set", "data.resolution=1024", "--set", "precompute.text_encoder_dtype=bf16"]  # fmt: skip
    cases = (("nf4", "12GiB", False), ("nf4", "16GiB", True), ("int8", "16GiB", False), ("int8", "24GiB", True))
    for prec, vram, fits in cases:
        p = _run("plan", *base, "--set", f"text_encoders.llm.precision={prec}", "--vram", vram)
        line = [ln for ln in (p.stdout + p.stderr).splitlines() if "Mistral3" in ln]
        assert line and "19.0 B" in line[0] and f"in {prec}" in line[0], p.stdout + p.stderr
        assert ("fits this card" in line[0]) == fits, line
        assert ("set text_encoders.llm.precision: nf4" in line[0]) == (prec == "int8" and not fits), line
    # a family without a language model as its text encoder says nothing of one
    p = _run("plan", "--recipe", "sd3-lora-8gb", "--vram", "8GiB")
    assert "estimated from its parameters" not in p.stdout + p.stderr


def test_expandable_segments_unset_means_on_under_zero3_only():
    deepspeed = "memory.engine={kind: deepspeed, stage: 3}"
    assert resolve(sets=["train.method=full", "memory.optimizer.kind=adamw", deepspeed]).config.memory.expandable
    zero2 = "memory.engine={kind: deepspeed, stage: 2}"
    assert not resolve(sets=["train.method=full", "memory.optimizer.kind=adamw", zero2]).config.memory.expandable
    assert not resolve(recipe="sdxl-lora-8gb").config.memory.expandable
    off = ["train.method=full", "memory.optimizer.kind=adamw", deepspeed, "memory.expandable_segments=false"]
    assert not resolve(sets=off).config.memory.expandable
