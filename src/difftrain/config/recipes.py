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

#: recipes renamed when their tier was measured as the card (issue 23): old name -> (new name, why)
RENAMED = {
    "sdxl-lora-2gb": (
        "sdxl-lora-3gb",
        "on a real card the CUDA context, the libraries and the display take ~1 GiB, which leaves a 2 GB card too "
        "little for SDXL at 1024 px",
    ),
}

#: recipes retired because no plan keeps their promise: name -> (the recipe to use instead, why)
RETIRED = {
    "sdxl-full-3gb": (
        "sdxl-full-8gb",
        "it needed 26 GiB of host RAM (torchao's CPU AdamW keeps four host copies of the UNet's 2.6 B weights beside "
        "the pinned blocks), over the 16 GiB a recipe for a card of 8 GB or less may take; Adafactor stepped in the "
        "backward pass (6.8 GiB of host RAM) did not fit a 3 or a 4 GB card (measured on an H200 capped as each, "
        "2026-11-27), so sdxl-full-8gb, 6.5 GiB of host RAM, is the smallest full fine-tune tier",
    ),
}
RETIRED["sdxl-full-2gb"] = RETIRED["sdxl-full-3gb"]  # renamed sdxl-full-3gb by issue 23, retired with it

#: the host RAM a recipe for a card of at most so many GB may take (issue 50): the desktop such a card sits in, less
#: nothing (the recipe's measured peak RSS while training must stay under it; tests/recipes checks). A larger card's
#: recipe may state more in its header (``Host budget: N GiB``) with the reason.
HOST_BUDGETS = ((8.0, 16.0), (24.0, 32.0))
LARGE_CARD_HOST_GIB = 64.0


def _recipe_dir():
    return resources.files("difftrain") / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in _recipe_dir().iterdir() if p.name.endswith(".yaml"))


def read_text(path: Path, what: str) -> str:
    """A user's YAML file as text; :class:`ConfigError` naming it when it cannot be read or is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"The {what} {path} is not UTF-8 text (byte {e.start}).", hint="Save it as UTF-8 YAML."
        ) from None
    except OSError as e:
        raise ConfigError(
            f"The {what} {path} cannot be read: {e.strerror or e}.", hint="Check the path and its permissions."
        ) from None


#: what a configuration may hold: deeper nesting or more values is not a configuration (e.g. a YAML alias bomb)
MAX_DEPTH, MAX_VALUES = 32, 100_000


def check_shape(data, what: str) -> None:
    """:class:`ConfigError` when ``data`` nests deeper than MAX_DEPTH, holds more than MAX_VALUES values (aliases counted
    each time they are used), or contains itself: the merging and validation that follow would never end."""
    count = 0

    def walk(x, depth: int) -> None:
        nonlocal count
        count += 1
        if depth > MAX_DEPTH or count > MAX_VALUES:
            raise ConfigError(
                f"The {what} nests deeper than {MAX_DEPTH} levels or holds more than {MAX_VALUES:,} values "
                "(a self-referencing YAML alias?).",
                hint="A difftrain config is a few sections of plain keys: `difftrain recipes show NAME` shows one.",
            )
        for v in x.values() if isinstance(x, dict) else x if isinstance(x, list) else ():
            walk(v, depth + 1)

    walk(data, 0)


def parse_yaml(text: str, what: str):
    """``yaml.safe_load`` (no Python tags: ``!!python/object`` is refused), its failures as :class:`ConfigError`s
    naming ``what``, the result checked by :func:`check_shape`."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"The {what} is not valid YAML: {e}", hint="Python tags (!!python/...) are never read; fix the line shown."
        ) from None
    except RecursionError:
        raise ConfigError(
            f"The {what} nests too deeply to read.", hint="A difftrain config is a few sections of plain keys."
        ) from None
    check_shape(data, what)
    return data


def recipe_text(name: str) -> str:
    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        return read_text(Path(name), "recipe file")
    f = _recipe_dir() / f"{name}.yaml"
    if not f.is_file() and name in RETIRED:
        use, why = RETIRED[name]
        raise RecipeNotFound(f"The recipe {name!r} was retired: {why}.", hint=f"Use --recipe {use}.")
    if not f.is_file() and name in RENAMED:
        new, why = RENAMED[name]
        raise RecipeNotFound(f"The recipe {name!r} is now {new!r}: {why}.", hint=f"Use --recipe {new}.")
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


def recipe_tier(name: str) -> float | None:
    """The card a recipe promises, from its header's ``Tier: N GiB`` line; None for the CPU (tiny) recipes."""
    import re

    found = re.search(r"^Tier: ([0-9.]+) GiB", recipe_header(name), re.M)
    return float(found.group(1)) if found else None


def recipe_gpus(name: str) -> int:
    """How many GPUs (of the tier's card) a recipe trains on together (``train --gpus N``), from its header's
    ``GPUs: N`` line; 1 without one."""
    import re

    found = re.search(r"^GPUs: ([0-9]+)", recipe_header(name), re.M)
    return int(found.group(1)) if found else 1


def host_budget(name: str) -> float | None:
    """The host RAM (GiB) recipe ``name`` promises to train in: its header's ``Host budget: N GiB`` line, else the
    rule for its card (:data:`HOST_BUDGETS`); None for the CPU (tiny) recipes."""
    import re

    tier = recipe_tier(name)
    if tier is None:
        return None
    found = re.search(r"^Host budget: ([0-9.]+) GiB", recipe_header(name), re.M)
    if found:
        return float(found.group(1))
    return rule_host_budget(tier)


def rule_host_budget(card_gib: float) -> float:
    """What the rule allows a recipe for a card of ``card_gib`` (see :data:`HOST_BUDGETS`)."""
    return next((ram for card, ram in HOST_BUDGETS if card_gib <= card), LARGE_CARD_HOST_GIB)


def recipes_within(family: str, method: str, ram_gib: float, card_gib: float | None = None) -> list[str]:
    """The shipped recipes of ``family`` and ``method`` (lora | full) whose measured host RAM peak fits ``ram_gib``
    (and whose card fits ``card_gib`` when given), the smallest card first: what `train` names when the machine
    lacks the RAM a plan needs."""
    measured = recipe_measurements()["recipes"]
    found = []
    for name, m in measured.items():
        data = load_recipe(name)
        tier = recipe_tier(name)
        if data.get("family") != family or str((data.get("train") or {}).get("method", "lora")) != method:
            continue
        if recipe_gpus(name) > 1:  # the chooser names recipes for the one card a run was planned on
            continue
        if m["host_rss_gib"] <= ram_gib and tier is not None and (card_gib is None or tier <= card_gib):
            found.append((tier, m["host_rss_gib"], name))
    return [name for _, _, name in sorted(found)]


def recipe_measurements() -> dict:
    """recipes/measured.json: each GPU recipe's measured peaks and step time, and where they were measured."""
    import json

    return json.loads((_recipe_dir() / "measured.json").read_text(encoding="utf-8"))


def load_recipe(name: str) -> dict:
    data = parse_yaml(recipe_text(name), f"recipe {name!r}")
    if not isinstance(data, dict):
        raise ConfigError(
            f"The recipe {name!r} must be a mapping of sections (model:, data:, train: ...).",
            hint="`difftrain recipes show NAME` shows one.",
        )
    return data
