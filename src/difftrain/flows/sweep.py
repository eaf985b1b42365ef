"""difftrain sweep: many trainings over one precompute cache, one results table.

A sweep is a base config (recipe, config file, ``--set`` overrides, as for
``difftrain train``) plus axes over any config path:

* grid axes, ``path: [v1, v2, ...]`` (``--grid path=v1,v2``): every combination;
* random search, ``random: {trials: N, seed: S, axes: {...}}`` (``--random N --seed S``,
  ``--dist path=log_uniform:1e-5:1e-3``): N trials, each axis drawn from its
  distribution (``log_uniform: [lo, hi]``, ``uniform: [lo, hi]``, ``int_uniform: [lo, hi]``,
  ``choice: [...]``); grid axes then act as choices. The same seed gives the same trials.

As a YAML file (``difftrain sweep --spec sweep.yaml``)::

    recipe: sdxl-lora-8gb
    set: {data.dir: /data/cats, train.max_steps: 1000}
    grid:
      train.learning_rate: [1.0e-4, 3.0e-4]
      lora.rank: [16, 64]
    random: {trials: 8, seed: 0, axes: {train.lr_scheduler: {choice: [constant, cosine]}}}

Trials. Each trial is named by a hash of its values (``trials/t-<8 hex>/``), so a
rerun of the same sweep finds its trials again: finished ones (ok, failed, oom,
nan) are skipped, an interrupted one resumes from its last checkpoint. Every
trial folder holds its resolved ``config.yaml``, the run's files (metrics.jsonl,
TensorBoard events, report.html) and ``result.json``. The cache is built before
the first trial, once per distinct data/model/precompute setting, in this
process; trials then run in child processes (``python -m difftrain.flows.sweep
TRIAL_DIR``), one after another, or one per GPU at once with ``gpus`` (each child
sees one device through CUDA_VISIBLE_DEVICES). A child per trial keeps one trial's
out-of-memory, divergence or crash from taking down the sweep, and gives every
trial a fresh CUDA allocator.

Results: results.csv, results.json and trials.jsonl (one row per trial: the swept
values, status, final/best/validation loss, s/step, peak GPU memory, seconds,
error), a Rich table, report.html with every trial's curves overlaid, and a
TensorBoard hparams summary in ``tensorboard/``. ``difftrain sweep report DIR``
redraws all of it, sorted by any column.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config.load import Resolved, parse_set, read_yaml, resolve, validate
from ..console import info, warn
from ..errors import ConfigError, DifftrainError, UsageError
from ..trainers.report import STAT_LABELS, run_summary, write_sweep_report
from ..utils import atomic_write_text, read_json_object

#: statuses of a trial that a rerun does not run again
FINISHED = ("ok", "failed", "oom", "nan")
#: config sections that decide what precompute writes (one precompute per distinct combination)
PRECOMPUTE_SECTIONS = ("family", "model", "text_encoders", "data", "precompute", "dreambooth")
#: the paths an sd-scripts or diffusers user may type for ours
ALIASES = {
    "optimizer.lr": "train.learning_rate",
    "lr": "train.learning_rate",
    "learning_rate": "train.learning_rate",
    "optimizer.kind": "memory.optimizer.kind",
    "rank": "lora.rank",
    "network_dim": "lora.rank",
    "network_alpha": "lora.alpha",
    "steps": "train.max_steps",
    "max_train_steps": "train.max_steps",
}
DISTRIBUTIONS = ("log_uniform", "uniform", "int_uniform", "choice")


# ----------------------------------------------------------------- the spec
@dataclass
class SweepSpec:
    recipe: str | None = None
    config: Path | None = None
    sets: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # the command line's shortcut layer
    grid: dict[str, list] = field(default_factory=dict)
    dists: dict[str, dict] = field(default_factory=dict)
    trials: int | None = None  # random search: how many
    seed: int = 0

    def as_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "config": str(self.config) if self.config else None,
            "set": self.sets,
            "extra": self.extra,
            "grid": self.grid,
            "dists": self.dists,
            "trials": self.trials,
            "seed": self.seed,
        }


def _path(p: str, where: str) -> str:
    p = p.strip()
    if not p or any(not part for part in p.split(".")):
        raise UsageError(f"{where}: {p!r} is not a config path.", hint="Write section.key, e.g. train.learning_rate.")
    return ALIASES.get(p, p)


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: "1e-4,[a, b],'x,y'" -> three values."""
    out: list[str] = []
    depth = 0
    quote: str | None = None
    cur: list[str] = []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur))
    return [v.strip() for v in out if v.strip()]


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _value(text: str) -> Any:
    """A value as --set reads it, with YAML 1.1's gap closed: 1e-4 (no dot) is a number, not text."""
    v = parse_set(f"x={text}")[1]
    if isinstance(v, str) and _NUMBER.match(v.strip()):
        return float(v)
    return v


