"""difftrain sweep on Optuna (issue 55): the search space as Optuna's distributions, claims that hand each trial to
one process, seeded draws, studies shared by processes (SQLite, journal, PostgreSQL), a killed process's trial
retried from its checkpoint, pruning, refusals of another recipe, cache or search space, and a sweep folder of the
scheduler before Optuna read by `sweep report`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import CliResult, clean_failure, console_script, set_args

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sweep-v1"


def _script(*args, timeout: int = 300) -> CliResult:
    r = subprocess.run([console_script(), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    return CliResult(r.returncode, r.stdout, r.stderr)


def _sweep_args(model: Path, data: Path, cache: Path, *sets: str, steps: int = 2) -> list[str]:
    base = [
        f"data.cache_dir={cache}",
        f"train.max_steps={steps}",
        "train.batch_size=2",
        "report.html=false",
        "report.to=[]",
        *sets,
    ]
    return ["sweep", "--recipe", "tiny-sdxl-lora", "--model", str(model), "--data-dir", str(data), *set_args(base)]


def _study(url: str, name: str):
    from difftrain.flows.study import open_storage, optuna_quiet

    return optuna_quiet().load_study(study_name=name, storage=open_storage(url, None))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache for the module's sweeps (precompute encodes it once; later sweeps reuse every entry)."""
    return tmp_path_factory.mktemp("optuna-cache") / "cache"


