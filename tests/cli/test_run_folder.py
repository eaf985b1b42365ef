"""A run folder belongs to one run (issue 26, items 1 and 5), through the real console script: a new run into
another run's folder refuses (exit 2, naming --resume latest, --overwrite and another folder) and changes no file;
--overwrite starts over with nothing of the old run left to pick up; another run's checkpoint is not resumed into
a taken folder; a resume drops the metrics rows of the steps it runs again."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import set_args, tiny_sets
from difftrain.runtime.locks import LOCK_NAME

SCRIPT = str(Path(sys.executable).parent / "difftrain")


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=300)


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def _steps(run: Path) -> list[int]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def _train(model, data, root: Path, *extra, steps: int = 4, lr: str = "1e-3") -> subprocess.CompletedProcess:
    sets = tiny_sets(
        model,
        data,
        root,
        **{"train.max_steps": steps, "train.checkpoint_every": 2, "train.learning_rate": lr, "report.html": "false"},
    )
    return _run("train", "--recipe", "tiny-sdxl-lora", *set_args(sets), *extra)


@pytest.mark.slow
def test_a_new_run_into_a_finished_runs_folder_refuses_and_overwrite_starts_over(tiny_model, dataset, tmp_path):
    first = _train(tiny_model, dataset, tmp_path)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    (run / "notes.txt").write_text("the user's own file")
    before = _snapshot(run)
    first_id = json.loads((run / "run.json").read_text())["run_id"]
    t = time.time()
    again = _train(tiny_model, dataset, tmp_path, steps=1, lr="1e-5")
    took = time.time() - t
    text = " ".join(again.stderr.split())
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"{run} holds another run's files" in text and "checkpoints/ (2 checkpoints)" in text
    assert "--resume latest to continue it" in text and "--overwrite to start over" in text
    assert "another --output-dir" in text
    assert took < 60  # refused before loading anything
    assert _snapshot(run) == before  # not a byte of the first run changed

    over = _train(tiny_model, dataset, tmp_path, "--overwrite", steps=1, lr="1e-5")
    assert over.returncode == 0, over.stderr
    assert "--overwrite: removed the earlier run's files" in " ".join(over.stderr.split())
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]  # none of the first run's
    assert _steps(run) == [1]  # its metrics are gone, not appended to
    assert (run / "notes.txt").read_text() == "the user's own file"
    new = json.loads((run / "run.json").read_text())
    assert new["run_id"] != first_id and [h["kind"] for h in new["history"]] == ["overwrite"]
    state = json.loads((run / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    assert state["run_id"] == new["run_id"]


@pytest.mark.slow
def test_another_runs_checkpoint_is_refused_into_a_taken_folder_and_a_resume_rewrites_its_steps_once(
    tiny_model, dataset, tmp_path
):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(tiny_model, dataset, a).returncode == 0
    assert _train(tiny_model, dataset, b, lr="1e-4").returncode == 0
    before = _snapshot(b / "run")
    foreign = a / "run" / "checkpoints" / "step-00000002"
    r = _train(tiny_model, dataset, b, "--resume", foreign, lr="1e-4")
    text = " ".join(r.stderr.split())
    a_id = json.loads((a / "run" / "run.json").read_text())["run_id"]
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"The checkpoint {foreign} belongs to run {a_id}" in text and "another --output-dir" in text
    assert _snapshot(b / "run") == before

    # its own checkpoint: the steps after it run again, and metrics.jsonl holds each step once
    own = b / "run" / "checkpoints" / "step-00000002"
    r = _train(tiny_model, dataset, b, "--resume", own, lr="1e-4")
    assert r.returncode == 0, r.stderr
    assert _steps(b / "run") == [1, 2, 3, 4]
    kinds = [h["kind"] for h in json.loads((b / "run" / "run.json").read_text())["history"]]
    assert kinds == ["new", "resume"]

    # into a new folder: a fork, recorded as such
    fork = tmp_path / "fork"
    r = _train(tiny_model, dataset, fork, "--resume", foreign)
    assert r.returncode == 0, r.stderr
    entry = json.loads((fork / "run" / "run.json").read_text())["history"][-1]
    assert entry["kind"] == "fork" and entry["forked_from_run"] == a_id and entry["step"] == 2
    assert _steps(fork / "run") == [3, 4]
