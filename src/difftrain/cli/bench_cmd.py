"""difftrain bench memory"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from typing_extensions import Annotated

from ..console import console
from .common import resolved_config
from .options import ConfigOpt, RecipeOpt, SetOpt

app = typer.Typer(help="Measure a config on this machine.", no_args_is_help=True)


@app.command("memory")
def memory(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="training steps (the first two count as warm-up)")] = 6,
    work: Annotated[Optional[Path], typer.Option("--work", help="folder for the random model and cache (reused)")] = None,
) -> None:
    """Train a config for a few steps on random data of the real shapes; print peak memory, step time and the plan."""
    from ..bench import bench_memory

    cfg = resolved_config(recipe, config, set_).config
    folder = work or Path(tempfile.mkdtemp(prefix="difftrain-bench-"))
    r = bench_memory(cfg, folder, steps)
    t = Table(title=f"bench memory: {recipe or config or 'config'} ({steps} steps)")
    t.add_column("what")
    t.add_column("measured", justify="right")
    t.add_column("planned", justify="right")
    fmt = lambda v: "n/a (no GPU)" if v is None else f"{v:.2f} GiB"  # noqa: E731
    t.add_row("peak before training (weights loaded)", fmt(r.peak_after_load_gib), "")
    t.add_row("peak of training, allocated", fmt(r.peak_train_alloc_gib), f"{r.planned_alloc_gib:.2f} GiB")
    t.add_row("peak of training, reserved", fmt(r.peak_train_reserved_gib), f"{r.planned_reserved_gib:.2f} GiB")
    t.add_row("with validation / after testing", "n/a (validation samples are not available yet)", "")
    t.add_row("step time (median)", f"{r.s_per_step:.3f} s", "")
    t.add_row("host RSS peak", f"{r.stats.get('peak_rss_gib_train', 0):.2f} GiB", "")
    console.print(t)