# ----------------------------------------------------------------- the search space and claims (no training)
def test_the_axes_map_onto_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from difftrain.errors import UsageError
    from difftrain.flows.study import base_of, build_space

    dists = {
        "train.learning_rate": {"log_uniform": [1e-5, 1e-3]},
        "train.seed": {"int_uniform": [0, 9]},
        "train.max_grad_norm": {"uniform": [0.5, 2.0]},
        "train.lr_scheduler": {"choice": ["constant", "cosine"]},
    }
    space = build_space({"lora.targets": [["to_q", "to_k"], ["to_v"]]}, dists, 4, 0, None)
    d = space.dists
    assert space.sampler == "random" and space.trials == 4 and space.points is None
    assert isinstance(d["train.learning_rate"], FloatDistribution) and d["train.learning_rate"].log
    assert (d["train.learning_rate"].low, d["train.learning_rate"].high) == (1e-5, 1e-3)
    assert isinstance(d["train.max_grad_norm"], FloatDistribution) and not d["train.max_grad_norm"].log
    assert isinstance(d["train.seed"], IntDistribution) and (d["train.seed"].low, d["train.seed"].high) == (0, 9)
    assert isinstance(d["train.lr_scheduler"], CategoricalDistribution)
    # a list is no Optuna choice: held as its JSON text, turned back into the list for the config
    texts = d["lora.targets"].choices
    assert all(isinstance(c, str) for c in texts)
    assert space.decode({"lora.targets": texts[1]}) == {"lora.targets": ["to_v"]}
    grid = build_space({"lora.rank": [4, 8], "train.learning_rate": [1e-4, 3e-4]}, {}, None, 0, None)
    assert grid.sampler == "grid" and grid.trials == 4
    assert grid.points == [
        {"lora.rank": 4, "train.learning_rate": 1e-4},
        {"lora.rank": 4, "train.learning_rate": 3e-4},
        {"lora.rank": 8, "train.learning_rate": 1e-4},
        {"lora.rank": 8, "train.learning_rate": 3e-4},
    ]
    # a study's base config: every setting but the swept ones and where files go (each machine its own folders)
    cfg = {"data": {"cache_dir": "/a", "dir": "/d"}, "train": {"output_dir": "/o", "learning_rate": 1, "seed": 0}}
    assert base_of(cfg, ["train.learning_rate"]) == {"data.dir": "/d", "train.seed": 0}
    with pytest.raises(UsageError, match="cannot draw from distributions"):
        build_space({}, dists, None, 0, "grid")
    with pytest.raises(UsageError, match="needs a number of trials"):
        build_space({"lora.rank": [4]}, {}, None, 0, "tpe")
    with pytest.raises(UsageError, match="runs every point"):
        build_space({"lora.rank": [4]}, {}, 3, 0, "grid")


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_concurrent_claims_give_each_trial_to_one_process_and_draws_follow_the_seed(tmp_path, kind):
    """Three workers (each its own storage connection or journal handle) claim a random search's 8 slots at once:
    every trial is run by exactly one; the values of trial n are a function of (seed, n), whoever draws them."""
    from difftrain.flows.study import build_space, claim, make_sampler, open_storage, open_study, optuna_quiet, suggest

    optuna = optuna_quiet()
    url = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else str(tmp_path / "study.journal")
    space = build_space({}, {"train.learning_rate": {"log_uniform": [1e-5, 1e-2]}}, 8, 7, None)

    def make(name: str, seed: int) -> None:
        sp = build_space({}, {"train.learning_rate": {"log_uniform": [1e-5, 1e-2]}}, 8, seed, None)
        open_study(open_storage(url), name, url, sp, {"a": 1}, {}, optuna.pruners.NopPruner(), ())

    make("s", 7)
    claimed: dict[int, list[tuple[int, float]]] = defaultdict(list)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            study = optuna.load_study(study_name="s", storage=open_storage(url), sampler=make_sampler(space))
            while (t := claim(study)) is not None:
                claimed[i].append((t.number, suggest(t, space)["train.learning_rate"]))
                study.tell(t, 1.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    got = sorted(x for c in claimed.values() for x in c)
    assert [n for n, _ in got] == list(range(8))  # each trial once, none made beyond the 8 slots
    assert len({v for _, v in got}) == 8 and all(1e-5 <= v <= 1e-2 for _, v in got)
    study = _study(url, "s")
    assert len(study.trials) == 8 and all(t.state.name == "COMPLETE" for t in study.trials)

    def draws(name: str, seed: int) -> list[float]:
        make(name, seed)
        sp = build_space({}, {"train.learning_rate": {"log_uniform": [1e-5, 1e-2]}}, 8, seed, None)
        s = optuna.load_study(study_name=name, storage=open_storage(url), sampler=make_sampler(sp))
        out = []
        while (t := claim(s)) is not None:
            out.append(suggest(t, sp)["train.learning_rate"])
            s.tell(t, 1.0)
        return out

    assert draws("again", 7) == [v for _, v in got]
    assert draws("other", 8) != [v for _, v in got]


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_trial_whose_heartbeat_stops_is_failed_once_and_queued_again(tmp_path, kind):
    """A claimed trial whose process stops beating: after the grace period, any process of the study marks it
    failed (lost) and enqueues it again with its values and folder; a second check finds nothing more to do."""
    from difftrain.flows.study import FOLDER, build_space, claim, fail_stale, open_storage, open_study, optuna_quiet

    optuna = optuna_quiet()
    url = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else str(tmp_path / "study.journal")
    space = build_space({"lora.rank": [4, 8]}, {}, None, 0, None)
    study, _ = open_study(open_storage(url, 1, 1), "s", url, space, {}, {}, optuna.pruners.NopPruner(), ())
    trial = claim(study)
    trial.set_user_attr(FOLDER, "t-x")
    other = optuna.load_study(study_name="s", storage=open_storage(url, 1, 1))
    assert fail_stale(other, 1, tmp_path) == []  # beating (claimed just now)
    time.sleep(2.2)
    assert fail_stale(other, 1, tmp_path) == [trial.number]
    assert fail_stale(other, 1, tmp_path) == []
    trials = _study(url, "s").trials
    lost = trials[trial.number]
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == trial.number]
    assert lost.state.name == "FAIL" and len(retry) == 1 and retry[0].state.name == "WAITING"
    assert retry[0].params == lost.params and retry[0].user_attrs[FOLDER] == "t-x"


