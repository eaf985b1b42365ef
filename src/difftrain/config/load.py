"""Layered configuration: defaults < recipe < data.dataset_config (a dataset TOML) < --config FILE < --set a.b=c.

The layers are plain dicts deep-merged here, then validated once by the
pydantic schema. Each dotted key remembers the layer that set it, so
``train --print-config`` can say where every value came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import ConfigError, UsageError
from ..families.registry import DEFAULT_FAMILY, family_facts
from .recipes import check_shape, load_recipe, parse_yaml, read_text
from .schema import Config


def read_yaml(path: Path, what: str = "config file") -> dict:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"The {what} {path} does not exist.", hint="Check the path, or run `difftrain recipes list`.")
    data = parse_yaml(read_text(path, what), f"{what} {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"The {what} {path} must be a mapping of sections (model:, data:, train: ...).",
            hint="`difftrain recipes show NAME` shows one.",
        )
    return data


_YAML11_BOOL_WORDS = {"yes", "no", "on", "off", "y", "n"}


def parse_set(item: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], parsed c). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise UsageError(
            f"--set {item!r} has no '='.", hint="Write --set section.key=value, e.g. --set train.max_steps=100"
        )
    key, _, raw = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise UsageError(f"--set {item!r} has an empty key.")
    if raw.strip().lower() in _YAML11_BOOL_WORDS:
        return parts, raw.strip()  # keep as text: "no" is a valid mixed_precision; bool fields accept it too
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError):
        return parts, raw
    check_shape(value, f"value of --set {key.strip()}")
    return parts, value


def _merge(base: dict, over: dict, source: str, sources: dict[str, str], prefix: str = "") -> dict:
    out = dict(base)
    for k, v in over.items():
        path = f"{prefix}{k}"
        old = out.get(k)
        # a tagged union whose kind changes is replaced, not merged: the old
        # option's fields do not belong to the new one
        same_kind = not (
            isinstance(v, dict) and isinstance(old, dict) and "kind" in v and v.get("kind") != old.get("kind")
        )
        if isinstance(v, dict) and isinstance(old, dict) and same_kind:
            out[k] = _merge(old, v, source, sources, path + ".")
        else:
            out[k] = v
            for s in [s for s in sources if s.startswith(path + ".")]:
                del sources[s]
            _record(v, path, source, sources)
    return out


def _record(v: Any, path: str, source: str, sources: dict[str, str]) -> None:
    if isinstance(v, dict) and v:
        for k, sub in v.items():
            _record(sub, f"{path}.{k}", source, sources)
    else:
        sources[path] = source


def _nest(parts: list[str], value: Any) -> dict:
    d: Any = value
    for p in reversed(parts):
        d = {p: d}
    return d


def validation_problems(err: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors():
        # drop the tagged-union discriminator from the path: memory.weights.bf16.x -> memory.weights.x
        loc = [str(p) for p in e["loc"] if not (isinstance(p, str) and p in _KINDS)]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `difftrain train --print-config` lists the valid keys)"
        elif e["type"] == "union_tag_invalid":
            msg = e["msg"].replace("Input tag", "kind")
        problems.append((".".join(loc) or "(combination)", msg))
    return problems


_KINDS = {
    "bf16",
    "fp16",
    "fp32",
    "fp8",
    "nf4",
    "int8",
    "int4",
    "adamw",
    "adamw8bit",
    "adamw4bit",
    "adafactor",
    "cpu_offload",
    "none",
    "checkpoint",
    "single",
}


class Resolved:
    """A validated config plus the layer each value came from."""

    def __init__(self, config: Config, sources: dict[str, str], raw: dict, notes: list[tuple[str, str]] | None = None):
        self.config = config
        self.sources = sources
        self.raw = raw
        self.notes = notes or []
        """What data.dataset_config's TOML holds that was not mapped, or mapped with a caveat: (key, why)."""

    def rows(self) -> list[tuple[str, Any, str]]:
        flat: dict[str, Any] = {}
        _flatten(self.config.model_dump(mode="json"), "", flat)
        return [(k, v, self._source_of(k)) for k, v in flat.items()]

    def _source_of(self, key: str) -> str:
        while key:
            if key in self.sources:
                return self.sources[key]
            key = key.rpartition(".")[0]
        return "default"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False)


def _with_source(msg: str, path: str, sources: dict[str, str]) -> str:
    """``msg`` plus the layer that set ``path`` (its own key, a parent's, or the first child's): where to fix it."""
    key = path
    while key and key not in sources:
        key = key.rpartition(".")[0]
    src = sources.get(key) or next((v for k, v in sources.items() if k.startswith(path + ".")), None)
    return f"{msg} (from {src})" if src else msg


def _flatten(d: Any, prefix: str, out: dict) -> None:
    if isinstance(d, dict) and d:
        for k, v in d.items():
            _flatten(v, f"{prefix}{k}.", out)
    else:
        out[prefix[:-1]] = d


def validate(data: dict) -> Config:
    """``data`` as a Config, its family checked against the registry (the default family when it names none).
    Raises pydantic's ValidationError."""
    return Config.model_validate({"family": DEFAULT_FAMILY, **data}, context={"families": family_facts()})


def resolve(
    recipe: str | None = None,
    config_file: Path | None = None,
    sets: list[str] | None = None,
    extra: dict | None = None,
) -> Resolved:
    """Build the config from its layers and validate it once. A data.dataset_config (set in any layer) is read
    (config/dataset_toml.py) and its overrides are a layer of their own above the recipe's."""
    layers: list[tuple[dict, str]] = []
    if recipe:
        layers.append((load_recipe(recipe), f"recipe {recipe}"))
    if config_file:
        layers.append((read_yaml(config_file), f"file {config_file}"))
    if extra:
        layers.append((extra, "command line"))
    for item in sets or []:
        parts, value = parse_set(item)
        layers.append((_nest(parts, value), f"--set {'.'.join(parts)}"))
    sources: dict[str, str] = {}
    merged = _merge_layers(layers, sources)
    notes: list[tuple[str, str]] = []
    toml = merged.get("data", {}).get("dataset_config") if isinstance(merged.get("data"), dict) else None
    if isinstance(toml, str | Path) and str(toml):
        from .dataset_toml import read_dataset_toml

        reading = read_dataset_toml(Path(toml))
        notes = reading.unmapped
        layers.insert(1 if recipe else 0, (reading.config, f"dataset config {toml}"))
        sources = {}
        merged = _merge_layers(layers, sources)
    try:
        config = validate(merged)
    except ValidationError as e:
        problems = [(path, _with_source(msg, path, sources)) for path, msg in validation_problems(e)]
        n = len(problems)
        raise ConfigError(
            f"The configuration has {n} problem{'s' if n > 1 else ''}:",
            problems,
            hint="Fix them in your config file or --set options; `difftrain recipes show NAME` shows a working example.",
        ) from None
    return Resolved(config, sources, merged, notes)


def _merge_layers(layers: list[tuple[dict, str]], sources: dict[str, str]) -> dict:
    merged: dict = {}
    for layer, source in layers:
        merged = _merge(merged, layer, source, sources)
    return merged
