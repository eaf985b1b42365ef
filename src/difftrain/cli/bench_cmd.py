"""difftrain bench memory / speed"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import console, info
from ..errors import UsageError
from .common import resolved_config
from .options import ConfigOpt, RecipeOpt, SetOpt

app = typer.Typer(help="Measure a config on this machine.", no_args_is_help=True)


@app.command("memory")
def memory(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="training steps (--warmup of them untimed)")] = 6,
    warmup: Annotated[
        int | None,
        typer.Option(
            "--warmup",
            min=0,
            help="untimed steps first (compiling and CUDA graph recording happen here); the step time is the "
            "mean of the rest [default: 2, or 0 with --steps 1]",
        ),
    ] = None,
    work: Annotated[Path | None, typer.Option("--work", help="folder for the random model and cache (reused)")] = None,
    card: Annotated[
        str | None,
        typer.Option(
            "--card",
            help="train as a card of this size would let it, e.g. 4gb: torch's allocator is capped at the card "
            "less the CUDA context and libraries (measured now) and a display margin; exit 1 if it does not fit",
        ),
    ] = None,
    planned_steps: Annotated[
        int,
        typer.Option(
            "--planned-steps",
            help="speed auto weighs the compile time against a run of this many steps (the few steps "
            "measured here stand for a real run's)",
        ),
    ] = 2000,
    buckets: Annotated[
        str | None,
        typer.Option(
            "--buckets",
            help="HxW,HxW,...: random latents of several aspect buckets drawn in random order (image families), "
            "e.g. 1024x1024,896x1152,1152x896,832x1216,1216x832,768x1344",
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the figures here too")] = None,
) -> None:
    """Train a config for a few steps on random data of the real shapes; print peak memory, step time and the plan."""
    from ..flows.bench import bench_memory
    from ..memory.card import parse_card
    from ..utils import atomic_write_text

    try:
        card_gib = None if card is None else parse_card(card)
    except ValueError as e:
        raise UsageError(f"--card: {e}.") from None
    cfg = resolved_config(recipe, config, set_).config
    folder = work or Path(tempfile.mkdtemp(prefix="difftrain-bench-"))
    r = bench_memory(
        cfg, folder, steps, card_gib=card_gib, planned_steps=planned_steps, buckets=_buckets(buckets), warmup=warmup
    )
    t = Table(title=f"bench memory: {recipe or config or 'config'} ({steps} steps, {r.warmup} of them warm-up)")
    t.add_column("what")
    t.add_column("measured", justify="right")
    t.add_column("planned", justify="right")
    fmt = lambda v: "n/a (no GPU)" if v is None else f"{v:.2f} GiB"
    t.add_row("peak before training (weights loaded)", fmt(r.peak_after_load_gib), "")
    t.add_row("peak of training, allocated", fmt(r.peak_train_alloc_gib), f"{r.planned_alloc_gib:.2f} GiB")
    t.add_row("peak of training, reserved", fmt(r.peak_train_reserved_gib), f"{r.planned_reserved_gib:.2f} GiB")
    t.add_row(
        "step time (after the warm-up)", "did not finish" if r.s_per_step is None else f"{r.s_per_step:.3f} s", ""
    )
    t.add_row("host RSS peak", f"{r.stats.get('peak_rss_gib_train', 0):.2f} GiB", "")
    if r.speed:
        t.add_row("speed", r.speed, "")
    if r.card is not None:
        c = r.card
        t.add_row("CUDA context + libraries (measured now)", f"{c.overhead.total_gib:.2f} GiB", "")
        t.add_row(f"left to torch on a {c.card_gib:g} GiB card with a display", f"{c.budget_gib:.2f} GiB", "")
        t.add_row("total on the card", "", f"{c.planned_card_gib:.2f} GiB")
    console.print(t)
    if json_out is not None:
        atomic_write_text(json_out, json.dumps(dataclasses.asdict(r), indent=1, default=str) + "\n")
    if r.card is not None:
        if r.card.fits:
            info(f"fits a {r.card.card_gib:g} GB card: {r.card.headroom_gib:.2f} GiB of headroom under the cap")
        else:
            info(
                f"[red]does not fit a {r.card.card_gib:g} GB card[/red]: {r.card.error}\ncut first: {r.card.cut}",
                markup=True,
            )
            raise typer.Exit(1)


@app.command("speed")
def speed(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    baseline_set: Annotated[
        list[str] | None,
        typer.Option(
            "--baseline-set",
            help="key=value for the baseline only (e.g. memory.weights.kind=bf16); it runs eagerly unless "
            "speed options are named here (e.g. speed.compile=true speed.float8=false: float8 against compiled bf16)",
        ),
    ] = None,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="time the config alone")] = False,
    steps: Annotated[int, typer.Option("--steps", help="timed steps")] = 10,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed steps first (compiling happens here)")] = 3,
    work: Annotated[Path | None, typer.Option("--work", help="folder for the random model and cache (reused)")] = None,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="the last step under torch.profiler: kernel launches and "
            "GPU-busy time per run, the top kernels in WORK/profile-*.txt",
        ),
    ] = False,
    size: Annotated[
        str | None,
        typer.Option(
            "--size",
            help="HxW of the random latents' images (default: the square data.resolution), e.g. 480x720 for CogVideoX",
        ),
    ] = None,
    planned_steps: Annotated[
        int,
        typer.Option(
            "--planned-steps",
            help="speed auto weighs the compile time against a run of this many steps (the few steps "
            "measured here stand for a real run's)",
        ),
    ] = 2000,
    buckets: Annotated[
        str | None,
        typer.Option(
            "--buckets",
            help="HxW,HxW,...: random latents of several aspect buckets drawn in random order (image families), "
            "e.g. 1024x1024,896x1152,1152x896,832x1216,1216x832,768x1344",
        ),
    ] = None,
    step_times: Annotated[
        bool,
        typer.Option(
            "--step-times",
            help="wait for the GPU after every step and write each step's seconds to WORK/bench_speed.json "
            "(where a compile, a recompile or a CUDA graph recording falls; adds a sync per step)",
        ),
    ] = False,
) -> None:
    """Time a config against the eager baseline (the same config with the speed section off, or --baseline-set)
    in the same run: s/step, samples/s, model TFLOP/s and MFU against this device's measured matmul peak."""
    from ..config.load import parse_set
    from ..flows.bench import baseline_config, bench_speed

    resolved = resolved_config(recipe, config, set_)
    cfg = resolved.config
    baseline = None
    if not no_baseline:
        base_sets = list(set_ or []) + list(baseline_set or [])
        keys = [parse_set(item)[0] for item in baseline_set or []]  # the keys as resolve reads them
        named = {k[1] for k in keys if len(k) == 2 and k[0] == "speed"}
        baseline = baseline_config(resolved_config(recipe, config, base_sets).config, named)
    folder = work or Path(tempfile.mkdtemp(prefix="difftrain-bench-"))
    hw = _size(size)
    r = bench_speed(
        cfg,
        folder,
        steps,
        warmup,
        baseline,
        size=hw,
        profile=profile,
        planned_steps=planned_steps,
        buckets=_buckets(buckets),
        step_times=step_times,
    )
    _print_speed(r, recipe or config or "config", steps, warmup, folder)