@pytest.mark.parametrize(
    "storage, needles",
    [
        ("sqlite:///@TMP@/missing/study.db", ["cannot be reached: its folder @TMP@/missing does not exist"]),
        pytest.param(
            "postgresql://sweeper:hunter2@127.0.0.1:9/difftrain",
            ["postgresql://sweeper:***@127.0.0.1:9/difftrain"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "@TMP@/missing/sweep.journal",
            ["The journal file @TMP@/missing/sweep.journal cannot be made"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["sqlite", "postgresql", "journal"],
)
def test_an_unreachable_storage_is_said_before_anything_runs(tmp_path, storage, needles):
    out = tmp_path / "sw"
    storage = storage.replace("@TMP@", str(tmp_path))
    r = _script("sweep", "--recipe", "tiny-sdxl-lora", "-g", "lora.rank=4,8", "--storage", storage, "-o", out)
    clean_failure(r, 1, *[n.replace("@TMP@", str(tmp_path)) for n in needles])
    assert "hunter2" not in r.err + r.out  # the password is not printed
    assert not out.exists() and not (tmp_path / "missing").exists()


def test_sweep_report_reads_a_folder_made_by_the_scheduler_before_optuna(cli, tmp_path):
    """tests/fixtures/sweep-v1 was written by difftrain's own scheduler (c6e97ee): it is read as it is."""
    copy = Path(shutil.copytree(FIXTURE, tmp_path / "old"))
    r = cli("sweep", "report", copy, "--sort", "val_loss")
    assert r.code == 0, r
    rows = json.loads((copy / "results.json").read_text())
    assert [(row["train.learning_rate"], row["status"]) for row in rows] == [(1e-3, "ok"), (1e30, "nan")]
    assert rows[0]["val_loss"] == pytest.approx(1.1124325394630432) and rows[0]["steps"] == 2
    assert "loss became nan" in rows[1]["error"]
    assert (copy / "results.csv").read_text().startswith("trial,train.learning_rate,status,")
    assert (copy / "report.html").is_file() and not (copy / "study.db").exists()


# ----------------------------------------------------------------- refusals (a study made, nothing trained)
@pytest.mark.slow
def test_a_study_of_another_recipe_cache_or_space_is_refused_and_kept(tiny_model, _dataset_master, cache, tmp_path):
    """A study made by `difftrain sweep ARGS -g lora.rank=4,8` (here made without running it), then the command
    with other settings, another cache's settings or other axes: refused (exit 2) with what differs, before
    anything runs; the study's trials unchanged."""
    from difftrain.flows import sweep as sw
    from difftrain.flows.study import base_of, build_space, open_storage, open_study, optuna_quiet, storage_url

    out = tmp_path / "sw"
    args = _sweep_args(tiny_model, _dataset_master, cache)
    spec = sw.SweepSpec(
        recipe="tiny-sdxl-lora",
        sets=[a for a in args[7:] if a != "--set"],
        extra={"data": {"dir": str(_dataset_master)}, "model": {"path": str(tiny_model)}},
        grid={"lora.rank": [4, 8]},
    )
    space = build_space(spec.grid, {}, None, 0, None)
    url = storage_url(None, out)
    out.mkdir(parents=True)
    base = sw._resolve_trial(spec, {}, out / "trials" / "base").config
    open_study(
        open_storage(url),
        "sw",
        url,
        space,
        base_of(base.model_dump(mode="json"), space.axes),
        spec.as_json(),
        optuna_quiet().pruners.NopPruner(),
        sw.PRECOMPUTE_SECTIONS,
    )
    before = [(t.number, t.state.name, t.params) for t in _study(url, "sw").trials]
    grid = ["-g", "lora.rank=4,8"]
    for change, needles in (
        (
            [*grid, "--set", "train.max_steps=3"],
            ["was made by another recipe or settings", "train.max_steps: 2 in the study, 3 now"],
        ),
        (
            [*grid, "--set", "data.caption_dropout_rate=0.1"],
            ["was made over another cache", "data.caption_dropout_rate"],
        ),
        (["-g", "lora.rank=4,16"], ["sweeps another search space", "grid over lora.rank"]),
    ):
        r = _script(*args, *change, "-o", out)
        clean_failure(r, 2, *needles, "The study and its trials are unchanged")
        assert [(t.number, t.state.name, t.params) for t in _study(url, "sw").trials] == before
    assert not (out / "trials").exists()


# ----------------------------------------------------------------- shared studies, retries, pruning
@pytest.mark.slow
def test_two_sweep_processes_share_one_study_and_run_no_trial_twice(tiny_model, _dataset_master, cache, tmp_path):
    """The same command twice at once into one folder (its study.db): the four grid points are claimed one at a
    time; two run (once each: every step once in their metrics), two are refused by the config (recorded with its
    message and hint, the sweep goes on)."""
    out = tmp_path / "sw"
    args = [
        *_sweep_args(tiny_model, _dataset_master, cache),
        "-g",
        "lr=1e-3,2e-3",
        "-g",
        "memory.optimizer.kind=adamw,cpu_offload",
        "-o",
        str(out),
    ]
    procs = [
        subprocess.Popen([console_script(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    err = "".join(e for _, e in outs)
    started = [line for line in err.splitlines() if line.startswith("sweep: trial #") and "(learning_rate" in line]
    assert len(started) == 2 and len({line.split()[2] for line in started}) == 2, err
    assert err.count("cannot run:") == 2 and "cpu_offload" in err
    study = _study(f"sqlite:///{out / 'study.db'}", "sw")
    states = sorted((t.params["memory.optimizer.kind"], t.state.name) for t in study.trials)
    assert states == [("adamw", "COMPLETE")] * 2 + [("cpu_offload", "FAIL")] * 2
    for t in study.trials:
        if t.state.name == "COMPLETE":
            steps = [
                json.loads(x)["step"]
                for x in (out / "trials" / t.user_attrs["difftrain.folder"] / "metrics.jsonl").read_text().splitlines()
            ]
            assert sorted(steps) == [1, 2]
        else:
            assert "cpu_offload" in t.user_attrs["error"] and t.user_attrs["status"] == "failed"
    rows = json.loads((out / "results.json").read_text())
    assert sorted(r["status"] for r in rows) == ["failed", "failed", "ok", "ok"]


@pytest.mark.slow
def test_a_killed_sweep_process_s_trial_is_failed_and_run_again_from_its_checkpoint(
    tiny_model, _dataset_master, cache, tmp_path
):
    """A journal-file study: the first process is killed (SIGKILL, its trial's child with it) after its trial's
    first checkpoint; a second process of the study finds the trial's heartbeat stopped, marks it failed and runs
    it again in the same folder from that checkpoint."""
    out, journal = tmp_path / "sw", tmp_path / "study.journal"
    args = [
        *_sweep_args(tiny_model, _dataset_master, cache, "train.checkpoint_every=1", steps=3),
        "-g",
        "lr=1e-3",
        "--storage",
        str(journal),
        "--heartbeat-interval",
        "1",
        "--grace-period",
        "3",
        "-o",
        str(out),
    ]
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 - closed below
    first = subprocess.Popen([console_script(), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, folder = time.time() + 300, None
        while time.time() < deadline and first.poll() is None:
            text = (tmp_path / "first.log").read_text()
            started = [line for line in text.splitlines() if line.startswith("sweep: trial #")]
            if started:
                folder = out / "trials" / started[0].split()[3]
                if list(folder.glob("checkpoints/step-*/trainer_state.json")):
                    break
            time.sleep(0.2)
        assert folder is not None and first.poll() is None, (tmp_path / "first.log").read_text()
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        first.wait()
        log.close()
    time.sleep(0.5)
    second = _script(*args, timeout=600)
    assert second.code == 0, second
    text = " ".join(second.err.split())
    assert "lost its heartbeat" in text and "(a retry: continues from its last checkpoint)" in text
    study = _study(str(journal), "sw")
    ends = sorted((t.user_attrs["difftrain.folder"], t.state.name, t.user_attrs.get("status")) for t in study.trials)
    lost = [e for e in ends if e[1] == "FAIL"]
    assert len(lost) == 1 and lost[0][2] == "lost" and set(ends) == {lost[0], (lost[0][0], "COMPLETE", "ok")}
    assert "resumed from" in (out / "trials" / lost[0][0] / "train.log").read_text()
    steps = [
        json.loads(x).get("step") for x in (out / "trials" / lost[0][0] / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 3
    rows = json.loads((out / "results.json").read_text())
    assert [r["status"] for r in rows] == ["ok"]  # the lost attempt is folded into its retry


@pytest.mark.slow
def test_pruning_stops_the_losing_trial_and_keeps_its_checkpoint(tiny_model, _dataset_master, cache, tmp_path):
    """Median pruning on the held-out loss: a learning rate of 10 blows the held-out loss up at step 1 (finite,
    so no divergence stop): the pruner stops it there against the finished trial's curve."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text("grid: {train.learning_rate: [1.0e-3, 10.0]}\nprune: {pruner: median, n_startup_trials: 1}\n")
    out = tmp_path / "sw"
    sets = ["validation.loss_items=1", "validation.every_n_steps=1", "train.checkpoint_every=100"]
    r = _script(*_sweep_args(tiny_model, _dataset_master, cache, *sets, steps=4), "--spec", spec, "-o", out)
    assert r.code == 0, r
    rows = {row["train.learning_rate"]: row for row in json.loads((out / "results.json").read_text())}
    ok, pruned = rows[1e-3], rows[10.0]
    assert ok["status"] == "ok" and ok["steps"] == 4
    assert pruned["status"] == "pruned" and pruned["pruned_step"] == 1 and pruned["steps"] < 4
    study = _study(f"sqlite:///{out / 'study.db'}", "sw")
    trials = {t.params["train.learning_rate"]: t for t in study.trials}
    assert trials[10.0].state.name == "PRUNED" and trials[1e-3].state.name == "COMPLETE"
    assert pruned["pruned_value"] == trials[10.0].intermediate_values[1] > trials[1e-3].intermediate_values[1]
    assert list((out / "trials" / pruned["trial"] / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_a_gpu_named_twice_runs_two_trials_on_it_at_once(tiny_model, _dataset_master, cache, tmp_path):
    """--gpus 0,0: two slots on one device (small trials beside each other on a big GPU), not one: the worker once
    kept its running trials by device id, so a repeated id ran one trial at a time."""
    out = tmp_path / "sw"
    r = _script(*_sweep_args(tiny_model, _dataset_master, cache), "-g", "lora.rank=4,8", "--gpus", "0,0", "-o", out)
    assert r.code == 0, r
    runs = [json.loads(p.read_text()) for p in (out / "trials").glob("*/result.json")]
    assert len(runs) == 2 and {x["gpu"] for x in runs} == {"0"}
    assert max(x["started"] for x in runs) < min(x["ended"] for x in runs)  # side by side


# ----------------------------------------------------------------- a real PostgreSQL server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def postgres():
    """A PostgreSQL server on a temporary data folder (as a non-root user where the tests run as root: PostgreSQL
    refuses root), its URL; skipped, with the reason, where none can start."""
    pytest.importorskip("psycopg", reason="needs psycopg (pip install 'psycopg[binary]': the test extra)")
    found = [shutil.which(n) for n in ("initdb", "pg_ctl")]
    if not all(found):
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        found = [str(bins[-1] / n) if bins else None for n in ("initdb", "pg_ctl")]
    if not all(found) or not all(Path(f).exists() for f in found if f):
        pytest.skip("no PostgreSQL server here (initdb, pg_ctl; Debian: apt-get install postgresql)")
    initdb, pg_ctl = found
    import tempfile

    # not under pytest's folder: that is the test user's alone, and the server may run as another user
    root = Path(tempfile.mkdtemp(prefix="difftrain-pg-"))
    run_as: list[str] = []
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            pytest.skip("running as root and no runuser to start PostgreSQL as another user")
        shutil.chown(root, "nobody")
        os.chmod(root, 0o700)
        run_as = [runuser, "-u", "nobody", "--"]
    port = _free_port()
    r = subprocess.run([*run_as, initdb, "-D", str(root / "data"), "-U", "postgres", "--auth=trust"],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"initdb failed: {r.stderr.strip()[-300:]}")
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    r = subprocess.run([*run_as, pg_ctl, "-D", str(root / "data"), "-o", opts, "-l", str(root / "log"), "-w", "start"],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {r.stderr.strip()[-300:]}")
    try:
        yield f"postgresql://postgres:secret@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*run_as, pg_ctl, "-D", str(root / "data"), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_a_study_on_a_real_postgresql_server(postgres, tiny_model, _dataset_master, cache, tmp_path):
    out = tmp_path / "sw"
    r = _script(*_sweep_args(tiny_model, _dataset_master, cache, steps=1), "-g", "lr=1e-3", "--storage", postgres,
                "--study", "pg-sweep", "-o", out)  # fmt: skip
    assert r.code == 0, r
    assert "secret" not in r.err + r.out + (out / "sweep.json").read_text()
    study = _study(postgres, "pg-sweep")
    assert [t.state.name for t in study.trials] == ["COMPLETE"]
    assert study.user_attrs["difftrain.space"]["sampler"] == "grid"
    # sweep.json keeps no password: the report asks for the storage, then reads the study from it
    clean_failure(_script("sweep", "report", out), 2, "--storage URL")
    r = _script("sweep", "report", out, "--storage", postgres)
    assert r.code == 0, r
    assert [row["status"] for row in json.loads((out / "results.json").read_text())] == ["ok"]