def parse_grid(item: str) -> tuple[str, list]:
    """``path=v1,v2,...`` -> (path, values), each value read as YAML (numbers, booleans, lists)."""
    if "=" not in item:
        raise UsageError(
            f"--grid {item!r}: expected path=value1,value2,...", hint="e.g. --grid train.learning_rate=1e-4,3e-4"
        )
    path, _, rest = item.partition("=")
    values = [_value(v) for v in _split_top(rest)]
    if not values:
        raise UsageError(f"--grid {item!r} has no values.", hint="e.g. --grid lora.rank=16,64")
    return _path(path, f"--grid {item!r}"), values


def parse_dist(item: str) -> tuple[str, dict]:
    """``path=log_uniform:1e-5:1e-3`` | ``uniform:lo:hi`` | ``int_uniform:lo:hi`` | ``choice:a,b,c``."""
    path, _, rest = item.partition("=")
    kind, _, args = rest.partition(":")
    if kind == "choice":
        return _path(path, f"--dist {item!r}"), _check_dist({"choice": [_value(v) for v in _split_top(args)]}, item)
    return _path(path, f"--dist {item!r}"), _check_dist({kind: [_value(v) for v in args.split(":") if v]}, item)


def _check_dist(d: Any, where: str) -> dict:
    if not isinstance(d, dict) or len(d) != 1 or next(iter(d)) not in DISTRIBUTIONS:
        raise UsageError(
            f"sweep distribution {where!r}: expected one of {', '.join(DISTRIBUTIONS)}.",
            hint="e.g. {log_uniform: [1.0e-5, 1.0e-3]} or {choice: [16, 32, 64]}",
        )
    kind, args = next(iter(d.items()))
    if not isinstance(args, list) or not args:
        raise UsageError(f"sweep distribution {where!r}: {kind} needs a list.", hint="e.g. {uniform: [0.0, 0.1]}")
    if kind != "choice":
        if (
            len(args) != 2
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
            or args[0] > args[1]
        ):
            raise UsageError(
                f"sweep distribution {where!r}: {kind} needs [low, high] numbers with low <= high.",
                hint="e.g. {log_uniform: [1.0e-5, 1.0e-3]}",
            )
        if kind == "log_uniform" and args[0] <= 0:
            raise UsageError(f"sweep distribution {where!r}: log_uniform needs low > 0.")
    return {kind: args}


def load_spec(path: Path) -> SweepSpec:
    """A sweep YAML: recipe, config, set (a mapping or a list of path=value), grid, random {trials, seed, axes}."""
    raw = read_yaml(path, "sweep file")
    unknown = set(raw) - {"recipe", "config", "set", "grid", "random"}
    if unknown:
        raise ConfigError(
            f"The sweep file {path} has unknown keys: {', '.join(sorted(unknown))}.",
            hint="Use recipe, config, set, grid and random.",
        )
    sets, grid_raw, rnd = raw.get("set") or [], raw.get("grid") or {}, raw.get("random")
    for key, ok, what in (
        ("recipe", isinstance(raw.get("recipe"), (str, type(None))), "a recipe name or path"),
        ("config", isinstance(raw.get("config"), (str, type(None))), "a file path"),
        ("set", isinstance(sets, (dict, list)), "a mapping of path: value, or a list of path=value"),
        (
            "grid",
            isinstance(grid_raw, dict) and all(isinstance(k, str) for k in grid_raw),
            "a mapping of path: [values]",
        ),
        (
            "random",
            rnd is None
            or (
                isinstance(rnd, dict)
                and type(rnd.get("trials")) is int
                and rnd["trials"] >= 1
                and type(rnd.get("seed", 0)) is int
                and isinstance(rnd.get("axes") or {}, dict)
                and all(isinstance(k, str) for k in rnd.get("axes") or {})
            ),
            "{trials: N (a positive integer), seed: an integer, axes: {path: distribution}}",
        ),
    ):
        if not ok:
            raise ConfigError(
                f"The sweep file {path}: {key} must be {what}.", hint="`difftrain sweep --help` shows an example."
            )
    if isinstance(sets, dict):
        sets = [f"{k}={_dump(v)}" for k, v in sets.items()]
    grid = {}
    for k, v in grid_raw.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"{path}: grid.{k} must be a non-empty list of values.")
        grid[_path(k, f"{path}: grid")] = v
    spec = SweepSpec(
        recipe=raw.get("recipe"),
        config=Path(raw["config"]) if raw.get("config") else None,
        sets=[str(s) for s in sets],
        grid=grid,
    )
    if rnd is not None:
        spec.trials, spec.seed = rnd["trials"], rnd.get("seed", 0)
        spec.dists = {
            _path(k, f"{path}: random.axes"): _check_dist(v, f"{path}: random.axes.{k}")
            for k, v in (rnd.get("axes") or {}).items()
        }
    return spec


