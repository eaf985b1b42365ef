"""difftrain sweep and difftrain sweep report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .options import ConfigOpt, DataDirOpt, ModelOpt, RecipeOpt, SetOpt, shortcuts

app = typer.Typer(help="Many trainings over one precompute cache, one results table.", invoke_without_command=True)


@app.callback()
def sweep(
    ctx: typer.Context,
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    data_dir: DataDirOpt = None,
    model: ModelOpt = None,
    grid: Annotated[
        list[str] | None, typer.Option("--grid", "-g", help="an axis: path=v1,v2,... (repeatable; every combination)")
    ] = None,
    dist: Annotated[
        list[str] | None,
        typer.Option(
            "--dist", help="a random axis: path=log_uniform:LO:HI | uniform:LO:HI | int_uniform:LO:HI | choice:a,b"
        ),
    ] = None,
    random_: Annotated[
        int | None, typer.Option("--random", help="random search: this many trials (grid axes become choices)")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="random search seed: the same seed gives the same trials")] = 0,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="a sweep YAML (recipe, config, set, grid, random)")
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option("--gpus", help="trials in parallel, one per GPU: a count (4) or ids (0,1; 0,0,1,1: two on each)"),
    ] = None,
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", "-o", help="the sweep folder (default sweeps/<recipe>)")
    ] = None,
    sort: Annotated[str | None, typer.Option("--sort", help="sort the table by this column (e.g. val_loss)")] = None,
    sampler: Annotated[
        str | None,
        typer.Option("--sampler", help="grid | random | tpe (default: grid, or random with --random N)"),
    ] = None,
    prune: Annotated[
        str | None,
        typer.Option(
            "--prune",
            help="none | median | hyperband: stop losing trials at their validation steps (default none)",
        ),
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(
            "--storage",
            help="the Optuna study's storage: an SQLAlchemy URL (postgresql://user:pass@host/db) or a journal file "
            "path; several processes or machines share it (default: study.db in the sweep folder)",
        ),
    ] = None,
    study: Annotated[
        str | None, typer.Option("--study", help="the study's name in the storage (default: the sweep folder's name)")
    ] = None,
    heartbeat_interval: Annotated[
        int, typer.Option("--heartbeat-interval", min=1, help="seconds between a running trial's heartbeats")
    ] = 60,
    grace_period: Annotated[
        int | None,
        typer.Option(
            "--grace-period",
            min=1,
            help="seconds without a heartbeat before a trial counts as lost and is retried (default: 2 intervals)",
        ),
    ] = None,
) -> None:
    """Train every trial of a grid, random or TPE search over one cache (Optuna); the same command in several
    processes or on several machines shares one study; rerun to continue an interrupted sweep."""
    if ctx.invoked_subcommand is not None:
        return
    from ..errors import UsageError
    from ..flows.sweep import StudyOptions, SweepSpec, load_spec, parse_dist, parse_gpus, parse_grid, run_sweep

    spec = load_spec(spec_file) if spec_file else SweepSpec()
    spec.recipe = recipe or spec.recipe
    spec.config = config or spec.config
    spec.sets = spec.sets + list(set_ or [])
    spec.extra = shortcuts(data_dir, model, False)
    for item in grid or []:
        path, values = parse_grid(item)
        spec.grid[path] = values
    for item in dist or []:
        path, d = parse_dist(item)
        spec.dists[path] = d
    if random_ is not None:
        if random_ < 1:
            raise UsageError("--random must be a positive number of trials.")
        spec.trials, spec.seed = random_, seed
    elif spec_file is None or spec.trials is None:
        spec.seed = seed
    spec.sampler = sampler or spec.sampler
    spec.prune = prune or spec.prune
    if spec.recipe:
        name = Path(spec.recipe).stem
    elif spec.config is not None:
        name = spec.config.stem
    else:
        raise UsageError(
            "A sweep needs a base config.", hint="Give --recipe NAME and/or --config FILE (or recipe: in --spec)."
        )
    options = StudyOptions(storage, study, heartbeat_interval, grace_period)
    run_sweep(spec, output_dir or Path("sweeps") / name, gpus=parse_gpus(gpus), sort=sort, options=options)


@app.command("report")
def report(
    folder: Annotated[Path, typer.Argument(help="a sweep folder")],
    sort: Annotated[
        str | None,
        typer.Option(
            "--sort",
            help="a column: trial, number, status, final_loss, best_loss, val_loss, s_per_step, gpu_peak_alloc_gib, or a swept path",
        ),
    ] = None,
    descending: Annotated[bool, typer.Option("--desc", help="largest first")] = False,
    storage: Annotated[
        str | None,
        typer.Option("--storage", help="the study's storage, where sweep.json does not keep it (a password)"),
    ] = None,
) -> None:
    """Redraw a sweep's table, CSV/JSON and report.html from its trial folders."""
    from ..errors import UsageError
    from ..flows.sweep import write_results

    if not (folder / "sweep.json").is_file():
        raise UsageError(
            f"{folder} is not a sweep folder (no sweep.json).", hint="Give the -o folder of `difftrain sweep`."
        )
    write_results(folder, sort=sort, descending=descending, storage=storage)
    typer.echo(str(folder / "report.html"))
