"""Every shipped recipe validates and explains how to run itself."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from difftrain.config.load import resolve
from difftrain.config.recipes import recipe_header, recipe_names

RECIPE_ROOT = Path(str(resources.files("difftrain") / "recipes"))
RECIPES = sorted(RECIPE_ROOT.rglob("*.yaml"))


def test_recipes_are_found():
    assert len(RECIPES) >= 2
    assert {"tiny-sdxl-lora", "sdxl-lora-8gb"} <= set(recipe_names())


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_and_has_a_header(path):
    cfg = resolve(recipe=path.stem).config
    header = recipe_header(path.stem)
    assert "Hardware:" in header, "the header names the hardware tier"
    assert "difftrain " in header and "Run" in header, "the header gives the command that runs it"
    assert cfg.family in header or "SDXL" in header


def test_recipes_cli(cli, tmp_path):
    r = cli("recipes", "list")
    assert r.code == 0 and "sdxl-lora-8gb" in r.err
    shown = cli("recipes", "show", "sdxl-lora-8gb")
    assert shown.code == 0 and "activations: {kind: checkpoint}" in shown.out
    r = cli("recipes", "copy", "sdxl-lora-8gb", tmp_path)
    assert r.code == 0 and (tmp_path / "sdxl-lora-8gb.yaml").read_text() == shown.out
    r = cli("recipes", "copy", "sdxl-lora-8gb", tmp_path)
    assert r.code == 2 and "already exists" in r.err
    cfg = resolve(config_file=tmp_path / "sdxl-lora-8gb.yaml").config
    assert cfg == resolve(recipe="sdxl-lora-8gb").config
