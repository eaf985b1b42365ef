"""difftrain convert-args -- <sd-scripts command line | config.toml>"""

from __future__ import annotations

from typing import Annotated

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from ..config.load import resolve
from ..config.sdscripts import convert
from ..console import console, info


def convert_args(
    tokens: Annotated[list[str], typer.Argument(help="the sd-scripts command line (after --), or a TOML config path")],
) -> None:
    """Print the difftrain config equivalent to an sd-scripts command line (SDXL's, SD3's and FLUX.1's scripts;
    musubi-tuner's Wan), and what could not be mapped."""
    c = convert(tokens)
    res = resolve(extra=c.config)  # validates: a conversion that does not validate is an error
    typer.echo(f"# difftrain config converted from {c.script or 'sd-scripts options'}")
    typer.echo("# run: difftrain precompute --config THIS.yaml && difftrain train --config THIS.yaml")
    typer.echo(yaml.safe_dump(c.config, sort_keys=False), nl=False)
    if c.unmapped:
        table = Table(title=f"{len(c.unmapped)} option(s) not mapped")
        table.add_column("option", style="cyan")
        table.add_column("why")
        for opt, why in c.unmapped:
            table.add_row(escape(opt), escape(why))  # the user's own text: never read as markup
        console.print(table)
    info(f"the config validates ({res.config.train.method}, {res.config.memory.optimizer.kind})")
