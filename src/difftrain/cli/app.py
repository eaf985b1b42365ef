"""The Typer root: commands, and the one place errors become messages and exit codes."""

from __future__ import annotations

import os
import sys
import traceback

# The libraries' own chatter (weight-loading bars, optional-backend notices) is
# not for difftrain's users; DIFFTRAIN_DEBUG=1 brings it back.
if os.environ.get("DIFFTRAIN_DEBUG", "") in ("", "0"):
    for _k, _v in (
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("DIFFUSERS_VERBOSITY", "error"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
    ):
        os.environ.setdefault(_k, _v)

import typer
from rich.markup import escape

from ..console import console, debug_enabled
from ..errors import DifftrainError, is_oom, unexpected_words

app = typer.Typer(
    name="difftrain",
    help="Fine-tune diffusion models, LoRA or full, on the GPU you own: SDXL, SD3, Flux.1, FLUX.2, Qwen-Image, Z-Image, Krea 2, CogVideoX and Wan.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion, the usual typer way
)


def _register() -> None:
    from . import (
        bench_cmd,
        cache_cmd,
        convert_cmd,
        data_cmds,
        doctor_cmd,
        lora_cmd,
        plan_cmd,
        quickstart_cmd,
        recipes_cmd,
        sweep_cmd,
        train_cmd,
    )

    app.command("quickstart")(quickstart_cmd.quickstart)
    app.command("merge-tags")(data_cmds.merge_tags)
    app.command("precompute")(data_cmds.precompute)
    app.command("train")(train_cmd.train)
    app.command("export")(train_cmd.export)
    app.command("convert-args")(convert_cmd.convert_args)
    app.command("plan")(plan_cmd.plan)
    app.command("doctor")(doctor_cmd.doctor)
    app.add_typer(sweep_cmd.app, name="sweep")
    app.add_typer(cache_cmd.app, name="cache")
    app.add_typer(bench_cmd.app, name="bench")
    app.add_typer(recipes_cmd.app, name="recipes")
    app.add_typer(lora_cmd.app, name="lora")


_register()


def _version(value: bool) -> None:
    if value:
        import platform

        import torch

        from .. import __version__

        print(  # plain, never wrapped: scripts read it
            f"difftrain {__version__} (Python {platform.python_version()}, torch {torch.__version__}, "
            f"typer {_dist_version('typer')}, diffusers {_dist_version('diffusers')})"
        )
        raise typer.Exit()


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print difftrain's version (and torch's) and exit"
    ),
) -> None:
    """Fine-tune diffusion models, LoRA or full, on the GPU you own: SDXL, SD3, Flux.1, FLUX.2, Qwen-Image, Z-Image, Krea 2, CogVideoX and Wan."""


def _cli_exceptions() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(exit, usage/click errors, abort) exception classes of the click that typer runs on: typer 0.29 bundles its
    own copy (``typer._click``), whose exceptions are not click's; older typers raise click's own. Both are
    matched, so a usage error is shown as click shows it (usage line, problem, exit code 2) with either."""
    import importlib

    exits: list[type] = [typer.Exit]
    errors: list[type] = []
    aborts: list[type] = [typer.Abort]
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        errors.append(mod.ClickException)
        exits += [mod.Exit] if hasattr(mod, "Exit") else []
        aborts += [mod.Abort] if hasattr(mod, "Abort") else []
    return tuple(exits), tuple(errors), tuple(aborts)


def _peer_lost(e: BaseException) -> bool:
    """Whether ``e`` says another process of the group died (read only under a launcher, where torch, which
    difftrain.runtime.distributed imports, is loaded already: a usage error stays quick)."""
    from ..runtime.distributed import PEER_LOST

    return any(m in str(e) for m in PEER_LOST)


def report_error(e: BaseException) -> int:
    """Print an error the user can act on; return the exit code."""
    # several processes: say which one failed, on the same line (their lines interleave)
    who = (
        f"[bold]rank {os.environ.get('RANK', '?')}:[/bold] "
        if os.environ.get("WORLD_SIZE", "1") not in ("", "1")
        else ""
    )
    if isinstance(e, DifftrainError) and e.said_elsewhere:
        code = e.exit_code
    elif isinstance(e, DifftrainError):
        # messages quote file names and values, which may hold [...]: printed as they are, never as markup
        console.print(f"{who}[bold red]error:[/bold red] {escape(e.message)}")
        for path, msg in getattr(e, "problems", []):
            console.print(f"  [cyan]{escape(str(path))}[/cyan]: {escape(str(msg))}")
        if e.hint:
            console.print(f"[bold]next:[/bold] {escape(e.hint)}")
        code = e.exit_code
    elif isinstance(e, KeyboardInterrupt):
        console.print("[yellow]interrupted[/yellow]")
        code = 130
    elif who and _peer_lost(e) and not is_oom(e):
        # another process of the group died first (the OOM killer, a kill -9, a lost GPU): this one lost its peer
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        console.print(f"{who}[bold red]error:[/bold red] lost a process of the group ({escape(first)})")
        console.print(
            "[bold]next:[/bold] the process that ended first is named above or below; torchrun's agent restarts the "
            "group while train.max_restarts allows."
        )
        code = 1
    else:  # memory ran out, or an unexpected error
        message, hint = unexpected_words(e)
        console.print(f"{who}[bold red]error:[/bold red] {escape(message)}")
        console.print(f"[bold]next:[/bold] {escape(hint)}")
        code = 1
    if debug_enabled():
        traceback.print_exception(e)
    return code


def main(argv: list[str] | None = None) -> None:
    from .common import remember_argv

    remember_argv(sys.argv[1:] if argv is None else argv)
    try:
        rv = app(args=argv, standalone_mode=False)
        if isinstance(rv, int):  # click returns Exit codes (e.g. --help) in this mode
            sys.exit(rv)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the top of the program: every error ends here
        exits, errors, aborts = _cli_exceptions()
        if isinstance(e, exits):
            sys.exit(getattr(e, "exit_code", 0))
        if isinstance(e, errors):
            e.show()  # type: ignore[attr-defined]  # click's and typer's ClickException both have show()
            sys.exit(getattr(e, "exit_code", 1))
        if isinstance(e, aborts):
            console.print("[yellow]aborted[/yellow]")
            sys.exit(1)
        sys.exit(report_error(e))
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()
