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

Optuna runs it (flows/study.py): a grid is Optuna's GridSampler over the grid's points, random search its
RandomSampler, ``sampler: tpe`` (``--sampler tpe``) its TPESampler, the random ones seeded per trial number (the
same seed gives the same trials, whichever process draws them). The study lives in an SQLite file in the sweep
folder (``study.db``) unless ``--storage`` names a database URL or a journal file that several processes or
machines share (``--study NAME``): each process running the same command claims waiting trials one at a time, so
none runs twice, records a heartbeat for the ones it runs, and retries a trial whose process died. A rerun
continues the study. ``--prune median|hyperband`` stops losing trials at their validation steps (held-out loss,
else the training loss), with a checkpoint.

Trials. Each trial's folder is named by a hash of its values (``trials/t-<8 hex>/``); it holds its resolved
``config.yaml``, ``trial.json`` (study, trial number, values), the run's files (metrics.jsonl, TensorBoard
events, report.html) and ``result.json``. The cache is built before the first trial, once per distinct
data/model/precompute setting, in this process; trials then run in child processes (``python -m
difftrain.flows.sweep TRIAL_DIR``), one after another, or one per GPU at once with ``gpus`` (each child sees one
device through CUDA_VISIBLE_DEVICES). A child per trial keeps one trial's out-of-memory, divergence or crash from
taking down the sweep, and gives every trial a fresh CUDA allocator.

Results, from the study (its trials' user attributes: folder, status, losses; so a machine's table holds the
trials other machines ran) and the trial folders (curves, samples): results.csv, results.json and trials.jsonl
(one row per trial: the swept values, status, final/best/validation loss, s/step, peak GPU memory, seconds, where
it was pruned, error), a Rich table, report.html with every trial's curves overlaid, and a TensorBoard hparams
summary in ``tensorboard/``. ``difftrain sweep report DIR`` redraws all of it, sorted by any column, also for a
folder made by difftrain's own scheduler before Optuna.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
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
    sampler: str | None = None  # grid | random | tpe; None: grid without trials, random with
    prune: str | dict | None = None  # none | median | hyperband, or {pruner: median, <its arguments>}

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
            "sampler": self.sampler,
            "prune": self.prune,
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
    unknown = set(raw) - {"recipe", "config", "set", "grid", "random", "sampler", "prune"}
    if unknown:
        raise ConfigError(
            f"The sweep file {path} has unknown keys: {', '.join(sorted(unknown))}.",
            hint="Use recipe, config, set, grid, random, sampler and prune.",
        )
    sets, grid_raw, rnd = raw.get("set") or [], raw.get("grid") or {}, raw.get("random")
    for key, ok, what in (
        ("recipe", isinstance(raw.get("recipe"), (str, type(None))), "a recipe name or path"),
        ("config", isinstance(raw.get("config"), (str, type(None))), "a file path"),
        ("sampler", raw.get("sampler") in (None, "grid", "random", "tpe"), "grid, random or tpe"),
        (
            "prune",
            raw.get("prune") in (None, "none", "median", "hyperband")
            or (
                isinstance(raw.get("prune"), dict)
                and raw["prune"].get("pruner") in ("median", "hyperband")
                and all(isinstance(k, str) for k in raw["prune"])
            ),
            "none, median, hyperband, or {pruner: median, n_startup_trials: 2, ...}",
        ),
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
        sampler=raw.get("sampler"),
        prune=raw.get("prune"),
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


@dataclass
class StudyOptions:
    """Where the study lives and how its processes keep each other honest (``difftrain sweep --storage ...``)."""

    storage: str | None = None  # None: an SQLite file in the sweep folder
    study: str | None = None  # None: the sweep folder's name
    heartbeat_interval: int = 60
    grace_period: int | None = None  # None: twice the interval


def run_sweep(
    spec: SweepSpec,
    out: Path,
    gpus: list[str] | None = None,
    sort: str | None = None,
    options: StudyOptions | None = None,
) -> list[dict]:
    """Run the study's trials that wait, in child processes, until none waits or runs; return the results rows
    (also written to disk). Several processes (on one machine or several) may run this for the same study at
    once: each claims the waiting trials one at a time."""
    from . import study as st

    out, opts = Path(out), options or StudyOptions()
    space = st.build_space(spec.grid, spec.dists, spec.trials, spec.seed, spec.sampler)
    url = st.storage_url(opts.storage, out)
    if opts.storage is None:
        out.mkdir(parents=True, exist_ok=True)
    storage = st.open_storage(url, opts.heartbeat_interval, opts.grace_period)  # unreachable: said before all else
    base = _resolve_trial(spec, {}, out / "trials" / "base")
    cfg = base.config
    every = cfg.validation.every_n_steps
    if (spec.prune or "none") != "none" and not every:
        raise UsageError(
            "Pruning compares trials at their validation steps, and the base config has none.",
            hint="Add --set validation.every_n_steps=N (the held-out loss is reported there with "
            "validation.loss_items, else the training loss), or leave out --prune.",
        )
    pruner = st.make_pruner(spec.prune, every, cfg.train.max_steps)
    name = opts.study or out.resolve().name
    study, made = st.open_study(
        storage,
        name,
        url,
        space,
        st.base_of(cfg.model_dump(mode="json"), space.axes),
        spec.as_json(),
        pruner,
        PRECOMPUTE_SECTIONS,
    )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / "sweep.json",
        json.dumps(
            {
                "engine": "optuna",
                "study": name,
                "storage": None if opts.storage is None else st.shown(url),
                "spec": spec.as_json(),
                "axes": space.axes,
            },
            indent=1,
            default=str,
        )
        + "\n",
    )
    counts = _counts(study)
    info(
        f"sweep: study {name!r} in {st.shown(url)} ({'new' if made else 'continued'}, {space.sampler} sampler, "
        f"{'pruner ' + type(pruner).__name__ if every and (spec.prune or 'none') != 'none' else 'no pruning'}): "
        + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    )
    worker = _Worker(spec, space, study, out, list(gpus or []), opts, url, cfg)
    worker.precompute_known(base)
    worker.run()
    return write_results(out, sort=sort, storage=opts.storage)


