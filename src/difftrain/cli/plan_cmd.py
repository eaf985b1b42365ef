"""difftrain plan: predicted peak GPU memory and host RAM, before any weight is loaded."""

from __future__ import annotations

import re
from typing import Annotated

import typer
from rich.table import Table

from ..config.load import resolve
from ..console import console, info
from ..errors import ConfigError, UsageError
from .common import resolved_config
from .options import ConfigOpt, RecipeOpt, SetOpt


def parse_size(text: str) -> float:
    """'8GiB', '8 GB', '8G', '8192MiB', '8' -> GiB."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([GMT]?)(i?B)?\s*", text or "", re.IGNORECASE)
    if not m:
        raise UsageError(f"Cannot read the size {text!r}.", hint="Write it like 8GiB, 24GB or 8192MiB.")
    value, unit = float(m.group(1)), m.group(2).upper()
    return value * {"": 1, "G": 1, "M": 1 / 1024, "T": 1024}[unit]


def _table(title: str, e) -> Table:
    t = Table(title=title)
    t.add_column("term")
    t.add_column("GPU GiB", justify="right")
    t.add_column("host GiB", justify="right")
    keys = list(dict.fromkeys([*e.gpu, *e.host]))
    for k in keys:
        g, h = e.gpu.get(k), e.host.get(k)
        t.add_row(k, "" if g is None else f"{g:.2f}", "" if h is None else f"{h:.2f}")
    t.add_row("[bold]total allocated[/bold]", f"[bold]{e.gpu_total:.2f}[/bold]", f"[bold]{e.host_total:.2f}[/bold]")
    t.add_row("reserved by the allocator (est.)", f"{e.gpu_reserved:.2f}", "")
    for k, v in e.card.items():  # outside torch's allocator: on every real card all the same
        t.add_row(k, f"{v:.2f}", "")
    t.add_row("[bold]total on the card[/bold]", f"[bold]{e.card_total:.2f}[/bold]", "")
    return t


def plan(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    vram: Annotated[
        str | None,
        typer.Option(
            "--vram",
            help="the card to fit, e.g. 8GiB (its whole memory: the CUDA context, libraries and a display margin "
            "are counted): prints the fastest plan that fits",
        ),
    ] = None,
    ram: Annotated[str | None, typer.Option("--ram", help="host RAM to fit in, e.g. 32GiB")] = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            min=1,
            help="GPUs training together (train --gpus N): the plan is one GPU's; with --vram the search also "
            "tries DeepSpeed's ZeRO stages for full fine-tunes (default: the GPUs the recipe names, else 1)",
        ),
    ] = None,
) -> None:
    """Predict the peak GPU memory and host RAM of a config (no weight is loaded); with --vram, find what fits."""
    from ..config.recipes import recipe_gpus, recipe_names
    from ..planning.engines import choose_engine, expected_scaling, launch_problem
    from ..planning.estimate import plan_memory
    from ..runtime.distributed import engine_problem

    if gpus is None:  # a recipe for several GPUs (qwen-image-full-2x80gb) is planned on them
        gpus = recipe_gpus(recipe) if recipe and recipe in recipe_names() else 1
    res = resolved_config(recipe, config, set_)
    cfg = res.config
    line = None
    if gpus > 1 and cfg.memory.engine.kind == "auto":
        if vram is None:
            info("engine auto chooses at start from each GPU's memory: --vram XGiB shows what it would choose")
        else:  # the choice train --gpus N makes on GPUs of that size, and the plan of what it chose
            cfg, line = choose_engine(cfg, gpus, parse_size(vram))
    e = plan_memory(cfg, gpus)
    where = f", one of {gpus} GPUs ({cfg.memory.engine.kind})" if gpus > 1 else ""
    console.print(
        _table(
            f"plan: {cfg.family} {cfg.train.method}, batch {cfg.train.batch_size}, {cfg.data.resolution}px{where}", e
        )
    )
    if line:
        info(line)
    scaling = expected_scaling(cfg, gpus)  # None for auto left unresolved (no --vram) and on one GPU
    if scaling:
        info(scaling)
    problem = engine_problem(cfg, gpus) if line else launch_problem(cfg, gpus)
    if problem:
        info(f"[yellow]note:[/yellow] {problem}", markup=True)
    for n in e.notes:
        info(f"[yellow]note:[/yellow] {n}", markup=True)
    if vram is None:
        return
    _fastest_fit(cfg, recipe, config, set_, vram, ram, gpus)


def _fastest_fit(cfg, recipe, config, set_, vram: str, ram: str | None, gpus: int) -> None:
    """plan --vram: what precompute does on that card, and the fastest of the planner's candidates predicted to fit
    it (and --ram), printed as --set lines; exit 1 when none does."""
    from ..families.registry import get_family
    from ..memory.planner import as_set_lines, candidates, speed_cost
    from ..planning.estimate import memory_hints, plan_memory, precompute_lines
    from ..runtime.distributed import engine_problem

    limit, host_limit = parse_size(vram), parse_size(ram) if ram else None
    for pre in precompute_lines(cfg, limit):
        info(pre, markup=True)
    fits = []
    tuned = bool(get_family(cfg.family).zero3_settings)  # ZeRO-3's measured settings for the family
    hints = memory_hints(cfg)
    offload_blocks = hints.get("checkpoint_blocks", 0) if hints.get("checkpoint_input_bytes") else 0
    for override in candidates(cfg, len(hints.get("swap_units", [])), gpus, offload_blocks):
        try:
            c = resolve(recipe=recipe, config_file=config, sets=set_, extra=override).config
        except ConfigError:
            continue  # an incompatible pair: the validator says no
        if engine_problem(c, gpus):
            continue  # cannot train on this many processes (fused_backward under DDP)
        est = plan_memory(c, gpus)
        if est.unknown_activations:
            continue  # its activations are not known: no fit can be promised (Wan without checkpointing)
        if est.card_total <= limit and (host_limit is None or est.host_total <= host_limit):
            fits.append((speed_cost(c, gpus, tuned), est.card_total, override, est))
    if not fits:
        info(
            f"[red]Nothing difftrain offers is predicted to fit a {limit:g} GiB card"
            + ("" if host_limit is None else f" with {host_limit:g} GiB of host RAM")
            + "[/red] (lower train.batch_size or data.resolution, or use a larger GPU"
            + ("" if host_limit is None else " or more RAM")
            + ").",
            markup=True,
        )
        raise typer.Exit(1)
    # equal cost: fewer blocks swapped (less copying), then less memory
    fits.sort(
        key=lambda f: (f[0], getattr(f[2]["memory"].get("offload"), "get", lambda k, d: d)("blocks_to_swap", 0), f[1])
    )
    cost, reserved, override, est = fits[0]
    info(
        f"fastest plan predicted to fit a {limit:g} GiB card: {reserved:.2f} GiB on the card "
        f"({est.gpu_reserved:.2f} reserved by torch), step time x{cost:.2f} of the unconstrained run"
    )
    typer.echo("\n".join(as_set_lines(override)))
