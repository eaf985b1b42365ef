"""One Rich console on stderr for everything difftrain tells the user."""

from __future__ import annotations

import os

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

# no hard wraps: messages stay greppable; no :emoji: codes (a file named :fire:.png is printed as it is)
console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


def debug_enabled() -> bool:
    return os.environ.get("DIFFTRAIN_DEBUG", "") not in ("", "0", "false", "False")


def quiet_rank() -> bool:
    """True in every process but the first of a multi-process run: they print nothing but their errors."""
    return os.environ.get("RANK", "0") not in ("", "0")


def info(msg: str, markup: bool = False) -> None:
    """Print ``msg`` as it is (file names may hold ``[...]``); ``markup=True`` for Rich's [style] tags."""
    if not quiet_rank():
        console.print(msg, markup=markup)


def warn(msg: str) -> None:
    if not quiet_rank():
        console.print(f"[yellow]warning:[/yellow] {escape(msg)}")


def progress(*extra_columns, transient: bool = False) -> Progress:
    """A progress bar with count, elapsed and ETA, plus any extra text columns."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *extra_columns,
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
        disable=os.environ.get("DIFFTRAIN_PROGRESS", "") == "0" or quiet_rank(),
    )


class RateColumn(ProgressColumn):
    """Optimizer steps per second (or seconds per step when slower than 1 it/s)."""

    def render(self, task) -> Text:
        speed = task.speed
        if not speed:
            return Text("-- it/s")
        return Text(f"{speed:.2f} it/s" if speed >= 1 else f"{1 / speed:.2f} s/it")
