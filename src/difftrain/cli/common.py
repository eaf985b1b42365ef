"""Helpers the command files share: resolving a config and printing it."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..config.load import Resolved, resolve


def resolved_config(recipe, config_file: Path | None, sets, extra: dict | None = None) -> Resolved:
    return resolve(recipe=recipe, config_file=config_file, sets=sets, extra=extra)


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