def _counts(study: Any) -> dict[str, int]:
    from optuna.trial import TrialState

    names = {
        TrialState.COMPLETE: "finished",
        TrialState.PRUNED: "pruned",
        TrialState.FAIL: "failed",
        TrialState.RUNNING: "running",
        TrialState.WAITING: "waiting",
    }
    out = dict.fromkeys(names.values(), 0)
    for t in study.get_trials(deepcopy=False):
        out[names[t.state]] += 1
    return out


def _short(values: dict) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt4(v)}" for k, v in values.items())


class _Reporter:
    """What a running trial reports to the pruner, read from its metrics.jsonl as it grows: the held-out loss at
    each validation round where items are held out, else the mean training loss of the steps since the last
    validation step (one step's loss is one draw of noise and timesteps: too noisy to compare trials by)."""

    def __init__(self, path: Path, every: int | None, held_out: bool) -> None:
        self.path, self.every, self.held_out = path, every or 0, held_out
        self.offset, self.next_at = 0, self.every
        self.window: list[float] = []

    def points(self) -> list[tuple[int, float]]:
        if not self.every or not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # complete lines only
        self.offset += end
        out = []
        for line in data[:end].decode("utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            step = rec.get("step")
            if not isinstance(step, int):
                continue
            if self.held_out:
                if "val_loss" in rec and _finite(rec["val_loss"]):
                    out.append((step, float(rec["val_loss"])))
            elif "loss" in rec and _finite(rec["loss"]):
                self.window.append(float(rec["loss"]))
                if step >= self.next_at:
                    out.append((step, sum(self.window) / len(self.window)))
                    self.window, self.next_at = [], (step // self.every + 1) * self.every
        return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class _Run:
    trial: Any  # optuna.Trial
    t: Trial
    proc: subprocess.Popen
    log: Any
    t0: float
    reporter: _Reporter
    pruned: tuple[int, float] | None = None
    stopping: bool = False


class _Worker:
    """This process's share of the study: claim a waiting trial, run it in a child process, report its losses to
    the pruner and stop it when the pruner says so, record its heartbeat, tell the study how it ended.

    The pruner is asked here, in the sweep process, from the trial's metrics.jsonl as it grows, rather than in the
    child: this process already holds the trial (its heartbeat, its end), the storage gets one connection per
    sweep process rather than one per trial (a PostgreSQL server's connection limit, SQLite's one writer), the
    trainer needs no Optuna, and the stop is the trainer's own Ctrl+C (SIGINT): it finishes the step under way
    and saves a checkpoint. The child may run a step or two past the step that decided before it stops."""

    def __init__(
        self,
        spec: SweepSpec,
        space: Any,
        study: Any,
        out: Path,
        gpus: list[str],
        opts: StudyOptions,
        url: str,
        base_cfg: Any,
    ) -> None:
        self.spec, self.space, self.study, self.out, self.opts = spec, space, study, out, opts
        self.slots: list[str | None] = list(gpus) or [None]
        self.url = url
        self.built: dict[str, str | None] = {}  # precompute key -> None, or why it failed
        self.beating: set[int] = set()
        self.lock = threading.Lock()
        self.stop_beats = threading.Event()
        self.grace = opts.grace_period or 2 * opts.heartbeat_interval
        self.lock_dir = Path(url).parent if "://" not in url else None
        self.every = base_cfg.validation.every_n_steps
        self.held_out = base_cfg.validation.loss_items > 0
        self.n_started = 0

    # -------------------------------------------------------- the cache
    def precompute_known(self, base: Resolved) -> None:
        """The cache, before the first trial: once per distinct data/model/precompute setting of the points known
        now (a grid's points, or the base config when no drawn axis changes what precompute writes)."""
        configs = [base.config]
        if self.space.points is not None:
            for p in self.space.points:
                with contextlib.suppress(DifftrainError):  # said when the trial is claimed
                    configs.append(_resolve_trial(self.spec, self.space.decode(p), self.out / "trials" / "x").config)
        elif any(a.split(".", 1)[0] in PRECOMPUTE_SECTIONS for a in self.space.axes):
            configs = []  # each drawn trial's own, when it is claimed
        for cfg in configs:
            self._precompute(cfg)

    def _precompute(self, cfg: Any) -> str | None:
        from ..precompute.run import precompute
        from ..runtime.locks import FolderBusy

        key = _precompute_key(cfg)
        if key in self.built:
            return self.built[key]
        said, t0 = False, time.time()
        while True:
            try:
                r = precompute(cfg)
                self.built[key] = None
                info(
                    f"sweep: cache {r.cache_dir}: {r.latents_encoded} latents and {r.texts_encoded} captions "
                    f"encoded, {r.latents_reused + r.texts_reused} reused"
                )
                break
            except FolderBusy as e:  # another sweep process of the study encodes it: wait for it, then reuse it
                if time.time() - t0 > 6 * 3600:
                    self.built[key] = _error_text(e)
                    break
                if not said:
                    info("sweep: another process is writing the cache; waiting for it")
                    said = True
                time.sleep(2)
            except DifftrainError as e:
                self.built[key] = _error_text(e)
                break
        return self.built[key]

    # -------------------------------------------------------- heartbeats
    def _beats(self) -> None:
        from . import study as st

        while not self.stop_beats.wait(self.opts.heartbeat_interval):
            with self.lock:
                ids = list(self.beating)
            for tid in ids:
                try:
                    st.beat(self.study._storage, tid)
                except Exception as e:  # noqa: BLE001 - a missed beat is survivable; the grace period covers a few
                    warn(f"sweep: heartbeat not recorded ({e})")

    # -------------------------------------------------------- the loop
    def run(self) -> None:
        from optuna.trial import TrialState

        from . import study as st

        beats = threading.Thread(target=self._beats, name="difftrain-sweep-heartbeat", daemon=True)
        beats.start()
        running: dict[int, _Run] = {}  # by slot: a GPU named twice (--gpus 0,0,1,1) is two slots, two trials on it
        last_stale, said_waiting = 0.0, False
        try:
            while True:
                now = time.time()
                if now - last_stale > min(self.opts.heartbeat_interval, self.grace / 2):
                    last_stale = now
                    for n in st.fail_stale(self.study, self.grace, self.lock_dir):
                        warn(
                            f"sweep: trial #{n} lost its heartbeat for over {self.grace} s (its process or machine "
                            "stopped): marked failed and enqueued again, to continue from its last checkpoint"
                        )
                for i, slot in enumerate(self.slots):
                    if i not in running:
                        r = self._start_next(slot)
                        if r is not None:
                            running[i] = r
                for i, r in list(running.items()):
                    self._poll(r)
                    if r.proc.poll() is not None:
                        del running[i]
                        self._finish(r)
                if not running:
                    waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                    elsewhere = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                    if not waiting and not elsewhere:
                        break
                    if not waiting and not said_waiting:
                        info(
                            f"sweep: {len(elsewhere)} trial(s) running in other processes; waiting for them (a lost "
                            "one is retried here)"
                        )
                        said_waiting = True
                    time.sleep(1.0 if not waiting else 0.05)
                time.sleep(0.2)
        except BaseException:
            self._interrupt(running)
            raise
        finally:
            self.stop_beats.set()

    def _start_next(self, slot: str | None) -> _Run | None:
        from . import study as st

        while True:
            trial = st.claim(self.study)
            if trial is None:
                return None
            with self.lock:
                self.beating.add(trial._trial_id)
            values = st.suggest(trial, self.space)
            system = self.study._storage.get_trial(trial._trial_id).system_attrs
            name = trial.user_attrs.get(st.FOLDER) or self._folder_name(trial, values, system)
            t = Trial(name, values, self.out / "trials" / name)
            for k, v in (
                (st.FOLDER, name),
                ("values", values),
                ("host", st.host()),
                ("status", "running"),
                ("error", None),
            ):
                trial.set_user_attr(k, v)
            try:
                t.resolved = _resolve_trial(self.spec, values, t.folder)
                failed = self._precompute(t.resolved.config)
                if failed is not None:
                    raise DifftrainError("precompute: " + failed)
            except DifftrainError as e:  # an impossible setting: recorded in the study, the sweep goes on
                hint = f" ({e.hint})" if e.hint else ""
                warn(f"sweep: trial #{trial.number} {name} ({_short(values)}) cannot run: {_error_text(e)}{hint}")
                self._tell(trial, {"status": "failed", "error": _error_text(e) + hint}, None)
                continue
            t.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(t.folder / "config.yaml", t.resolved.to_yaml())
            atomic_write_text(
                t.folder / "trial.json",
                json.dumps({"study": self.study.study_name, "number": trial.number, "values": values}, default=str)
                + "\n",
            )
            (t.folder / PRUNE_FILE).unlink(missing_ok=True)
            self.n_started += 1
            info(
                f"sweep: trial #{trial.number} {t.name} ({_short(values)})"
                + (f" on GPU {slot}" if slot else "")
                + (" (a retry: continues from its last checkpoint)" if system.get("failed_trial") is not None else "")
            )
            proc, t0, log = _start(t, slot, len(self.slots))
            return _Run(trial, t, proc, log, t0, _Reporter(t.folder / "metrics.jsonl", self.every, self.held_out))

    def _folder_name(self, trial: Any, values: dict, system: dict) -> str:
        """The trial's folder: named by its values (as before Optuna), with its number where another trial of the
        study (a choice drawn twice) has the name already."""
        from . import study as st

        name = trial_name(values, self.spec)
        taken = {
            t.user_attrs.get(st.FOLDER)
            for t in self.study.get_trials(deepcopy=False)
            if t.number != trial.number and t.number not in (system.get("retry_history") or [])
        }
        return name if name not in taken else f"{name}-{trial.number}"

    def _poll(self, r: _Run) -> None:
        done: set[int] | None = None  # the steps the study holds (a retry inherits its first run's)
        for step, value in r.reporter.points():
            if done is None:
                done = set(self.study._storage.get_trial(r.trial._trial_id).intermediate_values)
            if step in done or r.stopping:
                continue
            r.trial.report(value, step)
            done.add(step)
            if r.trial.should_prune():
                r.pruned, r.stopping = (step, value), True
                atomic_write_text(r.t.folder / PRUNE_FILE, json.dumps({"step": step, "value": value}) + "\n")
                what = "held-out loss" if self.held_out else "training loss"
                info(
                    f"sweep: trial #{r.trial.number} {r.t.name} pruned at step {step} ({what} {value:.5g}): "
                    "stopping it with a checkpoint"
                )
                _signal(r.proc, signal.SIGINT)

    def _finish(self, r: _Run) -> None:
        r.log.close()
        res = _read_result(r.t.folder)
        if res.get("status") not in (*FINISHED, "interrupted"):  # the child died before it could say (killed, segfault)
            tail = (r.t.folder / "train.log").read_text(encoding="utf-8", errors="replace")[-400:]
            res = {
                "status": "failed",
                "values": r.t.values,
                "error": f"the trial process ended with exit code {r.proc.returncode}: {tail.strip()}",
                **run_summary(r.t.folder),
            }
            _write_result(r.t.folder, res)
        self._poll(r)  # what it logged last
        if r.pruned is not None and res.get("status") != "ok":
            step, value = r.pruned
            res = {**res, "status": "pruned", "pruned_step": step, "pruned_value": value}
            res["error"] = f"pruned at step {step} ({'held-out' if self.held_out else 'training'} loss {value:.5g})"
            _write_result(r.t.folder, res)
        self._tell(r.trial, res, r.t0)

    def _tell(self, trial: Any, res: dict, t0: float | None) -> None:
        """The trial's end into the study: COMPLETE (its held-out loss, else its final training loss), PRUNED or
        FAIL, and its numbers as user attributes (the results table reads them, also on other machines)."""
        from optuna.trial import TrialState

        with self.lock:
            self.beating.discard(trial._trial_id)
        status = res.get("status", "failed")
        attrs = {k: res.get(k) for k in RESULT_KEYS}
        attrs["gpu"] = res.get("gpu")
        try:
            for k, v in attrs.items():
                trial.set_user_attr(k, v)
        except Exception:  # noqa: BLE001 - failed meanwhile by another process (see below)
            pass
        value = None
        if status == "ok":
            value = next((res[k] for k in ("val_loss", "final_loss") if _finite(res.get(k))), None)
        state = (
            TrialState.COMPLETE if value is not None else TrialState.PRUNED if status == "pruned" else TrialState.FAIL
        )
        frozen = self.study.tell(
            trial, values=value if state == TrialState.COMPLETE else None, state=state, skip_if_finished=True
        )
        if frozen.state != state:
            warn(
                f"sweep: trial #{trial.number} was marked {frozen.state.name.lower()} by another process meanwhile "
                f"(its heartbeat was missed for over {self.grace} s); its result stays in {self.out}"
            )
        if t0 is not None:
            tail = (
                f", loss {_fmt(value)} in {time.time() - t0:.0f} s"
                if status == "ok"
                else f" ({str(res.get('error', ''))[:200]})"
            )
            info(f"sweep: trial #{trial.number} {attrs.get('status') or status}{tail}")

    def _interrupt(self, running: dict[int, _Run]) -> None:
        """Ctrl+C (or an error) in the sweep process: each child stops with a checkpoint (one SIGINT: the trainer's
        own stop), its trial is marked failed (interrupted) and enqueued again, so a rerun continues it."""
        from . import study as st

        for r in running.values():
            if not r.stopping:
                _signal(r.proc, signal.SIGINT)
        deadline = time.time() + 120
        for r in running.values():
            try:
                r.proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
            r.log.close()
        for r in running.values():
            res = _read_result(r.t.folder)
            try:
                if res.get("status") == "ok" or r.pruned is not None:
                    self._finish(r)
                    continue
                self._tell(r.trial, {**res, "status": "interrupted", "error": "the sweep was interrupted"}, None)
                st.retry(self.study, r.trial.number)
                warn(
                    f"sweep: trial #{r.trial.number} {r.t.name} stopped with its checkpoint and is queued again: the "
                    "same command continues it"
                )
            except Exception as e:  # noqa: BLE001 - the storage may be what failed; the heartbeat covers it
                warn(f"sweep: trial #{r.trial.number} not recorded as interrupted ({e}); its heartbeat will be")


PRUNE_FILE = "pruned.json"


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _start(t: Trial, gpu: str | None, parallel: int) -> tuple[subprocess.Popen, float, Any]:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
        # trials side by side share the host's cores: without a cap each one's thread pools take them all
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
    env.setdefault("DIFFTRAIN_PROGRESS", "0")  # children's bars would interleave; the log has the lines
    env[PARENT_ENV] = str(os.getpid())
    src = str(Path(__file__).resolve().parents[1])  # the running difftrain, also when it is not installed
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(t.folder / "train.log", "a", encoding="utf-8")  # noqa: SIM115 (the child writes it; closed when it ends)
    # its own session: a Ctrl+C at the terminal reaches the sweep process alone, which stops each child with one
    # SIGINT (two would stop it without its checkpoint)
    proc = subprocess.Popen(
        [sys.executable, "-m", "difftrain.flows.sweep", str(t.folder)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    return proc, time.time(), log


#: the sweep process's pid, for its child: a trial ends with the process that watches it
PARENT_ENV = "DIFFTRAIN_SWEEP_PARENT"


def _die_with_parent() -> None:
    """On Linux, the child is killed when the sweep process ends (a killed sweep leaves no trial training on
    unwatched: its study retries the trial, which must find the trial folder free)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it ended before the line above ran
        os._exit(1)


def _read_result(folder: Path) -> dict:
    return read_json_object(folder / "result.json")


def _write_result(folder: Path, res: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "result.json", json.dumps(res, indent=1, default=str) + "\n")


def _trial_values(folder: Path) -> dict:
    """The trial's swept values: trial.json (Optuna sweeps), else the old scheduler's sweep.json."""
    mine = read_json_object(folder / "trial.json")
    if "values" in mine:
        return dict(mine["values"])
    sweep = read_json_object(folder.parents[1] / "sweep.json")
    return next((t["values"] for t in sweep.get("trials") or [] if t.get("name") == folder.name), {})


def run_trial(folder: Path) -> dict:
    """The child: train the trial's config.yaml (resuming from its last checkpoint), then write result.json
    with the status: ok, oom (out of memory), nan (the loss diverged), interrupted (stopped by a SIGINT, with a
    checkpoint: pruned, or the sweep was interrupted) or failed (anything else)."""
    import torch

    from ..errors import Interrupted, LossNotFinite
    from ..trainers.checkpoint import resolve_resume
    from ..trainers.loop import train

    folder = Path(folder)
    text = (folder / "config.yaml").read_text(encoding="utf-8")
    cfg = validate(yaml.safe_load(text))
    values = _trial_values(folder)
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
    except Interrupted as e:
        res.update(status="interrupted", error=_error_text(e))
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
RESULT_KEYS = ["status", *STAT_LABELS, "seconds", "pruned_step", "pruned_value", "error"]
#: an Optuna trial's state, where difftrain recorded no status of its own
_STATE_STATUS = {"WAITING": "pending", "RUNNING": "running", "COMPLETE": "ok", "PRUNED": "pruned", "FAIL": "failed"}


def results_rows(out: Path, storage: str | None = None) -> tuple[list[dict], list[str]]:
    """The rows of every trial (trial, swept values, result) and the swept paths: from the study where the
    folder has one (``storage`` overrides the one sweep.json names), else from the trial folders (a folder made
    by difftrain's scheduler before Optuna)."""
    sweep = json.loads((Path(out) / "sweep.json").read_text(encoding="utf-8"))
    axes = sweep.get("axes") or []
    if sweep.get("engine") == "optuna":
        return _study_rows(Path(out), sweep, storage), axes
    rows = []
    for t in sweep["trials"]:
        res = _read_result(Path(out) / "trials" / t["name"])
        row = {"trial": t["name"], **{a: t["values"].get(a) for a in axes}}
        row["status"] = res.get("status", "pending")
        for k in RESULT_KEYS[1:]:
            row[k] = res.get(k)
        rows.append(row)
    return rows, axes


def _study_rows(out: Path, sweep: dict, storage: str | None) -> list[dict]:
    from . import study as st

    optuna = st.optuna_quiet()
    url = st.storage_url(storage if storage is not None else sweep.get("storage"), out)
    if "***" in url:
        raise UsageError(
            f"The sweep's study is in {url}, whose password sweep.json does not keep.",
            hint="Give it: difftrain sweep report DIR --storage URL.",
        )
    try:
        study = optuna.load_study(study_name=sweep["study"], storage=st.open_storage(url, None))
    except KeyError:
        raise UsageError(
            f"The storage {st.shown(url)} has no study {sweep['study']!r}.",
            hint="Give the sweep's own storage: --storage URL.",
        ) from None
    trials = study.get_trials(deepcopy=False)
    gone = st.superseded(trials)
    axes = sweep.get("axes") or []
    rows = []
    for t in trials:
        if t.number in gone:
            continue
        ua = t.user_attrs
        values = ua.get("values") or {}
        row = {"trial": ua.get(st.FOLDER) or f"#{t.number}", "number": t.number, **{a: values.get(a) for a in axes}}
        status = ua.get("status") if t.state.name not in ("WAITING", "RUNNING") else None
        if t.state.name == "FAIL" and status in (None, "running"):
            status = "lost"  # failed by a heartbeat check: its process stopped without a word
        row["status"] = status or _STATE_STATUS[t.state.name]
        for k in RESULT_KEYS[1:]:
            row[k] = ua.get(k)
        rows.append(row)
    return rows


def sort_rows(rows: list[dict], key: str | None, descending: bool = False) -> list[dict]:
    if not key:
        return rows
    if rows and key not in rows[0]:
        raise UsageError(f"No column {key!r} to sort by.", hint=f"Columns: {', '.join(rows[0])}.")
    present = [r for r in rows if r.get(key) is not None]
    missing = [r for r in rows if r.get(key) is None]  # empty cells last, whichever the direction
    present.sort(key=lambda r: (isinstance(r[key], str), r[key]), reverse=descending)
    return present + missing


def write_results(
    out: Path, sort: str | None = None, descending: bool = False, storage: str | None = None
) -> list[dict]:
    """results.csv, results.json, trials.jsonl, the TensorBoard hparams summary and report.html; the Rich table."""
    out = Path(out)
    rows, axes = results_rows(out, storage)
    rows = sort_rows(rows, sort, descending)
    columns = ["trial", *(["number"] if rows and "number" in rows[0] else []), *axes, *RESULT_KEYS]
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
        color = {"ok": "green", "pending": "yellow", "running": "yellow", "pruned": "yellow"}.get(r["status"], "red")
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
    _die_with_parent()
    run_trial(Path(sys.argv[1]))
