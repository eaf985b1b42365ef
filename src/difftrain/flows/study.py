"""The Optuna side of ``difftrain sweep``: storages, the study and its checks, the search space, claims, heartbeats.

Optuna runs the sweep (samplers, pruners, and storages several processes or machines share); this module is the
thin layer between it and difftrain's trials:

* **storage**: an SQLite file in the sweep folder by default (``study.db``); ``--storage`` takes an SQLAlchemy URL
  (``postgresql://...``, ``sqlite:///...``) or a file path, which becomes Optuna's journal file
  (``JournalStorage`` over ``JournalFileBackend``, for a shared file system without a database server).
* **the study**: made once (``create_new_study`` is atomic: one process wins), with its points enqueued once: a
  grid's points, or for random and TPE search ``trials`` empty slots whose values the sampler draws when a process
  claims one. A process claims a waiting trial by moving it from WAITING to RUNNING, which the storage does for
  one process only (Optuna's own ``enqueue_trial`` / ``ask`` semantics), so no trial runs twice. The study's user
  attributes hold the base config (its fingerprint, and the whole of it for the messages) and the search space:
  another recipe, another cache or other axes under the same study name are refused, naming what differs.
* **heartbeats**: the sweep process records a heartbeat for each trial it runs; a trial whose heartbeat stops
  (its machine died) is failed after the grace period by any process of the study and enqueued again with the
  same values (``RetryHeartbeatStaleTrialCallback``); the retry continues in the trial's folder from its last checkpoint.
  RDB storages have this in Optuna; its journal storage does not, so for a journal the heartbeat is a trial system
  attribute and the stale check runs under a lock file beside the journal (our own code, for that reason).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StudyMismatch, SweepStorageError, UsageError

SAMPLERS = ("grid", "random", "tpe")
PRUNERS = ("none", "median", "hyperband")
#: study user attributes
BASE, BASE_FP, SPACE, READY, COMMAND = (
    "difftrain.base",
    "difftrain.base_fingerprint",
    "difftrain.space",
    "difftrain.ready",
    "difftrain.command",
)
#: trial user attributes
FOLDER, SLOT = "difftrain.folder", "difftrain.slot"
#: the journal storage's heartbeat (a trial system attribute: the time of the last beat)
BEAT = "difftrain:heartbeat"
DEFAULT_DB = "study.db"
#: config paths that say where things go, not what is trained: outside the base fingerprint (each machine of a
#: shared study has its own sweep folder and its own copy of the cache, addressed by content)
LOCATION_PATHS = ("train.output_dir", "data.cache_dir")


def optuna_quiet() -> Any:
    """Optuna, its INFO lines and experimental-feature warnings silenced (the sweep says what happens)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