def _buckets(text: str | None) -> list[tuple[int, int]] | None:
    """--buckets HxW,HxW,... as (height, width) pairs; None when not given."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        hw = _size(part.strip(), "--buckets")
        assert hw is not None
        if hw[0] % 8 or hw[1] % 8:
            raise UsageError(f"--buckets: {part.strip()} is not a multiple of 8 on both sides (latents are 1/8).")
        out.append(hw)
    return out


def _size(size: str | None, option: str = "--size") -> tuple[int, int] | None:
    """--size HxW as (height, width); None when not given."""
    if not size:
        return None
    try:
        parsed = tuple(int(v) for v in size.lower().split("x"))
        assert len(parsed) == 2 and min(parsed) > 0
    except (ValueError, AssertionError):
        raise typer.BadParameter(f"{option} {size!r}: give height x width in pixels, e.g. 480x720") from None
    return parsed  # two ints: mypy narrows the tuple by the len test


def _print_speed(r: dict, what: str | Path, steps: int, warmup: int, folder: Path) -> None:
    """bench_speed's result ``r`` for the config ``what``: the table of runs, then profiles, compile times, notes."""
    from ..flows.bench import kinds_line

    t = Table(
        title=f"bench speed: {what} on {r['device']} ({warmup} + {steps} steps; matmul peak {r['peak_tflops']} TFLOP/s)"
    )
    for col in ("run", "s/step", "samples/s", "TFLOP/s", "MFU", "step 1 s", "warm-up overhead s", "peak GiB"):
        t.add_column(col, justify="left" if col == "run" else "right")
    na = lambda v, f: "n/a" if v is None else f.format(v)
    for row in r["rows"]:
        t.add_row(
            row["name"],
            f"{row['s_per_step']:.3f}",
            f"{row['samples_per_s']:.2f}",
            na(row["tflops"], "{:.3g}"),
            na(row["mfu"], "{:.1%}"),
            f"{row['first_step_s']:.1f}",
            f"{row['warmup_overhead_s']:.1f}",
            na(row["peak_alloc_gib"], "{:.2f}"),
        )
    console.print(t)
    for row in r["rows"]:
        if row.get("speed"):
            console.print(f"{row['name']}: {row['speed']}", markup=False)
    for row in r["rows"]:
        if row["profile"] and row["profile"].get("python"):
            console.print(
                f"{row['name']}: the profiled step's Python functions by own and by total time: --work's "
                f"profile-{row['name']}.txt ({row['profile']['step_ms']:.0f} ms; DIFFTRAIN_PROFILE_PYTHON=1)"
            )
        elif row["profile"] and row["profile"].get("gpu_ms"):
            p = row["profile"]
            console.print(
                f"{row['name']}: one step launched {p['kernel_launches']} kernels"
                + (f" and {p['graph_launches']} CUDA graphs" if p.get("graph_launches") else "")
                + f", the GPU computed {p['gpu_ms']:.0f} ms of its {p['step_ms']:.0f} ms "
                f"({p['gpu_ms'] / p['step_ms']:.0%}; the profiled step runs after the timed ones), in "
                + kinds_line(p.get("by_kind", {}))
            )
    for row in r["rows"]:
        if row.get("compile") and row["compile"]["phases_s"]:
            c = row["compile"]
            console.print(
                f"{row['name']}: compiled {c['graphs']} graphs; slowest phases (nested, s): "
                + ", ".join(f"{k} {v:.1f}" for k, v in list(c["phases_s"].items())[:5])
            )
    if "speedup" in r:
        console.print(f"config vs {r['rows'][0]['name']}: {r['speedup']:.2f}x the steps per second")
    if r["flops_exact"] is False:
        console.print(
            "note: FLOPs counted with gradient checkpointing, the recomputed forwards estimated and taken off"
        )
    console.print(f"results: {folder / 'bench_speed.json'}")
