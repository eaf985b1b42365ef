"""The families own their facts: every registered family implements the base class, states each required fact, and
adding one needs only its folder (families/<name>/), its bundled configs and its registry row. No family's name is
written as a string outside its own folder (the registry's rows aside; the recipes are data), no family's package
is imported from outside it, and no key only one family uses is read or written outside the families."""

from __future__ import annotations

import ast
import inspect
import re
import sys
import typing
from collections import Counter
from pathlib import Path

import grimp
import pytest

import difftrain
from difftrain.config.load import resolve
from difftrain.errors import ConfigError, UsageError
from difftrain.families import registry
from difftrain.families.base import ModelFamily
from difftrain.families.common import configs_root
from difftrain.planning.estimate import plan_memory

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
    if fam.mergeable:  # lora merge needs the single-file layout of every part, or writes the denoiser alone
        assert set(fam.single_file_prefixes) == set(fam.parts) or fam.single_file_parts([fam.denoiser]) == (
            fam.denoiser,
        ) == tuple(fam.single_file_prefixes)


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


FAMILIES = SRC / "families"
#: each registered family's own folder (two families may share one: cogvideox and cogvideox-i2v)
PACKAGES = {row.name: FAMILIES / row.module for row in registry.REGISTRY}


def _names_outside(files: list[Path], packages: dict[str, Path] = PACKAGES) -> list[str]:
    """Every family name written as a string in ``files`` outside that family's own folder: a name as a whole
    string, or as a prefix of a key or file name ("sdxl_...", "sd3.json"). The registry's rows are the one place
    that names them all."""
    found = []
    for path in files:
        if path == FAMILIES / "registry.py":
            continue
        for line, value in _string_constants(path):
            for name, folder in packages.items():
                if path.is_relative_to(folder):
                    continue
                if value == name or value.startswith((name + "_", name + ".")):
                    where = path.relative_to(SRC) if path.is_relative_to(SRC) else path.name
                    found.append(f"{where}:{line}: {value!r}")
    return found


def test_no_family_name_is_written_outside_its_own_folder():
    assert _names_outside(sorted(SRC.rglob("*.py"))) == []


def test_the_check_above_would_see_a_family_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f'FAMILY = "{registry.DEFAULT_FAMILY}"\n', encoding="utf-8")
    assert [v for _, v in _string_constants(bad)] == [registry.DEFAULT_FAMILY]
    assert len(_names_outside([bad])) == 1
    # another family's folder is outside a family's own: the name written there is seen, in its own it is not
    own, other = tmp_path / "own", tmp_path / "other"
    packages = {registry.DEFAULT_FAMILY: own, "other": other}
    for folder in (own, other):
        folder.mkdir()
        (folder / "family.py").write_text(f'NAME = "{registry.DEFAULT_FAMILY}"\n', encoding="utf-8")
    assert _names_outside([own / "family.py"], packages) == []
    assert _names_outside([other / "family.py"], packages) == [f"family.py:1: {registry.DEFAULT_FAMILY!r}"]


def test_no_family_package_is_imported_from_outside_it():
    """The registry reaches each family by its row (a module name, imported on demand); nothing else imports a
    family's package, another family's included."""
    graph = grimp.build_graph("difftrain")
    found = []
    for row in registry.REGISTRY:
        pkg = f"difftrain.families.{row.module}"
        inside = {m for m in graph.modules if m == pkg or m.startswith(pkg + ".")}
        for m in inside:
            for importer in graph.find_modules_that_directly_import(m):
                if importer not in inside:
                    found.append(f"{importer} imports {m}")
    assert found == []


