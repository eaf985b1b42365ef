"""difftrain train and difftrain export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..console import info
from .common import print_config, resolved_config, with_hub_model
from .options import (
    AllowPickleOpt,
    ConfigOpt,
    DataDirOpt,
    DatasetConfigOpt,
    ModelOpt,
    PrintConfigOpt,
    RecipeOpt,
    SetOpt,
    shortcuts,
)


def train(
    recipe: RecipeOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    data_dir: DataDirOpt = None,
    dataset_config: DatasetConfigOpt = None,
    model: ModelOpt = None,
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", "-o", help="shortcut for --set train.output_dir=...")
    ] = None,
    allow_pickle: AllowPickleOpt = False,
    resume: Annotated[str | None, typer.Option("--resume", help="a checkpoint folder, or 'latest'")] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="the output folder holds an earlier run: remove its checkpoints, metrics and exports, then start "
            "this run there",
        ),
    ] = False,
    save_precision: Annotated[
        str | None, typer.Option("--save-precision", help="fp16 | bf16 | fp32: shortcut for --set save.precision=...")
    ] = None,
    strict_memory: Annotated[
        bool, typer.Option("--strict-memory", help="refuse to start when the plan exceeds free GPU memory")
    ] = False,
    print_config_: PrintConfigOpt = False,
    no_precompute: Annotated[
        bool,
        typer.Option(
            "--no-precompute",
            help="train from the cache as it is: refuse when it lacks something, instead of encoding what is missing "
            "first (as `difftrain precompute` would)",
        ),
    ] = False,
    gpus: Annotated[int, typer.Option("--gpus", help="processes (GPUs) on this machine, started through torchrun")] = 1,
    nodes: Annotated[
        int,
        typer.Option("--nodes", help="machines taking part (with --node-rank and --master-addr, or --rdzv-endpoint)"),
    ] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", help="this machine's index, 0 .. nodes-1")] = 0,
    master_addr: Annotated[
        str | None, typer.Option("--master-addr", help="address of the node with --node-rank 0")
    ] = None,
    master_port: Annotated[int | None, typer.Option("--master-port", help="its port (default 29500)")] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option("--rdzv-endpoint", help="HOST:PORT of torchrun's c10d rendezvous (instead of --master-addr)"),
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            "--max-restarts",
            min=0,
            help="shortcut for --set train.max_restarts=...: restarts of the process group after a process dies",
        ),
    ] = None,
) -> None:
    """Train (LoRA or full): a recipe plus your overrides. What the precompute cache lacks for the config (latents,
    caption embeddings) is encoded first, as `difftrain precompute` would (--no-precompute refuses instead)."""
    import os

    from ..trainers.loop import train as run

    if recipe and "LOCAL_RANK" not in os.environ:
        _recipe_gpus_note(recipe, gpus * nodes)
    if (gpus > 1 or nodes > 1) and "LOCAL_RANK" not in os.environ:
        where = {
            "nodes": nodes,
            "node_rank": node_rank,
            "master_addr": master_addr,
            "master_port": master_port,
            "rdzv_endpoint": rdzv_endpoint,
        }
        extra = _extra(data_dir, model, allow_pickle, output_dir, None, max_restarts, dataset_config)
        _launch(recipe, config, set_, extra, gpus, where, resume, overwrite, no_precompute)
        return

    extra = _extra(data_dir, model, allow_pickle, output_dir, save_precision, max_restarts, dataset_config)
    given = resolved_config(recipe, config, set_, extra)
    if print_config_:
        print_config(given)
        return
    for label, _, res in _runs(given, recipe, config, set_, extra):  # one, or a two-expert model's two (both)
        if label:
            info(f"model.expert both: the {label} expert, into {res.config.train.output_dir}")
        with_hub_model(res)
        _check_start(res.config)
        if not no_precompute and "LOCAL_RANK" not in os.environ:  # under torchrun the launching process did it
            precompute_missing(res.config)
        check_memory(res.config, strict_memory)
        r = run(res.config, resume=resume, config_yaml=res.to_yaml(), overwrite=overwrite)
        last = f"{r.losses[-1]:.4f}" if r.losses else "n/a"
        info(f"trained {r.steps} steps in {r.seconds:.0f} s (last loss {last})")
        if r.lora_path:
            info(f"LoRA: {r.lora_path}")
        for p in r.saved:
            info(f"model: {p}")
        if r.checkpoints:
            info(f"checkpoint: {r.checkpoints[-1]}")


def expert_runs(cfg) -> list[tuple[str, list[str]]]:
    """The runs a config makes: itself (``[("", [])]``), or for ``model.expert: both`` the high-noise expert's and
    then the low-noise one's, each with the settings that make it (its expert, its folder under train.output_dir).
    The experts share no weights, so training them one after the other is training them together (musubi-tuner
    interleaves them by timestep) with one expert's weights in memory at a time."""
    if cfg.model.expert != "both":
        return [("", [])]
    out = cfg.train.output_dir
    return [(e, [f"model.expert={e}", f"train.output_dir={out / e}"]) for e in ("high_noise", "low_noise")]


