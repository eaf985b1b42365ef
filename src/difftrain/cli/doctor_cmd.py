"""difftrain doctor"""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from ..console import console
from .common import resolved_config
from .options import ConfigOpt, RecipeOpt, SetOpt


def doctor(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Check this machine: versions, GPUs, host RAM, optional engines, several-process support; with --recipe,
    whether that config fits. Exit code 1 when something fails."""
    from ..flows.doctor import checks, environment_lines, recipe_fit

    rows = checks()
    if recipe or config:
        rows.append(recipe_fit(resolved_config(recipe, config, set_).config))
    table = Table(title="difftrain doctor")
    for col in ("check", "status", "found", "what to do"):
        table.add_column(col, overflow="fold")
    color = {"ok": "green", "warn": "yellow", "fail": "red", "info": "cyan"}
    for r in rows:
        table.add_row(r.name, f"[{color[r.status]}]{r.status}[/{color[r.status]}]", escape(r.found), escape(r.fix))
    console.print(table)
    for line in environment_lines():
        console.print(f"env: {line}")
    if any(r.status == "fail" for r in rows):
        raise typer.Exit(1)
