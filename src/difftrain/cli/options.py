"""Option aliases shared by the commands that take a config."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", "-r", help="a recipe name (`difftrain recipes list`) or a YAML path")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="your YAML config, applied over the recipe")]
SetOpt = Annotated[Optional[List[str]], typer.Option("--set", "-s", help="override one value: section.key=value (repeatable)")]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="print the resolved config with the source of each value, then exit")]