def _runs(res, recipe, config, set_, extra):
    """Each run of :func:`expert_runs` with its resolved config (``res`` itself for a single run): (label, sets,
    resolved)."""
    for label, sets in expert_runs(res.config):
        yield label, sets, resolved_config(recipe, config, [*(set_ or []), *sets], extra) if label else res


def _recipe_gpus_note(recipe: str, processes: int) -> None:
    """A recipe for several GPUs (its header's ``GPUs: N``) run on fewer: each holds more than the recipe planned."""
    from ..config.recipes import recipe_gpus, recipe_names, recipe_tier
    from ..console import warn

    if recipe in recipe_names() and recipe_gpus(recipe) > processes:
        n = recipe_gpus(recipe)
        warn(
            f"{recipe} is a recipe for {n} GPUs of {recipe_tier(recipe):g} GB training together, and this run has "
            f"{processes}: each GPU holds its share of 1/{processes} of the model instead of 1/{n}. Add --gpus {n} "
            "(or check the fit first: difftrain plan --recipe ... --gpus N)."
        )


def _launch(
    recipe, config, set_, extra: dict, gpus: int, where: dict, resume: str | None, overwrite: bool, no_precompute: bool
) -> None:
    """``train --gpus N`` / ``--nodes M`` on the launching process: the config checked once, the Hub model fetched
    and the cache completed once, then the run folder claimed and torchrun's elastic agent started."""
    nodes, node_rank = where["nodes"], where["node_rank"]
    from ..errors import UsageError
    from .common import invoked_argv

    if gpus < 1 or nodes < 1 or not 0 <= node_rank < nodes:
        raise UsageError(
            f"--gpus {gpus} --nodes {nodes} --node-rank {node_rank}: need gpus >= 1 and 0 <= node-rank < nodes."
        )
    given = resolved_config(recipe, config, set_, extra)  # config errors, once
    from ..errors import ConfigError
    from ..planning.engines import launch_problem
    from ..runtime.distributed import ENGINE_HINT

    for label, sets, res in _runs(given, recipe, config, set_, extra):  # a two-expert model's two, in turn (both)
        problem = launch_problem(res.config, gpus * nodes)
        if problem:
            raise ConfigError(problem, hint=ENGINE_HINT)
        with_hub_model(res)  # fetched once here: the processes find it in the cache
        _check_start(res.config)
        if not no_precompute:  # once, here, before the processes start
            if nodes > 1 and res.config.data.dir is not None:  # machines sharing one cache take turns
                from ..data.cache import cache_dir_for
                from ..runtime.locks import writer_lock

                with writer_lock(cache_dir_for(res.config), "cache", wait_s=3600):
                    precompute_missing(res.config)
            else:
                precompute_missing(res.config)
        where = {**where, "max_restarts": res.config.train.max_restarts}
        argv = [*invoked_argv(), *(x for s in sets for x in ("--set", s))]  # the processes run this expert's run
        launch_claimed(res.config.train.output_dir, gpus, argv, resume, overwrite, node_rank, where)
        info(f"trained on {gpus * nodes} processes" + (f" ({label} expert)" if label else ""))


def _extra(data_dir, model, allow_pickle, output_dir, save_precision, max_restarts, dataset_config=None) -> dict:
    """The train command's shortcut options as config values."""
    extra = shortcuts(data_dir, model, allow_pickle, dataset_config)
    t = extra.setdefault("train", {})
    if output_dir is not None:
        t["output_dir"] = str(output_dir)
    if max_restarts is not None:
        t["max_restarts"] = max_restarts
    if save_precision is not None:
        extra.setdefault("save", {})["precision"] = save_precision
    if not t:
        extra.pop("train")
    return extra


def launch_claimed(out, gpus: int, argv: list[str], resume, overwrite: bool, node_rank: int, where: dict) -> None:
    """``--gpus N`` / ``--nodes``: the first machine's launcher takes the run folder's lock and claims it for this
    run (``run_folder.claim``: refusals, ``--overwrite``) once, before any process starts, and holds the lock while
    torchrun's agent runs the processes, across its restarts; the workers are told so (DIFFTRAIN_CLAIMED) and an
    elastic restart continues from the newest checkpoint. Another machine's launcher (``--node-rank`` above 0)
    leaves the folder to the first one (on several machines it is one shared folder)."""
    import contextlib
    import os

    from ..runtime.distributed import launch
    from ..runtime.locks import writer_lock
    from ..trainers import run_folder as rf

    first = node_rank == 0
    with writer_lock(out, "run folder") if first else contextlib.nullcontext():
        if first:
            claim = rf.claim(out, resume, overwrite)
            rf.clear_failure(out)
            rf.take(out, claim)
        before = os.environ.get(rf.ENV_CLAIMED)
        os.environ[rf.ENV_CLAIMED] = "1"
        try:
            launch(gpus, argv, failure_note=out / rf.FAILED_FILE, **where)
        finally:
            if before is None:
                os.environ.pop(rf.ENV_CLAIMED, None)
            else:
                os.environ[rf.ENV_CLAIMED] = before


