"""difftrain quickstart"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import console


def quickstart(
    out: Annotated[Path, typer.Option("--out", help="folder for everything quickstart makes")] = Path(
        "difftrain-quickstart"
    ),
    steps: Annotated[int | None, typer.Option("--steps", help="training steps (default: the recipe's)")] = None,
) -> None:
    """Run the whole flow on a tiny seeded SDXL and synthetic images: no downloads, a few minutes on a CPU."""
    from ..quickstart import run_quickstart

    r = run_quickstart(out, steps=steps)
    table = Table(title="difftrain quickstart: outputs")
    table.add_column("what", style="cyan")
    table.add_column("where")
    for k, v in r.outputs.items():
        table.add_row(k, str(v))
    console.print(table)
    times = ", ".join(f"{k} {v:.0f}s" for k, v in r.seconds.items())
    if r.losses:
        n = max(1, len(r.losses) // 5)
        first, last = sum(r.losses[:n]) / n, sum(r.losses[-n:]) / n
        console.print(f"loss {first:.4f} -> {last:.4f} over {len(r.losses)} steps")
    console.print(f"time: {times}")
