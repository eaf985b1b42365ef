"""difftrain recipes list | show NAME | copy NAME DEST"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..config.recipes import recipe_names, recipe_text
from ..console import console, info
from ..errors import UsageError

app = typer.Typer(help="The recipes shipped with difftrain.", no_args_is_help=True)


@app.command("list")
def list_(
    family: Annotated[str | None, typer.Option("--family", help="only this family's recipes (sdxl, sd3, ...)")] = None,
    vram: Annotated[
        str | None, typer.Option("--vram", help="only recipes whose card is at most this, e.g. 8GiB")
    ] = None,
    ram: Annotated[
        str | None, typer.Option("--ram", help="only recipes whose measured host RAM peak fits this, e.g. 16GiB")
    ] = None,
) -> None:
    """Choose a recipe: family, method, the card it is for, its measured GPU and host RAM peaks and step time."""
    from ..config.recipes import load_recipe, recipe_measurements, recipe_tier
    from .plan_cmd import parse_size

    vram_gib = parse_size(vram) if vram else None
    ram_gib = parse_size(ram) if ram else None
    measured = recipe_measurements()
    # the title on a line of its own (longer than the table); one space of padding, the box's column rule another:
    # seven columns in 79 characters (two spaces of padding made 85)
    title = f"recipes: GPU and host RAM peaks in GiB, measured on an {measured['measured_on']}"
    table = Table(
        box=box.SIMPLE_HEAD,  # no vertical rules and no edge padding: the seven columns fit an 80-column terminal
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    longest = max(len(n) for n in recipe_names())
    table.add_column("recipe", style="cyan", min_width=longest, no_wrap=True)  # a name is never cut
    table.add_column("family", no_wrap=True, min_width=13)  # cogvideox-i2v
    table.add_column("method", no_wrap=True, min_width=6)
    for col in ("card", "GPU", "RAM", "s/step"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col) if col != "GPU" else 5)
    shown = 0
    for name in recipe_names():
        data = load_recipe(name)
        fam = str(data.get("family", "?"))
        method = str((data.get("train") or {}).get("method", "lora"))
        tier = recipe_tier(name)
        m = measured["recipes"].get(name, {})
        if family and fam != family:
            continue
        if vram_gib is not None and (tier is None or tier > vram_gib):
            continue
        if ram_gib is not None and (not m or m["host_rss_gib"] > ram_gib):
            continue
        gib = lambda v: f"{v:.2f}" if v is not None else "-"
        table.add_row(
            name,
            fam,
            method,
            f"{tier:g}" if tier else "CPU",
            gib(m.get("gpu_reserved_gib")),
            gib(m.get("host_rss_gib")),
            f"{m['s_per_step']:.2f}" if m else "-",
        )
        shown += 1
    console.print(title)
    console.print(table)
    if not shown:
        info(
            "no recipe matches these filters: widen --vram or --ram, or `difftrain plan --vram N --ram M` finds a plan"
        )
    else:
        info("`difftrain recipes show NAME` prints one with its header; `difftrain plan --recipe NAME` its memory plan")


@app.command("show")
def show(name: str) -> None:
    """Print a recipe (YAML) to standard output."""
    typer.echo(recipe_text(name), nl=False)


@app.command("copy")
def copy(name: str, dest: Path, force: bool = typer.Option(False, "--force", help="overwrite DEST")) -> None:
    """Copy a recipe to DEST to edit it; use it with --config DEST (or --recipe DEST)."""
    text = recipe_text(name)
    if dest.is_dir():
        dest = dest / f"{name}.yaml"
    if dest.exists() and not force:
        raise UsageError(f"{dest} already exists.", hint="Choose another path or pass --force.")
    dest.write_text(text, encoding="utf-8")
    info(f"copied recipe {name} to {dest}")