_KEY = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")  # a snake_case key: "time_ids", "image_latents"
#: keys one family happens to write that another layer owns, each with its owner
_OWNED_ELSEWHERE = {
    "lora_unet": "lora/kohya.py: sd-scripts' LoRA prefix of a denoiser (a UNet or a transformer)",
    "lora_te1": "lora/kohya.py: sd-scripts' LoRA prefix of the first text encoder",
    "lora_te3": "lora/kohya.py: sd-scripts' LoRA prefix of the third text encoder",
    "stage3_param_persistence_threshold": "DeepSpeed's own ZeRO-3 setting (memory/deepspeed_engine.py's default)",
    "high_noise": "config/schema/model.py: model.expert's values, for any two-expert model (Wan2.2 A14B today)",
    "low_noise": "config/schema/model.py: model.expert's values, for any two-expert model (Wan2.2 A14B today)",
    "clip_g": "config/sdscripts.py: sd-scripts' --clip_g option (SD3's CLIP-G file), which convert-args reads",
}


def _family_keys() -> dict[str, str]:
    """The family-specific keys: snake_case strings that exactly one family's folder writes, that no module the
    families share writes (base, common, ...), and that the base class does not name (its protocol)."""
    per: dict[str, set[str]] = {}
    for folder in PACKAGES.values():
        per.setdefault(folder.name, set()).update(
            v for f in folder.rglob("*.py") for _, v in _string_constants(f) if _KEY.match(v)
        )
    shared = {v for f in FAMILIES.glob("*.py") for _, v in _string_constants(f)}
    protocol = (FAMILIES / "base.py").read_text(encoding="utf-8")
    counts = Counter(v for keys in per.values() for v in keys)
    return {
        v: folder
        for folder, keys in per.items()
        for v in keys
        if counts[v] == 1 and v not in shared and v not in protocol and v not in _OWNED_ELSEWHERE
    }


def _keys_outside(files: list[Path], keys: dict[str, str]) -> list[str]:
    return [
        f"{path.relative_to(path.parents[1])}:{line}: {value!r} (families/{keys[value]}/)"
        for path in files
        for line, value in _string_constants(path)
        if value in keys
    ]


def test_no_family_specific_key_is_written_outside_the_families():
    """A key only one family uses ("time_ids", "image_latents") is read or written by that family alone: the
    layers below speak to families through the base class (full_precision_inputs, image_condition_entries)."""
    keys = _family_keys()
    outside = [p for p in sorted(SRC.rglob("*.py")) if not p.is_relative_to(FAMILIES)]
    assert _keys_outside(outside, keys) == []
    assert "time_ids" in keys and "image_latents" in keys  # the check covers the keys it was written for


def test_the_key_check_would_see_a_family_key(tmp_path):
    keys = _family_keys()
    (tmp_path / "pkg").mkdir()
    bad = tmp_path / "pkg" / "bad.py"
    bad.write_text('KEY = "time_ids"\n', encoding="utf-8")
    assert _keys_outside([bad], keys) == ["pkg/bad.py:1: 'time_ids' (families/sdxl/)"]


def test_a_new_family_needs_only_its_folder_its_configs_and_its_row(tmp_path, monkeypatch):
    """A family the rest of difftrain has never heard of: a package in families/ (here a subclass of a registered
    family, over that family's bundled configs) and one registry row. The config validates, the planner plans it,
    the family loads by its name: nothing else is edited."""
    import difftrain.families

    base_row = registry.REGISTRY[1] if len(registry.REGISTRY) > 1 else registry.REGISTRY[0]
    pkg = tmp_path / "toyfamily"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        f"from difftrain.families.{base_row.module} import {base_row.cls}\n\n\n"
        f"class Toy({base_row.cls}):\n    name = 'toy'\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(difftrain.families, "__path__", [*difftrain.families.__path__, str(tmp_path)])
    tiny = registry.get_family(base_row.name).tiny_config or base_row.default_architecture
    row = registry.Registered("toy", "toyfamily", "Toy", tiny)
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, row))
    try:
        cfg = resolve(extra={"family": "toy"}).config
        assert cfg.family == "toy" and cfg.model.config == tiny
        fam = registry.get_family("toy")
        assert fam.name == "toy" and isinstance(fam, ModelFamily)
        est = plan_memory(cfg)
        assert est.gpu_total > 0 and est.host_total > 0
    finally:
        sys.modules.pop("difftrain.families.toyfamily", None)
