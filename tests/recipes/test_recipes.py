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


def test_every_gpu_recipe_has_its_measurements_for_the_chooser():
    from difftrain.config.recipes import recipe_measurements, recipe_names, recipe_tier

    measured = recipe_measurements()["recipes"]
    gpu = {n for n in recipe_names() if recipe_tier(n) is not None}
    assert gpu and set(measured) == gpu  # every GPU tier recipe, and nothing else
    for name, m in measured.items():
        assert 0 < m["gpu_reserved_gib"] < recipe_tier(name), name  # the reserved peak is inside its card
        assert m["host_rss_gib"] > 0 and m["s_per_step"] > 0, name


def test_recipes_list_chooses_by_card_ram_and_family_through_the_console_script():
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(sys.executable).parent / "difftrain")
    env = {**__import__("os").environ, "COLUMNS": "80"}  # a plain terminal: no name may be cut

    def rows(*args):
        r = subprocess.run([script, "recipes", "list", *args], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        from difftrain.config.recipes import recipe_names

        text = r.stdout + r.stderr
        found = {n for n in recipe_names() if re.search(rf"^\s*{re.escape(n)}\s", text, re.M)}
        table = [ln for ln in text.splitlines() if ln.strip().split(" ")[0] in found | {"recipe"}]
        assert table and max(len(ln.rstrip()) for ln in table) <= 80, table  # the table fits the terminal
        return found

    small = rows("--vram", "4GiB", "--ram", "8GiB")
    assert small == {"sdxl-lora-3gb", "sdxl-lora-4gb", "sd3-lora-4gb"}  # sdxl-full-3gb needs 26 GiB of host RAM
    assert rows("--family", "sd3") == {"sd3-lora-4gb", "sd3-lora-8gb", "sd3-lora-16gb", "tiny-sd3-lora"}
    everything = rows()
    assert "tiny-sdxl-lora" in everything and "cogvideox-5b-full-12gb" in everything
    bad = subprocess.run([script, "recipes", "list", "--vram", "lots"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "Cannot read the size 'lots'" in bad.stderr and "Traceback" not in bad.stderr