def _dump(v: Any) -> str:
    """A value as the text --set reads back to the same value."""
    if isinstance(v, str):
        return v if parse_set(f"x={v}")[1] == v else json.dumps(v)
    return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def expand(spec: SweepSpec) -> list[dict[str, Any]]:
    """The trials' values, in order: the grid's product, or ``trials`` random draws seeded by ``seed``."""
    axes = list(spec.grid) + [k for k in spec.dists if k not in spec.grid]
    if spec.trials is None:
        if spec.dists:
            raise UsageError(
                "Distributions need random search.", hint="Add --random N (random: {trials: N} in a sweep file)."
            )
        if not spec.grid:
            raise UsageError("The sweep has no axes.", hint="Add --grid path=v1,v2 (or grid:/random: in a sweep file).")
        return [dict(zip(spec.grid, combo)) for combo in itertools.product(*spec.grid.values())]
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.trials):
        values = {}
        for k in axes:
            if k in spec.dists:
                values[k] = _draw(rng, spec.dists[k])
            else:
                values[k] = rng.choice(spec.grid[k])
        out.append(values)
    return out


def _draw(rng: random.Random, dist: dict) -> Any:
    kind, args = next(iter(dist.items()))
    if kind == "choice":
        return rng.choice(args)
    lo, hi = args
    if kind == "log_uniform":
        return float(
            f"{math.exp(rng.uniform(math.log(lo), math.log(hi))):.4g}"
        )  # 4 digits: readable, and still distinct
    if kind == "int_uniform":
        return rng.randint(int(lo), int(hi))
    return float(f"{rng.uniform(lo, hi):.4g}")


def trial_name(values: dict[str, Any], spec: SweepSpec) -> str:
    key = json.dumps(
        {"values": values, "base": [spec.recipe, str(spec.config), spec.sets, spec.extra]}, sort_keys=True, default=str
    )
    return "t-" + hashlib.sha256(key.encode()).hexdigest()[:8]


# ----------------------------------------------------------------- running
@dataclass
class Trial:
    name: str
    values: dict[str, Any]
    folder: Path
    resolved: Resolved | None = None
    error: str | None = None


def _resolve_trial(spec: SweepSpec, values: dict, folder: Path) -> Resolved:
    sets = spec.sets + [f"{k}={_dump(v)}" for k, v in values.items()] + [f"train.output_dir={folder}"]
    return resolve(recipe=spec.recipe, config_file=spec.config, sets=sets, extra=spec.extra)


def _error_text(e: BaseException) -> str:
    msg = getattr(e, "message", None) or str(e) or type(e).__name__
    problems = "; ".join(f"{p}: {m}" for p, m in getattr(e, "problems", []))
    return f"{msg} {problems}".strip()


def _precompute_key(cfg) -> str:
    d = cfg.model_dump(mode="json")
    return json.dumps({k: d.get(k) for k in PRECOMPUTE_SECTIONS}, sort_keys=True)


def parse_gpus(gpus: str | None) -> list[str]:
    """``"4"`` -> ["0", "1", "2", "3"]; ``"0,2"`` -> ["0", "2"]; None -> [] (one trial at a time, devices as configured)."""
    if not gpus:
        return []
    gpus = gpus.strip()
    if gpus.isdigit() and "," not in gpus:
        return [str(i) for i in range(int(gpus))]
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids):
        raise UsageError(f"--gpus {gpus!r}: give a count (4) or device ids (0,1,3).")
    return ids


