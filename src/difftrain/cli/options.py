"""Option aliases shared by the commands that take a config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

RecipeOpt = Annotated[
    str | None, typer.Option("--recipe", "-r", help="a recipe name (`difftrain recipes list`) or a YAML path")
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="your YAML config, applied over the recipe")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="override one value: section.key=value (repeatable)")
]
PrintConfigOpt = Annotated[
    bool, typer.Option("--print-config", help="print the resolved config with the source of each value, then exit")
]
DatasetConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--dataset-config",
        help="sd-scripts' or diffusion-pipe's dataset TOML: its folders become data.subsets (shortcut for --set "
        "data.dataset_config=...)",
    ),
]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="shortcut for --set data.dir=...")]
ModelOpt = Annotated[Path | None, typer.Option("--model", help="shortcut for --set model.path=...")]
AllowPickleOpt = Annotated[
    bool, typer.Option("--allow-pickle", help="allow .ckpt/.pt/.bin checkpoints (read with weights_only=True)")
]


def shortcuts(
    data_dir: Path | None, model: Path | None, allow_pickle: bool, dataset_config: Path | None = None
) -> dict:
    """The config layer the shortcut options add (applied under --set)."""
    extra: dict = {}
    if data_dir is not None:
        extra.setdefault("data", {})["dir"] = str(data_dir)
    if dataset_config is not None:
        extra.setdefault("data", {})["dataset_config"] = str(dataset_config)
    if model is not None:
        extra.setdefault("model", {})["path"] = str(model)
    if allow_pickle:
        extra.setdefault("model", {})["allow_pickle"] = True
    return extra