def export(
    run_dir: Annotated[Path, typer.Argument(help="a training output folder")],
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="'latest' or a checkpoint folder")] = "latest",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="where to write the LoRA .safetensors")] = None,
) -> None:
    """Export the LoRA of a checkpoint as pytorch_lora_weights.safetensors (diffusers layout; a LoHa or LoKr as
    lora_kohya.safetensors, the kohya/LyCORIS layout, as diffusers loads neither)."""
    from ..errors import CheckpointError
    from ..trainers.checkpoint import resolve_resume
    from ..trainers.export import LORA_FILE
    from ..utils import atomic_write_bytes

    folder = resolve_resume(run_dir, checkpoint)
    src = folder / LORA_FILE
    if not src.exists():  # LoHa / LoKr: the checkpoint's copy is the kohya/LyCORIS file
        found = sorted(folder.glob("lora_kohya*.safetensors"))
        if not found:
            raise CheckpointError(
                f"The checkpoint {folder} holds no LoRA file (a full fine-tune's checkpoint?).",
                hint="Export a LoRA run's checkpoint; a full fine-tune's model is written by save.formats.",
            )
        src = found[0]
    dest = out or (run_dir / src.name)
    if dest.is_dir():
        dest = dest / src.name
    atomic_write_bytes(dest, src.read_bytes())
    info(f"exported {folder.name} -> {dest}")


def _check_start(cfg) -> None:
    """What would stop the run later, said before precompute encodes anything."""
    from ..families.registry import get_family
    from ..trainers.validation import check_inputs

    family = get_family(cfg.family)
    check_inputs(cfg, family)
    if (
        cfg.train.method == "lora"
    ):  # a LoRA file the family cannot write (LoHa without kohya names, LoKr on a fused qkv)
        from ..lora import files as lora_files

        lora_files.formats(cfg, family)
        lora_files.check_kohya_names(cfg, family, [family.denoiser])


def precompute_missing(cfg) -> None:
    """The one-command flow: encode what the cache lacks for ``cfg`` (nothing when it is complete: every latent and
    caption is found by its content key) and say so; a config without data.dir (or data.subsets) trains from its cache
    as it is."""
    if cfg.data.dir is None and not cfg.data.subsets:
        return
    from ..precompute.run import precompute

    info("precompute: the cache is checked against the data and the model, and what it lacks is encoded first")
    r = precompute(cfg)
    info(
        f"precompute: latents {r.latents_encoded} encoded, {r.latents_reused} reused; captions {r.texts_encoded} "
        f"encoded, {r.texts_reused} reused; {len(r.skipped)} skipped -> {r.cache_dir}"
    )


def check_memory(cfg, strict: bool) -> None:
    """Compare the planner's prediction with the host's available RAM and the GPU's free memory before loading
    anything: a warning each (``strict``: an error)."""
    import os

    import torch

    from ..config.recipes import recipe_measurements, recipes_within
    from ..console import warn
    from ..errors import DifftrainError
    from ..flows.doctor import host_ram_gib
    from ..planning.estimate import plan_memory
    from ..utils import pick_device

    plan = plan_memory(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # each process's share under torchrun
    short: list[tuple[str, str]] = []
    avail = host_ram_gib()[1]
    device = pick_device(cfg.train.device)
    if avail is not None and plan.host_total > avail:
        term, gib = max(plan.host.items(), key=lambda kv: kv[1])
        card = torch.cuda.mem_get_info(device)[1] / 2**30 if device.type == "cuda" else None
        fits = recipes_within(cfg.family, cfg.train.method, avail, card)
        measured = recipe_measurements()["recipes"]
        named = ", ".join(f"{n} ({measured[n]['host_rss_gib']:.1f} GiB measured)" for n in fits[:3])
        short.append(
            (
                f"The plan needs about {plan.host_total:.1f} GiB of host RAM (the largest term: {term}, {gib:.1f} GiB) "
                f"and {avail:.1f} GiB is available.",
                (f"Recipes that fit it: {named}. " if fits else "")
                + f"`difftrain plan ... --ram {avail:.0f}GiB` prints settings predicted to fit; or close programs.",
            )
        )
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] / 2**30
        need = plan.free_needed
        if need > free:
            short.append(
                (
                    f"The plan needs about {need:.1f} GiB of GPU memory ({plan.gpu_reserved:.1f} reserved by torch, "
                    f"{need - plan.gpu_reserved:.1f} for the CUDA libraries) and {free:.1f} GiB is free.",
                    f"`difftrain plan ... --vram {free:.0f}GiB` prints settings predicted to fit.",
                )
            )
    for msg, hint in short:
        if strict:
            raise DifftrainError(msg, hint=hint)
        warn(f"{msg} {hint}")
