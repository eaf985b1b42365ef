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
        # the eager seconds, or where no eager run was measured yet (null) the shipped ones
        assert m["host_rss_gib"] > 0 and (m["s_per_step"] or m["shipped"]["s_per_step"]) > 0, name


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
    assert small == {"sdxl-lora-3gb", "sdxl-lora-4gb", "sd3-lora-4gb"}
    # a 16 GB desktop with an 8 GB card: every Flux LoRA that fits the card, since the streaming load (issue 50)
    assert {"flux-lora-8gb", "sdxl-full-8gb"} <= rows("--vram", "8GiB", "--ram", "16GiB")
    assert rows("--family", "sd3") == {"sd3-lora-4gb", "sd3-lora-8gb", "sd3-lora-16gb", "tiny-sd3-lora"}
    everything = rows()
    assert "tiny-sdxl-lora" in everything and "cogvideox-5b-full-12gb" in everything
    bad = subprocess.run([script, "recipes", "list", "--vram", "lots"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "Cannot read the size 'lots'" in bad.stderr and "Traceback" not in bad.stderr


def test_every_gpu_recipe_keeps_the_host_ram_budget_of_its_card():
    """Issue 50's rule: a recipe for a card of N GB trains in the RAM of the desktop such a card sits in (N <= 8:
    16 GiB, N <= 24: 32 GiB, larger: 64 GiB), or less where its header promises less; a header may promise more only
    for a card above 24 GB, with its reason. The measured peak RSS (recipes/measured.json) must be within it."""
    import re

    from difftrain.config.recipes import host_budget, recipe_measurements, recipe_tier, rule_host_budget

    assert (rule_host_budget(3), rule_host_budget(8), rule_host_budget(12), rule_host_budget(24)) == (16, 16, 32, 32)
    assert rule_host_budget(48) == 64
    measured = recipe_measurements()["recipes"]
    over = {}
    for name, m in measured.items():
        tier, budget = recipe_tier(name), host_budget(name)
        assert budget is not None and tier is not None, name
        stated = re.search(r"^Host budget: ([0-9.]+) GiB(.*)$", recipe_header(name), re.M)
        if stated and budget > rule_host_budget(tier):
            assert tier > 24 and len(stated.group(2).strip()) > 10, f"{name}: more than its card's rule, and why"
        if m["host_rss_gib"] > budget:
            over[name] = (m["host_rss_gib"], budget)
    assert not over, over
    # issue 50's Flux targets, stated in the headers
    assert (host_budget("flux-lora-24gb"), host_budget("flux-lora-16gb")) == (8, 8)
    assert (host_budget("flux-full-24gb"), host_budget("flux-lora-8gb")) == (12, 16)


def test_every_gpu_recipe_precomputes_on_its_own_card_or_says_where():
    """A recipe's text encoders (T5-XXL, the language models) fit, at the recipe's precision, what its card leaves torch
    (planning/estimate.py precompute_lines: T5's measured figures, the language models' estimate), so precompute runs
    on the user's card with no flag; where nothing smaller exists (T5 in nf4 on a 4 GB card) the header says where to
    precompute instead."""
    from difftrain.config.recipes import recipe_tier
    from difftrain.planning.estimate import precompute_lines

    over = {}
    for name in recipe_names():
        tier = None if name.startswith("tiny") else recipe_tier(name)
        if tier:
            notes = [line for line in precompute_lines(resolve(recipe=name).config, tier) if "note:" in line]
            if notes:
                over[name] = notes
    assert set(over) == {"sd3-lora-4gb"}, over
    assert "precompute once on a larger GPU" in recipe_header("sd3-lora-4gb")


def test_the_rule_fails_a_recipe_over_its_budget(monkeypatch):
    """The check above can fail: a measurement over the card's budget is caught."""
    from difftrain.config import recipes

    real = recipes.recipe_measurements()
    fake = {
        **real,
        "recipes": {**real["recipes"], "sdxl-lora-8gb": {**real["recipes"]["sdxl-lora-8gb"], "host_rss_gib": 16.5}},
    }
    monkeypatch.setattr(recipes, "recipe_measurements", lambda: fake)
    with pytest.raises(AssertionError, match="sdxl-lora-8gb"):
        test_every_gpu_recipe_keeps_the_host_ram_budget_of_its_card()


def test_recipes_list_sorts_by_the_shipped_speed_through_the_console_script():
    """`recipes list --sort speed`: the shipped seconds per step, fastest first, the recipes without one after;
    both figures and the compile cost shown; a wrong --sort is a usage error."""
    import os
    import re
    import subprocess
    import sys

    from difftrain.config.recipes import recipe_measurements

    script = str(Path(sys.executable).parent / "difftrain")
    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run([script, "recipes", "list", "--sort", "speed"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    measured = recipe_measurements()["recipes"]
    text = r.stdout + r.stderr  # the table goes to stderr with difftrain's other messages
    order = [ln.split()[0] for ln in text.splitlines() if ln.split() and ln.split()[0] in measured]
    shipped = [measured[n]["shipped"]["s_per_step"] for n in order if "shipped" in measured[n]]
    assert len(shipped) >= 5 and shipped == sorted(shipped)
    # (every GPU recipe has a shipped figure since 2026-11-27: then none is left to come after)
    first_unmeasured = next((i for i, n in enumerate(order) if "shipped" not in measured[n]), len(order))
    assert all("shipped" not in measured[n] for n in order[first_unmeasured:])
    row = next(ln for ln in text.splitlines() if ln.split() and ln.split()[0] == "sdxl-lora-8gb")
    m = measured["sdxl-lora-8gb"]
    assert re.search(
        rf"{m['s_per_step']:.2f}\s+{m['shipped']['s_per_step']:.3f}\s+{m['shipped']['first_step_s']:.0f} s", row
    )
    by_name = subprocess.run([script, "recipes", "list"], capture_output=True, text=True, env=env).stderr
    names = [ln.split()[0] for ln in by_name.splitlines() if ln.split() and ln.split()[0] in measured]
    assert names == sorted(names) and names != order
    bad = subprocess.run([script, "recipes", "list", "--sort", "fastest"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--sort 'fastest'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_recipes_a_machine_holds_are_named_smallest_card_first():
    from difftrain.config.recipes import recipes_within

    assert recipes_within("flux", "lora", 16.0) == ["flux-lora-8gb", "flux-lora-16gb", "flux-lora-24gb"]
    assert recipes_within("flux", "lora", 8.0) == ["flux-lora-16gb", "flux-lora-24gb"]  # 8gb's blocks take 13.4
    assert recipes_within("flux", "lora", 16.0, card_gib=16.0) == ["flux-lora-8gb", "flux-lora-16gb"]
    assert recipes_within("flux", "full", 11.0) == ["flux-full-24gb"] and recipes_within("flux", "full", 10.0) == []


def test_a_recipe_for_two_gpus_says_so_where_it_is_listed_and_when_run_on_one(tmp_path):
    """qwen-image-full-2x80gb's header names 2 GPUs: `recipes list` shows its card as 2x80, `plan` plans one of
    them, and `train` on one
    process warns (before anything loads) that each GPU would hold twice the planned share; through the console
    script, with the run then refused for its missing data (exit 2, no traceback, no weights written)."""
    import subprocess
    import sys

    from difftrain.config.recipes import recipe_gpus

    assert recipe_gpus("qwen-image-full-2x80gb") == 2 and recipe_gpus("qwen-image-lora-48gb") == 1
    env = {**__import__("os").environ, "DIFFTRAIN_PROGRESS": "0", "COLUMNS": "120"}
    listed = subprocess.run([sys.executable, "-m", "difftrain", "recipes", "list", "--family", "qwen-image"],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    row = next(x for x in (listed.stdout + listed.stderr).splitlines() if x.split()[:1] == ["qwen-image-full-2x80gb"])
    assert listed.returncode == 0 and row.split()[1] == "2x80", row
    # `plan` plans one GPU of the recipe's 2 unless told otherwise
    for more, where in (([], "one of 2 GPUs (fsdp)"), (["--gpus", "1"], "1024px\n")):
        planned = subprocess.run([sys.executable, "-m", "difftrain", "plan", "--recipe", "qwen-image-full-2x80gb", *more],
                                 capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert planned.returncode == 0 and where in planned.stdout + planned.stderr, planned.stdout + planned.stderr
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "difftrain", "train", "--recipe", "qwen-image-full-2x80gb", "-o", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr and not list(out.rglob("*.safetensors")), r.stderr
    assert "qwen-image-full-2x80gb is a recipe for 2 GPUs of 80 GB" in text and "Add --gpus 2" in text, text


# what a run's step depends on: everything but the text encoders (precompute only) and how long a run goes and keeps
_LENGTH_ONLY = {"max_steps", "epochs", "checkpoint_every", "keep_checkpoints"}


def _step_settings(cfg) -> dict:
    d = cfg.model_dump()
    d.pop("text_encoders")
    d["train"] = {k: v for k, v in d["train"].items() if k not in _LENGTH_ONLY}
    return d


def _measured_as_variant() -> list[tuple[str, str, str]]:
    """The recipes recipes/measured.json says were measured as a benchmarks/card_fit variant "(card_fit_X.json
    LABEL, the recipe's settings)": (recipe, variants file, label)."""
    import re

    from difftrain.config.recipes import recipe_measurements

    found = []
    for name, m in recipe_measurements()["recipes"].items():
        g = re.search(
            r"(card_fit_\w+\.json) ([\w.-]+), the recipe's settings", (m.get("shipped") or {}).get("where", "")
        )
        if g:
            found.append((name, g.group(1), g.group(2)))
    return found


def test_the_recipes_measured_as_card_fit_variants_are_named():
    assert {"qwen-image-edit-lora-80gb", "flux2-dev-lora-96gb", "flux2-dev-lora-24gb"} <= {
        r for r, _, _ in _measured_as_variant()
    }


@pytest.mark.parametrize(("recipe", "variants", "label"), _measured_as_variant(), ids=lambda x: str(x))
def test_a_recipe_measured_as_a_card_fit_variant_trains_with_that_variants_settings(recipe, variants, label):
    # the figures a recipe's header and measured.json state came from a variant (a recipe with --set overrides,
    # capped as a card): the recipe as shipped must step as that variant did, on the card it was capped as
    import json

    from difftrain.config.recipes import recipe_tier

    root = Path(__file__).resolve().parents[2]
    runs = [r for r in json.loads((root / "benchmarks" / variants).read_text()) if r["label"].split(":")[0] == label]
    assert len(runs) == 1, f"{variants} has {len(runs)} variants labelled {label}"
    run = runs[0]
    assert run["card"] == recipe_tier(recipe)
    assert _step_settings(resolve(recipe=recipe).config) == _step_settings(
        resolve(recipe=run["recipe"], sets=run["sets"]).config
    )