# ----------------------------------------------------------------- the search space
@dataclass
class Space:
    """The sweep's axes as Optuna distributions; a value Optuna cannot hold (a list) is a choice held as its JSON
    text and turned back into the value for the config."""

    sampler: str
    axes: list[str]
    dists: dict[str, Any]  # path -> optuna distribution
    texts: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> {json text: value}
    points: list[dict[str, Any]] | None = None  # a grid's points (Optuna's values), in order
    trials: int = 0
    seed: int = 0

    def as_json(self) -> dict:
        """What the study stores and a later command must match (the sampler, its seed, the axes, the points)."""
        from optuna.distributions import distribution_to_json

        return {
            "sampler": self.sampler,
            "seed": self.seed if self.sampler != "grid" else None,
            "trials": self.trials,
            "axes": {a: json.loads(distribution_to_json(self.dists[a])) for a in self.axes},
        }

    def encode(self, path: str, value: Any) -> Any:
        return _text(value) if path in self.texts else value

    def decode(self, params: dict[str, Any]) -> dict[str, Any]:
        return {a: self.texts[a].get(params[a], params[a]) if a in self.texts else params[a] for a in params}


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _text(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def build_space(grid: dict[str, list], dists: dict[str, dict], trials: int | None, seed: int, sampler: str | None):
    """Map the sweep's axes onto Optuna's distributions: a grid axis and ``choice`` -> CategoricalDistribution,
    ``log_uniform`` -> FloatDistribution(log=True), ``uniform`` -> FloatDistribution, ``int_uniform`` ->
    IntDistribution. ``sampler`` None: grid without ``trials``, random with."""
    from optuna.distributions import FloatDistribution, IntDistribution

    sampler = sampler or ("grid" if trials is None else "random")
    if sampler not in SAMPLERS:
        raise UsageError(f"--sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}.")
    if sampler == "grid":
        if dists:
            raise UsageError(
                "A grid sweep cannot draw from distributions.",
                hint="Give --sampler random or tpe with --random N (or leave out --dist).",
            )
        if trials is not None:
            raise UsageError(
                "A grid sweep runs every point: --random N (random: {trials: N}) has no place in it.",
                hint="Leave out --random, or give --sampler random or tpe.",
            )
    elif trials is None:
        if dists:
            raise UsageError(
                "Distributions need random search.", hint="Add --random N (random: {trials: N} in a sweep file)."
            )
        raise UsageError(f"--sampler {sampler} needs a number of trials.", hint="Add --random N.")
    if not grid and not dists:
        raise UsageError("The sweep has no axes.", hint="Add --grid path=v1,v2 (or grid:/random: in a sweep file).")
    axes = list(grid) + [k for k in dists if k not in grid]
    space = Space(sampler, axes, {}, seed=seed)
    for a in axes:
        if a in dists:
            kind, args = next(iter(dists[a].items()))
            if kind == "choice":
                space.dists[a] = _choices(space, a, args)
            elif kind == "int_uniform":
                space.dists[a] = IntDistribution(int(args[0]), int(args[1]))
            else:
                space.dists[a] = FloatDistribution(float(args[0]), float(args[1]), log=kind == "log_uniform")
        else:
            space.dists[a] = _choices(space, a, grid[a])
    if sampler == "grid":
        import itertools

        space.points = [
            {a: space.encode(a, v) for a, v in zip(grid, combo)} for combo in itertools.product(*grid.values())
        ]
        unique = {_text(p): p for p in space.points}
        space.points, space.trials = list(unique.values()), len(unique)
    else:
        space.trials = int(trials or 0)
    return space


def _choices(space: Space, path: str, values: list) -> Any:
    from optuna.distributions import CategoricalDistribution

    if all(_scalar(v) for v in values):
        return CategoricalDistribution(list(values))
    space.texts[path] = {_text(v): v for v in values}
    return CategoricalDistribution([_text(v) for v in values])


# ----------------------------------------------------------------- samplers and pruners
def seeded_per_trial(make: Callable[[int], Any], seed: int) -> Any:
    """A sampler whose draws for trial n come from ``make(seed')`` with seed' a function of (seed, n): the same
    seed gives the same trials whichever process draws them, and two processes of one study never draw the same
    sequence (one seeded sampler in each would)."""
    from optuna.samplers import BaseSampler

    class PerTrialSeed(BaseSampler):
        def __init__(self) -> None:
            self._cache: tuple[int, Any] | None = None

        def _for(self, trial: Any) -> Any:
            if self._cache is None or self._cache[0] != trial.number:
                self._cache = (trial.number, make(zlib.crc32(f"{seed}:{trial.number}".encode())))
            return self._cache[1]

        def infer_relative_search_space(self, study, trial):
            return self._for(trial).infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self._for(trial).sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self._for(trial).sample_independent(study, trial, param_name, param_distribution)

        def before_trial(self, study, trial):
            self._for(trial).before_trial(study, trial)

        def after_trial(self, study, trial, state, values):
            self._for(trial).after_trial(study, trial, state, values)

    return PerTrialSeed()


def make_sampler(space: Space) -> Any:
    optuna = optuna_quiet()
    if space.sampler == "grid":
        from optuna.samplers import GridSampler

        class EnqueuedGrid(GridSampler):
            """GridSampler over points enqueued once and claimed atomically (GridSampler on its own may give one
            point to two processes, as its documentation says): an enqueued point is fixed, so it is checked
            against the grid and never drawn; ``after_trial`` would call ``study.stop``, which only an
            ``optimize`` loop may, so it does nothing here."""

            def after_trial(self, study, trial, state, values):
                return None

        return EnqueuedGrid({a: list(space.dists[a].choices) for a in space.axes}, seed=space.seed)
    if space.sampler == "random":
        return seeded_per_trial(lambda s: optuna.samplers.RandomSampler(seed=s), space.seed)
    return seeded_per_trial(
        lambda s: optuna.samplers.TPESampler(
            seed=s, constant_liar=True, n_startup_trials=min(10, max(1, space.trials // 3))
        ),
        space.seed,
    )


def make_pruner(prune: str | dict | None, every: int | None, max_steps: int | None) -> Any:
    """``none``, ``median`` or ``hyperband`` (or a mapping ``{pruner: median, n_startup_trials: 2, ...}`` from a
    sweep file: Optuna's own arguments)."""
    optuna = optuna_quiet()
    kind, kwargs = (prune, {}) if not isinstance(prune, dict) else (prune.get("pruner"), dict(prune))
    kwargs.pop("pruner", None)
    kind = kind or "none"
    if kind not in PRUNERS:
        raise UsageError(f"--prune {kind!r}: expected one of {', '.join(PRUNERS)}.")
    if kind == "none":
        return optuna.pruners.NopPruner()
    defaults: dict[str, Any]
    if kind == "median":
        cls, defaults = optuna.pruners.MedianPruner, {"n_startup_trials": 5, "n_warmup_steps": 0}  # Optuna's
    else:
        cls = optuna.pruners.HyperbandPruner
        defaults = {
            "min_resource": every or 1,
            "max_resource": max_steps or "auto",
            "reduction_factor": 3,
        }
    try:
        return cls(**{**defaults, **kwargs})
    except (TypeError, ValueError) as e:
        raise UsageError(
            f"prune: {kind} does not take {kwargs}: {e}",
            hint=f"See optuna.pruners.{cls.__name__}'s arguments, or give just --prune {kind}.",
        ) from None


# ----------------------------------------------------------------- storage
def storage_url(storage: str | None, out: Path) -> str:
    """What ``--storage`` names, as the sweep records it: an SQLAlchemy URL, or a journal file's absolute path."""
    if storage is None:
        return f"sqlite:///{(Path(out) / DEFAULT_DB).resolve()}"
    if "://" in storage:
        return storage
    return str(Path(storage).expanduser().resolve())


def shown(url: str) -> str:
    """The URL with its password hidden (for messages and sweep.json)."""
    if "://" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL SQLAlchemy cannot read is shown as it was given, less its userinfo
        head, _, tail = url.partition("://")
        return f"{head}://{tail.rpartition('@')[2]}"


def open_storage(url: str, heartbeat_interval: int | None = 60, grace_period: int | None = None) -> Any:
    """The storage, reachable: its tables made where they are missing. An unreachable one is a SweepStorageError
    that says where and what to check."""
    optuna = optuna_quiet()
    if "://" not in url:
        path = Path(url)
        if not path.parent.is_dir():
            raise SweepStorageError(
                f"The journal file {path} cannot be made: its folder {path.parent} does not exist.",
                hint="Create the folder (a file system every machine of the sweep mounts), or give --storage an "
                "SQLAlchemy URL (postgresql://user:pass@host/db).",
            )
        from optuna.storages.journal import JournalFileBackend

        try:
            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        except OSError as e:
            raise SweepStorageError(
                f"The journal file {path} cannot be opened: {e}.", hint="Check the path and its permissions."
            ) from None
    kwargs: dict[str, Any] = {}
    database = _sqlite_path(url)
    if database is not None and not database.parent.is_dir():
        raise SweepStorageError(
            f"The study storage {shown(url)} cannot be reached: its folder {database.parent} does not exist.",
            hint="Create the folder, or give --storage another URL (or leave it out for an SQLite file in the "
            "sweep folder). Nothing was written.",
        )
    if url.startswith("sqlite"):
        # several processes write one SQLite file: wait for its lock rather than fail at once
        kwargs = {"connect_args": {"timeout": 120}}
    else:
        kwargs = {"pool_pre_ping": True, "connect_args": _connect_timeout(url)}
    try:
        beats: dict[str, Any] = {}
        if heartbeat_interval:
            beats = {
                "heartbeat_interval": heartbeat_interval,
                "grace_period": grace_period or 2 * heartbeat_interval,
                "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=3, inherit_intermediate_values=True
                ),
            }
        for attempt in range(3):  # two processes making the tables at once: the second may see the first's
            try:
                with _sqlite_file_lock(url):
                    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beats)
            except ModuleNotFoundError:
                raise
            except Exception:
                if attempt == 2 or url.startswith("sqlite"):
                    raise
                time.sleep(1 + attempt)
        raise AssertionError("unreachable")
    except ModuleNotFoundError as e:
        raise SweepStorageError(
            f"The study storage {shown(url)} needs the database driver {e.name!r}, which is not installed.",
            hint="pip install 'psycopg[binary]' (PostgreSQL: SQLAlchemy's postgresql:// driver) or pymysql (MySQL), "
            "or leave out --storage for an SQLite file in the sweep folder.",
        ) from None
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors (unreachable, refused, bad URL) all end here
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0][:300]
        raise SweepStorageError(
            f"The study storage {shown(url)} cannot be reached: {reason}",
            hint="Check that the database server is up and the URL (user, password, host, port, database); or "
            "leave out --storage for an SQLite file in the sweep folder. Nothing was written.",
        ) from None