def run_sweep(spec: SweepSpec, out: Path, gpus: list[str] | None = None, sort: str | None = None) -> list[dict]:
    """Run every unfinished trial of ``spec`` under ``out``; return the results rows (also written to disk). One
    sweep at a time in a folder (its writer lock; each trial's run folder has its own)."""
    from ..runtime.locks import writer_lock

    with writer_lock(Path(out), "sweep folder"):
        return _run_sweep(spec, Path(out), gpus, sort)


def _run_sweep(spec: SweepSpec, out: Path, gpus: list[str] | None, sort: str | None) -> list[dict]:
    values_list = expand(spec)
    trials = []
    for values in values_list:
        name = trial_name(values, spec)
        trials.append(Trial(name, values, out / "trials" / name))
    if len({t.name for t in trials}) < len(trials):
        warn("some trials have the same values (random search drew a point twice): each runs once")
        trials = list({t.name: t for t in trials}.values())
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / "sweep.json",
        json.dumps(
            {
                "spec": spec.as_json(),
                "axes": _axes(spec),
                "trials": [{"name": t.name, "values": t.values} for t in trials],
            },
            indent=1,
            default=str,
        )
        + "\n",
    )

    todo: list[tuple[Trial, Resolved]] = []  # the trials to run, with their configs
    for t in trials:
        done = _read_result(t.folder)
        if done.get("status") in FINISHED:
            continue
        try:
            t.resolved = _resolve_trial(spec, t.values, t.folder)
        except DifftrainError as e:  # an impossible setting: recorded, the sweep goes on
            t.error = _error_text(e)
            _write_result(t.folder, {"status": "failed", "error": t.error, "values": t.values})
            continue
        todo.append((t, t.resolved))
    skipped = len(trials) - len(todo) - sum(t.error is not None for t in trials)
    if skipped:
        info(f"sweep: {skipped} trial(s) already finished in {out} (skipped)")

    # the cache: built once per distinct data/model/precompute setting, before the first trial
    from ..precompute.run import precompute

    built: dict[str, str | None] = {}
    for t, resolved in todo:
        key = _precompute_key(resolved.config)
        if key not in built:
            try:
                r = precompute(resolved.config)
                built[key] = None
                info(
                    f"sweep: cache {r.cache_dir}: {r.latents_encoded} latents and {r.texts_encoded} captions encoded, "
                    f"{r.latents_reused + r.texts_reused} reused"
                )
            except DifftrainError as e:
                built[key] = _error_text(e)
        failed = built[key]
        if failed is not None:
            t.error = "precompute: " + failed
            _write_result(t.folder, {"status": "failed", "error": t.error, "values": t.values})
    todo = [(t, resolved) for t, resolved in todo if t.error is None]

    for t, resolved in todo:
        t.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(t.folder / "config.yaml", resolved.to_yaml())
    _run_trials([t for t, _ in todo], list(gpus or []), len(trials))
    return write_results(out, sort=sort)


def _axes(spec: SweepSpec) -> list[str]:
    return list(spec.grid) + [k for k in spec.dists if k not in spec.grid]


def _short(values: dict) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in values.items())


