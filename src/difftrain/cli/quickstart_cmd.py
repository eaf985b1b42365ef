"""difftrain quickstart"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..console import console
from ..errors import UsageError


def quickstart(
    family: Annotated[
        str | None,
        typer.Option(
            "--family",
            help="the family whose tiny model trains (default SDXL; also SD3, CogVideoX, CogVideoX-I2V: "
            "difftrain quickstart --family cogvideox-i2v); video families train on synthetic clips, which needs "
            "the video extra: pip install 'difftrain[video]'",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="folder for everything quickstart makes (default ./difftrain-quickstart[-FAMILY])"),
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="training steps (default: the recipe's)")] = None,
) -> None:
    """Run the whole flow on a family's tiny seeded model and synthetic data: no downloads, a few minutes on a CPU."""
    from ..families.registry import DEFAULT_FAMILY, get_family
    from ..flows.quickstart import quickstart_families, run_quickstart

    family = family or DEFAULT_FAMILY
    known = quickstart_families()
    if family not in known:
        raise UsageError(f"--family: {family!r} is not one of {', '.join(known)}.")
    if get_family(family).video:  # before anything is built
        from ..data.video import require_pyav

        require_pyav(f"quickstart --family {family} (writing its synthetic clips)")
    folder = out or Path("difftrain-quickstart" + ("" if family == DEFAULT_FAMILY else f"-{family}"))
    r = run_quickstart(folder, steps=steps, family=family)
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
