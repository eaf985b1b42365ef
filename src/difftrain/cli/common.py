"""Helpers the command files share: resolving a config and printing it."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..config.load import Resolved, resolve


def resolved_config(recipe, config_file: Path | None, sets, extra: dict | None = None) -> Resolved:
    res = resolve(recipe=recipe, config_file=config_file, sets=sets, extra=extra)
    if res.notes:  # what the dataset TOML holds that did not map, said once (info prints on the first process)
        from ..console import info

        info(
            f"dataset config {res.config.data.dataset_config}: {len(res.notes)} key(s) not mapped, or mapped with a note"
        )
        for key, why in res.notes:
            info(f"  {key}: {why}")
    return res


def with_hub_model(res: Resolved) -> Resolved:
    """model.path given as a Hugging Face Hub id (``org/name[@revision]`` or ``org/name/file.safetensors``): fetched,
    or found in the local HF cache, and the config then names the local snapshot (its folder is the commit), so the
    run's config.yaml says exactly which weights trained."""
    from ..console import info
    from ..families.registry import get_family
    from ..runtime.hub import resolve_model_path

    cfg = res.config
    path, ref = resolve_model_path(cfg.model.path, get_family(cfg.family).parts)
    if ref is None or path is None:
        return res
    commit = path.name if path.is_dir() else path.parent.name
    info(f"model: {ref} from the Hugging Face Hub, snapshot {commit} -> {path}")
    res.config = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": path})})
    res.sources["model.path"] = f"{res._source_of('model.path')}: Hub {ref}, snapshot {commit}"
    return res


def print_config(res: Resolved) -> None:
    """One line per value, `key: value  # source`, on standard output."""
    rows = res.rows()
    width = max(len(k) + len(json.dumps(v)) for k, v, _ in rows) + 4
    for key, value, source in rows:
        left = f"{key}: {json.dumps(value)}"
        typer.echo(f"{left:<{width}}# {source}")


_ARGV: list[str] = []


def remember_argv(argv: list[str]) -> None:
    """The command line as given (app.main keeps it): the launcher re-runs it on every process."""
    _ARGV[:] = list(argv)


def invoked_argv() -> list[str]:
    return list(_ARGV)