def _run_trials(todo: list[Trial], gpus: list[str], total: int) -> None:
    """One child process per trial: in turn, or one per GPU at once."""
    slots: Sequence[str | None] = gpus or [None]
    queue = list(todo)
    running: dict[str | None, tuple[Trial, subprocess.Popen, float, Any]] = {}
    n = 0
    try:
        while queue or running:
            for slot in slots:
                if slot not in running and queue:
                    t = queue.pop(0)
                    n += 1
                    info(
                        f"sweep: trial {n}/{len(todo)} {t.name} ({_short(t.values)})"
                        + (f" on GPU {slot}" if slot else "")
                    )
                    running[slot] = (t, *_start(t, slot, len(slots)))
            time.sleep(0.2)
            for slot, (t, proc, t0, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[slot]
                res = _read_result(t.folder)
                if res.get("status") not in FINISHED:  # the child died before it could say (killed, segfault)
                    tail = (t.folder / "train.log").read_text(encoding="utf-8", errors="replace")[-400:]
                    res = {
                        "status": "failed",
                        "values": t.values,
                        "error": f"the trial process ended with exit code {proc.returncode}: {tail.strip()}",
                    }
                    _write_result(t.folder, res)
                info(
                    f"sweep: {t.name}: {res['status']}"
                    + (
                        f" ({res.get('error', '')[:200]})"
                        if res["status"] != "ok"
                        else f", final loss {_fmt(res.get('final_loss'))} in {time.time() - t0:.0f} s"
                    )
                )
    except BaseException:
        for _, proc, _, _log in running.values():  # Ctrl+C: stop the children too; a rerun resumes them
            proc.terminate()
        for _, proc, _, log in running.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        raise


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _start(t: Trial, gpu: str | None, parallel: int) -> tuple[subprocess.Popen, float, Any]:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
        # trials side by side share the host's cores: without a cap each one's thread pools take them all
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
    env.setdefault("DIFFTRAIN_PROGRESS", "0")  # children's bars would interleave; the log has the lines
    src = str(Path(__file__).resolve().parents[1])  # the running difftrain, also when it is not installed
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(t.folder / "train.log", "a", encoding="utf-8")  # noqa: SIM115 (the child writes it; closed when it ends)
    proc = subprocess.Popen(
        [sys.executable, "-m", "difftrain.flows.sweep", str(t.folder)], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    return proc, time.time(), log


def _read_result(folder: Path) -> dict:
    return read_json_object(folder / "result.json")


def _write_result(folder: Path, res: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "result.json", json.dumps(res, indent=1, default=str) + "\n")


def run_trial(folder: Path) -> dict:
    """The child: train the trial's config.yaml (resuming from its last checkpoint), then write result.json
    with the status: ok, oom (out of memory), nan (the loss diverged) or failed (anything else)."""
    import torch

    from ..errors import LossNotFinite
    from ..trainers.checkpoint import resolve_resume
    from ..trainers.loop import train

    folder = Path(folder)
    text = (folder / "config.yaml").read_text(encoding="utf-8")
    cfg = validate(yaml.safe_load(text))
    values = json.loads((folder.parents[1] / "sweep.json").read_text(encoding="utf-8"))
    values = next((t["values"] for t in values["trials"] if t["name"] == folder.name), {})
    resume = None
    try:
        resolve_resume(folder, "latest")
        resume = "latest"
    except DifftrainError:
        pass  # nothing to resume from
    t0 = time.time()
    res: dict[str, Any] = {"values": values, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        # the sweep owns its trial folders: a trial with no checkpoint to continue starts over
        train(cfg, resume=resume, config_yaml=text, overwrite=resume is None)
        res["status"] = "ok"
    except LossNotFinite as e:
        res.update(status="nan", error=_error_text(e))
    except (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError) as e:
        res.update(status="oom", error=str(e).splitlines()[0] if str(e) else "out of memory")
    except Exception as e:  # noqa: BLE001 - every other failure is the trial's, recorded for the table
        res.update(status="oom" if "out of memory" in str(e).lower() else "failed", error=_error_text(e))
    res["seconds"] = round(time.time() - t0, 1)
    res["started"], res["ended"] = round(t0, 2), round(time.time(), 2)
    if res["status"] != "ok":
        print(f"difftrain sweep: trial {folder.name} {res['status']}: {res['error']}", file=sys.stderr)
    res.update(run_summary(folder))
    if res["status"] != "ok":
        try:  # a report of what the trial did before it stopped
            from ..trainers.report import write_run_report

            write_run_report(folder)
        except Exception:  # noqa: BLE001 - the result matters more than its page
            pass
    _write_result(folder, res)
    return res


# ----------------------------------------------------------------- results
RESULT_KEYS = ["status", *STAT_LABELS, "seconds", "error"]


def results_rows(out: Path) -> tuple[list[dict], list[str]]:
    """The rows of every trial in sweep.json (trial, swept values, result) and the swept paths."""
    sweep = json.loads((Path(out) / "sweep.json").read_text(encoding="utf-8"))
    axes = sweep.get("axes") or []
    rows = []
    for t in sweep["trials"]:
        res = _read_result(Path(out) / "trials" / t["name"])
        row = {"trial": t["name"], **{a: t["values"].get(a) for a in axes}}
        row["status"] = res.get("status", "pending")
        for k in RESULT_KEYS[1:]:
            row[k] = res.get(k)
        rows.append(row)
    return rows, axes


def sort_rows(rows: list[dict], key: str | None, descending: bool = False) -> list[dict]:
    if not key:
        return rows
    if rows and key not in rows[0]:
        raise UsageError(f"No column {key!r} to sort by.", hint=f"Columns: {', '.join(rows[0])}.")
    present = [r for r in rows if r.get(key) is not None]
    missing = [r for r in rows if r.get(key) is None]  # empty cells last, whichever the direction
    present.sort(key=lambda r: (isinstance(r[key], str), r[key]), reverse=descending)
    return present + missing


def write_results(out: Path, sort: str | None = None, descending: bool = False) -> list[dict]:
    """results.csv, results.json, trials.jsonl, the TensorBoard hparams summary and report.html; the Rich table."""
    out = Path(out)
    rows, axes = results_rows(out)
    rows = sort_rows(rows, sort, descending)
    columns = ["trial", *axes, *RESULT_KEYS]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r[k]) for k in columns})
    atomic_write_text(out / "results.csv", buf.getvalue())
    atomic_write_text(out / "results.json", json.dumps(rows, indent=1, default=str) + "\n")
    atomic_write_text(out / "trials.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rows))
    _hparams(out, rows, axes)
    headers = [
        ("trial", "trial"),
        *((a, a) for a in axes),
        ("status", "status"),
        *((k, v) for k, v in STAT_LABELS.items()),
        ("seconds", "seconds"),
        ("error", "error"),
    ]
    dirs = {r["trial"]: out / "trials" / r["trial"] for r in rows if (out / "trials" / r["trial"]).is_dir()}
    try:
        write_sweep_report(out, rows, headers, dirs, sort_key=sort, axes=tuple(axes))
    except ImportError as e:  # matplotlib missing: the table and files above stand
        warn(f"no report.html: {e} (pip install matplotlib)")
    _print_table(rows, axes)
    return rows


def _hparams(out: Path, rows: list[dict], axes: list[str]) -> None:
    """A TensorBoard hparams summary of the finished trials (the HParams tab), rewritten from scratch."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return
    import shutil

    folder = out / "tensorboard"
    shutil.rmtree(folder, ignore_errors=True)
    with SummaryWriter(log_dir=str(folder)) as w:
        for r in rows:
            if r["status"] != "ok":
                continue
            hp = {a: (r[a] if isinstance(r[a], (int, float, str, bool)) else str(r[a])) for a in axes}
            metrics = {
                f"hparam/{k}": r[k]
                for k in ("final_loss", "best_loss", "val_loss", "s_per_step")
                if isinstance(r.get(k), (int, float))
            }
            w.add_hparams(hp, metrics, run_name=r["trial"])


def _print_table(rows: list[dict], axes: list[str]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..console import console

    table = Table(title="sweep results")
    for col in [
        "trial",
        *(a.rsplit(".", 1)[-1] for a in axes),
        "status",
        "final loss",
        "best loss",
        "val loss",
        "s/step",
        "peak GiB",
    ]:
        table.add_column(col, justify="left" if col in ("trial", "status") else "right", no_wrap=col == "trial")
    for r in rows:
        color = {"ok": "green", "pending": "yellow"}.get(r["status"], "red")
        table.add_row(
            escape(r["trial"]),
            *(escape(str(r[a])) for a in axes),
            f"[{color}]{escape(r['status'])}[/{color}]",
            *(_fmt4(r.get(k)) for k in ("final_loss", "best_loss", "val_loss", "s_per_step", "gpu_peak_alloc_gib")),
        )
    # as wide as its content: a narrow or piped terminal would cut the numbers to "0.00…"
    need = sum(max([len(str(c.header))] + [len(str(x)) for x in c.cells]) + 3 for c in table.columns) + 1
    saved = console._width  # rich caps print(width=) at the console's width: widen the console for this print
    console.width = max(console.width, need)
    try:
        console.print(table)
    finally:
        console._width = saved


def _fmt4(v) -> str:
    return "–" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


if __name__ == "__main__":  # the trial child: python -m difftrain.flows.sweep TRIAL_DIR
    run_trial(Path(sys.argv[1]))
