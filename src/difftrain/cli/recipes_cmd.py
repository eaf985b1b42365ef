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


SORTS = ("name", "speed", "vram", "ram")


@app.command("list")
def list_(
    family: Annotated[str | None, typer.Option("--family", help="only this family's recipes (sdxl, sd3, ...)")] = None,
    vram: Annotated[
        str | None, typer.Option("--vram", help="only recipes whose card is at most this, e.g. 8GiB")
    ] = None,
    ram: Annotated[
        str | None, typer.Option("--ram", help="only recipes whose measured host RAM peak fits this, e.g. 16GiB")
    ] = None,
    sort: Annotated[
        str,
        typer.Option(
            "--sort",
            help="name; speed (the shipped seconds per step, fastest first; unmeasured ones last); vram; ram",
        ),
    ] = "name",
) -> None:
    """Choose a recipe: the card it is for, its measured GPU and host RAM peaks, and its seconds per step
    eager and as shipped (speed auto: compiled blocks, CUDA graphs where they pay) with the one-time compile cost."""
    from ..config.recipes import load_recipe, recipe_gpus, recipe_measurements, recipe_tier
    from .plan_cmd import parse_size

    if sort not in SORTS:
        raise UsageError(f"--sort {sort!r} is not one of {', '.join(SORTS)}.", hint="e.g. --sort speed")
    vram_gib = parse_size(vram) if vram else None
    ram_gib = parse_size(ram) if ram else None
    measured = recipe_measurements()
    # the title on a line of its own (longer than the table); one space of padding, the box's column rule another:
    # seven columns in 80 characters (the family and the method are in every recipe's name: sdxl-lora-8gb, ...)
    title = (
        f"recipes: GPU and host RAM peaks in GiB and seconds per step, eager and as shipped, measured on an "
        f"{measured['measured_on']}"
    )
    table = Table(
        box=box.SIMPLE_HEAD,  # no vertical rules and no edge padding: the columns fit an 80-column terminal
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    longest = max(len(n) for n in recipe_names())
    table.add_column("recipe", style="cyan", min_width=longest, no_wrap=True)  # a name is never cut
    for col in ("card", "GPU", "RAM", "eager", "shipped", "compile"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col) if col != "GPU" else 5)
    rows = []
    for name in recipe_names():
        data = load_recipe(name)
        fam = str(data.get("family", "?"))
        tier = recipe_tier(name)
        m = measured["recipes"].get(name, {})
        if family and fam != family:
            continue
        if vram_gib is not None and (tier is None or tier > vram_gib):
            continue
        if ram_gib is not None and (not m or m["host_rss_gib"] > ram_gib):
            continue
        rows.append((name, fam, tier, m))
    inf = float("inf")
    if sort == "speed":  # the shipped figure; recipes without one after, by their eager one; CPU recipes last
        rows.sort(key=lambda r: (r[3].get("shipped") is None, (r[3].get("shipped") or r[3]).get("s_per_step") or inf))
    elif sort == "vram":
        rows.sort(key=lambda r: (r[3].get("gpu_reserved_gib", inf), r[0]))
    elif sort == "ram":
        rows.sort(key=lambda r: (r[3].get("host_rss_gib", inf), r[0]))
    gib = lambda v: f"{v:.2f}" if v is not None else "-"
    rough = False
    for name, _family, tier, m in rows:
        shipped = m.get("shipped") or {}
        fast = "-"
        if shipped:
            rough = rough or shipped["run"] != "long"
            fast = f"{shipped['s_per_step']:.3f}" + ("*" if shipped["run"] != "long" else "")
        first = shipped.get("first_step_s")
        table.add_row(
            name,
            (f"{recipe_gpus(name)}x" if recipe_gpus(name) > 1 else "") + f"{tier:g}" if tier else "CPU",
            gib(m.get("gpu_reserved_gib")),
            gib(m.get("host_rss_gib")),
            f"{m['s_per_step']:.2f}" if m and m.get("s_per_step") is not None else "-",
            fast,
            f"{first:.0f} s" if first is not None else "-",
        )
    console.print(title)
    console.print(table)
    if not rows:
        info(
            "no recipe matches these filters: widen --vram or --ram, or `difftrain plan --vram N --ram M` finds a plan"
        )
        return
    info(
        "eager: speed.compile false; shipped: speed auto on a long run (steady seconds per step), after a first step "
        "of `compile` seconds once per run (less with a warm cache)"
        + ("; * a 3- to 8-step run capped as the card (rough), no long run measured yet" if rough else "")
    )
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
