"""difftrain recipes list | show NAME | copy NAME DEST"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..config.recipes import recipe_header, recipe_names, recipe_text
from ..console import console, info
from ..errors import UsageError

app = typer.Typer(help="The recipes shipped with difftrain.", no_args_is_help=True)


@app.command("list")
def list_() -> None:
    """List the recipes with the first line of their header."""
    table = Table()
    table.add_column("recipe", style="cyan")
    table.add_column("for")
    for name in recipe_names():
        table.add_row(name, recipe_header(name).splitlines()[0] if recipe_header(name) else "")
    console.print(table)


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
