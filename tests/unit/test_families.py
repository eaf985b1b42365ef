"""The families own their facts: every registered family implements the base class, states each required fact,
and no family's name is written as a string anywhere outside families/ (and the recipes, which are data)."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

import difftrain
from difftrain.config.load import resolve
from difftrain.errors import ConfigError, UsageError
from difftrain.families import registry
from difftrain.families.base import ModelFamily
from difftrain.families.common import configs_root

SRC = Path(difftrain.__file__).parent


def _required_facts() -> list[str]:
    """The class attributes the base class declares without a default: what each family must state."""
    hints = typing.get_type_hints(ModelFamily, include_extras=False)
    return [n for n in hints if n not in vars(ModelFamily)]


@pytest.mark.parametrize("row", registry.REGISTRY, ids=lambda r: r.name)
def test_every_registered_family_implements_the_base_class(row):
    fam = registry.get_family(row.name)
    assert isinstance(fam, ModelFamily)
    assert not inspect.isabstract(type(fam)), sorted(type(fam).__abstractmethods__)
    missing = [n for n in _required_facts() if not hasattr(fam, n)]
    assert missing == []
    assert fam.name == row.name
    assert fam.objective in typing.get_args(typing.get_type_hints(ModelFamily)["objective"].__args__[0])
    assert fam.denoiser in fam.parts and fam.image_encoder in fam.parts
    assert set(fam.text_encoders) <= set(fam.parts)
    assert all(set(stage) <= set(fam.text_encoders) for stage in fam.text_stages.values())
    assert (configs_root() / row.default_architecture).is_dir()
    if fam.mergeable:  # lora merge needs the single-file layout of every part
        assert set(fam.single_file_prefixes) == set(fam.parts)


def test_the_base_class_states_what_every_family_must_say():
    facts = _required_facts()
    assert {"name", "objective", "parts", "denoiser", "text_stages"} <= set(facts)

    class Incomplete(ModelFamily):  # states no fact and implements no method
        pass

    assert inspect.isabstract(Incomplete)
    with pytest.raises(TypeError):
        Incomplete()  # type: ignore[abstract]


def test_the_config_family_is_checked_against_the_registry():
    assert resolve().config.family == registry.DEFAULT_FAMILY
    for row in registry.REGISTRY:
        cfg = resolve(extra={"family": row.name}).config
        assert cfg.model.config == row.default_architecture
    with pytest.raises(ConfigError) as e:
        resolve(extra={"family": "not-a-family"})
    assert "unknown model family 'not-a-family'" in str(e.value.problems)
    with pytest.raises(UsageError, match="Known families"):
        registry.get_family("not-a-family")


def test_channels_last_is_refused_where_the_registry_says_there_is_nothing_to_act_on():
    for row in registry.REGISTRY:
        extra = {"family": row.name, "speed": {"channels_last": True}}
        if row.channels_last:
            assert resolve(extra=extra).config.speed.channels_last
        else:
            with pytest.raises(ConfigError, match="channels_last"):
                resolve(extra=extra)


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_no_family_name_is_written_outside_the_families():
    names = set(registry.names())
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(SRC / "families"):
            continue
        for line, value in _string_constants(path):
            # a name as a whole string, or as a prefix of a key or file name ("sdxl_...", "sd3.json")
            if value in names or any(value.startswith((n + "_", n + ".")) for n in names):
                found.append(f"{path.relative_to(SRC)}:{line}: {value!r}")
    assert found == []


def test_the_check_above_would_see_a_family_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f'FAMILY = "{registry.DEFAULT_FAMILY}"\n', encoding="utf-8")
    assert [v for _, v in _string_constants(bad)] == [registry.DEFAULT_FAMILY]
