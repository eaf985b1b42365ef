"""Recipes: YAML files shipped in the package (src/difftrain/recipes/).

Each recipe starts with a comment header giving the hardware tier and the
exact command that runs it. A recipe argument may also be a path to a YAML
file of the user's.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

import yaml

from ..errors import ConfigError, RecipeNotFound


def _recipe_dir():
    return resources.files("difftrain") / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in _recipe_dir().iterdir() if p.name.endswith(".yaml"))


def recipe_text(name: str) -> str:
    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        return Path(name).read_text(encoding="utf-8")
    f = _recipe_dir() / f"{name}.yaml"
    if not f.is_file():
        close = difflib.get_close_matches(name, recipe_names(), n=3)
        hint = f"Did you mean {', '.join(close)}? " if close else ""
        raise RecipeNotFound(
            f"There is no recipe named {name!r}.",
            hint=hint + "`difftrain recipes list` shows the recipes that ship with difftrain.",
        )
    return f.read_text(encoding="utf-8")


def recipe_header(name: str) -> str:
    lines = []
    for line in recipe_text(name).splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    return "\n".join(lines).strip()


def load_recipe(name: str) -> dict:
    try:
        data = yaml.safe_load(recipe_text(name))
    except yaml.YAMLError as e:
        raise ConfigError(f"The recipe {name!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"The recipe {name!r} must be a mapping of sections.")
    return data