def _connect_timeout(url: str) -> dict:
    return {"connect_timeout": 10} if url.startswith(("postgresql", "mysql")) else {}


def is_journal(storage: Any) -> bool:
    import optuna

    return isinstance(storage, optuna.storages.JournalStorage)


# ----------------------------------------------------------------- the study
def fingerprint(base: dict) -> str:
    return hashlib.sha256(json.dumps(base, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def base_of(config_json: dict, axes: list[str]) -> dict[str, Any]:
    """The base config that a study's trials share: every setting but the swept ones and where files go."""
    return {k: v for k, v in flat(config_json).items() if k not in axes and k not in LOCATION_PATHS}


def open_study(
    storage: Any,
    name: str,
    url: str,
    space: Space,
    base: dict[str, Any],
    command: dict,
    pruner: Any,
    precompute_sections: tuple[str, ...],
    wait_s: float = 60.0,
) -> tuple[Any, bool]:
    """The study ``name``: made with its points enqueued, or loaded and checked against this command's base
    config and space. Returns (study, made)."""
    optuna = optuna_quiet()
    from optuna.study import StudyDirection

    sampler = make_sampler(space)
    try:
        study_id = storage.create_new_study([StudyDirection.MINIMIZE], name)
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
        _wait_ready(study, name, url, wait_s)
        check_study(study, name, url, space, base, precompute_sections)
        return study, False
    except Exception as e:  # noqa: BLE001 - the database refused a write (read-only, full, gone since)
        raise SweepStorageError(
            f"The study {name!r} cannot be made in {shown(url)}: {str(e).splitlines()[0][:300]}",
            hint="Check that the storage is writable.",
        ) from None
    for key, value in (
        (BASE, base),
        (BASE_FP, fingerprint(base)),
        (SPACE, space.as_json()),
        (COMMAND, command),
    ):
        storage.set_study_user_attr(study_id, key, value)
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    if space.points is not None:
        for i, p in enumerate(space.points):
            study.enqueue_trial(p, user_attrs={SLOT: i})
    else:
        for i in range(space.trials):
            study.enqueue_trial({}, user_attrs={SLOT: i})
    storage.set_study_user_attr(study_id, READY, True)
    return study, True


def _wait_ready(study: Any, name: str, url: str, wait_s: float) -> None:
    t0 = time.time()
    while not study.user_attrs.get(READY):
        if BASE_FP not in study.user_attrs and study.trials:
            raise StudyMismatch(
                f"The study {name!r} in {shown(url)} was not made by difftrain sweep.",
                hint="Give another --study name.",
            )
        if time.time() - t0 > wait_s:
            raise SweepStorageError(
                f"The study {name!r} in {shown(url)} was left half-made: the process that made it stopped before "
                "its trials were enqueued.",
                hint=f"Delete it (optuna delete-study --study-name {name} --storage URL) and run the sweep again, or "
                "give another --study name.",
            )
        time.sleep(0.5)


def check_study(
    study: Any, name: str, url: str, space: Space, base: dict[str, Any], precompute_sections: tuple[str, ...]
) -> None:
    """Refuse a study made by another recipe or settings, over another cache, or over another search space."""
    attrs = study.user_attrs
    old_space = attrs.get(SPACE)
    if old_space != json.loads(json.dumps(space.as_json())):
        raise StudyMismatch(
            f"The study {name!r} in {shown(url)} sweeps another search space: {_space_line(old_space)}; this "
            f"command sweeps {_space_line(space.as_json())}.",
            hint="Run the study's own axes and sampler again to continue it, or give a new --study name (or -o "
            "folder) for the new search space. The study and its trials are unchanged.",
        )
    if attrs.get(BASE_FP) != fingerprint(base):
        old = attrs.get(BASE) or {}
        keys = sorted(k for k in set(old) | set(base) if old.get(k) != base.get(k))
        cache = [k for k in keys if k.split(".", 1)[0] in precompute_sections]
        what = (
            "over another cache (its data, model or precompute settings differ)"
            if cache
            else ("by another recipe or settings")
        )
        diff = "; ".join(f"{k}: {old.get(k)!r} in the study, {base.get(k)!r} now" for k in (cache or keys)[:4])
        more = f" (and {len(keys) - 4} more)" if len(keys) > 4 else ""
        raise StudyMismatch(
            f"The study {name!r} in {shown(url)} was made {what}: {diff}{more}.",
            hint="Run the command that made it (its recipe and --set options) to continue it, or give a new "
            "--study name (or -o folder). The study and its trials are unchanged.",
        )


def _space_line(space: dict | None) -> str:
    if not space:
        return "nothing difftrain recorded"
    axes = ", ".join(space.get("axes") or {})
    n = f", {space['trials']} trials" if space.get("sampler") != "grid" else f", {space.get('trials')} points"
    return f"{space.get('sampler')} over {axes}{n}"


# ----------------------------------------------------------------- claims and heartbeats
def study_id(study: Any) -> int:
    return int(study._storage.get_study_id_from_name(study.study_name))


def claim(study: Any) -> Any | None:
    """Move one WAITING trial of the study to RUNNING, for this process only (the storage refuses a second
    process the same trial); its values drawn by the study's sampler where it has none. None when none waits."""
    with _sqlite_claim_lock(study._storage):
        return _claim(study)


@contextmanager
def _sqlite_claim_lock(storage: Any) -> Iterator[None]:
    """SQLite has no SELECT ... FOR UPDATE: two processes may both read a trial as WAITING and both set it RUNNING
    (Optuna's own ask does the same there), so an SQLite study's claims take a lock file beside the database in
    turn. PostgreSQL and MySQL lock the row; the journal orders the claims in its log."""
    backend = getattr(storage, "_backend", storage)  # a study's RDB storage is wrapped in Optuna's cache
    url = getattr(getattr(backend, "engine", None), "url", None)
    with _sqlite_file_lock(url.render_as_string(hide_password=False) if url is not None else None):
        yield


@contextmanager
def _sqlite_file_lock(url: str | None) -> Iterator[None]:
    """The lock file beside an SQLite database (claims; making its tables), or nothing for another storage."""
    if not url or not url.startswith("sqlite"):
        yield
        return
    from filelock import FileLock

    database = _sqlite_path(url)
    if database is None:
        yield
        return
    with FileLock(f"{database}.claim.lock", timeout=600):
        yield


def _sqlite_path(url: str) -> Path | None:
    """An SQLite URL's database file (None for another storage, or SQLite in memory)."""
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    try:
        database = make_url(url).database
    except Exception:  # noqa: BLE001 - a URL SQLAlchemy cannot read: said where it is opened
        return None
    return Path(database) if database and database != ":memory:" else None


def _claim(study: Any) -> Any | None:
    optuna = optuna_quiet()
    from optuna.trial import TrialState

    storage = study._storage
    sid = study_id(study)
    for t in storage.get_all_trials(sid, deepcopy=False, states=(TrialState.WAITING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(sid, t.number)
        try:
            if not storage.set_trial_state_values(trial_id, state=TrialState.RUNNING):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        if is_journal(storage) and storage.get_trial(trial_id).state != TrialState.RUNNING:
            continue
        beat(storage, trial_id)
        frozen = storage.get_trial(trial_id)
        study.sampler.before_trial(study, frozen)
        return optuna.Trial(study, trial_id)
    return None


def suggest(trial: Any, space: Space) -> dict[str, Any]:
    """The trial's values (enqueued ones where fixed, else drawn), as config values."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    params = {}
    for a in space.axes:
        d = space.dists[a]
        if isinstance(d, CategoricalDistribution):
            params[a] = trial.suggest_categorical(a, d.choices)
        elif isinstance(d, FloatDistribution):
            params[a] = trial.suggest_float(a, d.low, d.high, log=d.log)
        else:
            params[a] = trial.suggest_int(a, d.low, d.high)
    return space.decode(params)


def beat(storage: Any, trial_id: int) -> None:
    """One heartbeat of a running trial."""
    if is_journal(storage):
        storage.set_trial_system_attr(trial_id, BEAT, time.time())
    else:
        storage.record_heartbeat(trial_id)


def fail_stale(study: Any, grace_period: float, lock_dir: Path | None) -> list[int]:
    """Fail the trials whose heartbeat stopped and enqueue each again (same values, same folder); returns their
    numbers. RDB storages: Optuna's ``fail_stale_trials`` (its failed-trial callback enqueues the retry)."""
    optuna = optuna_quiet()
    from optuna.trial import TrialState

    storage = study._storage
    if not is_journal(storage):
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
        optuna.storages.fail_stale_trials(study)
        after = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        return [t.number for t in after if t.number not in before]  # their rows say "lost" (_study_rows)
    # the journal: our own stale check, one process at a time (the lock), so one retry per lost trial
    from optuna.storages.journal import JournalFileOpenLock

    now, lost = time.time(), []
    lock = JournalFileOpenLock(str(lock_dir / "difftrain-stale")) if lock_dir else None
    with _held(lock):
        for t in storage.get_all_trials(study_id(study), deepcopy=False, states=(TrialState.RUNNING,)):
            last = t.system_attrs.get(BEAT) or (t.datetime_start.timestamp() if t.datetime_start else now)
            if now - float(last) <= grace_period:
                continue
            tid = _tid(study, t.number)
            storage.set_trial_user_attr(tid, "status", "lost")
            storage.set_trial_state_values(tid, state=TrialState.FAIL)
            optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3, inherit_intermediate_values=True)(
                study, storage.get_trial(tid)
            )
            lost.append(t.number)
    return lost


@contextmanager
def _held(lock: Any) -> Iterator[None]:
    if lock is None:
        yield
        return
    while not lock.acquire():
        time.sleep(0.1)
    try:
        yield
    finally:
        lock.release()


def _tid(study: Any, number: int) -> int:
    return int(study._storage.get_trial_id_from_study_id_trial_number(study_id(study), number))


def retry(study: Any, number: int) -> None:
    """Enqueue a trial again with its values, folder and reported steps (an interrupted sweep's trial)."""
    optuna = optuna_quiet()
    optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None, inherit_intermediate_values=True)(
        study, study._storage.get_trial(_tid(study, number))
    )


def superseded(trials: list[Any]) -> set[int]:
    """Trial numbers that a later retry replaced."""
    out: set[int] = set()
    for t in trials:
        out.update(t.system_attrs.get("retry_history") or [])
    return out


def host() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
