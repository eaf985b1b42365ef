"""One writer at a time (issue 26, item 2): a run folder and a cache held by one process refuse a second writer at
once, naming the first, through the real console script; nothing of the first is changed; a lock left by a killed
process is taken over with a message; readers need no lock. (A sweep folder is no longer one process's: the
processes of a shared Optuna study meet in it, tests/integration/test_sweep_optuna.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_sets
from difftrain.runtime.locks import LOCK_NAME, NOTE_NAME, holds, writer_lock

SCRIPT = str(Path(sys.executable).parent / "difftrain")

# a process that holds a folder's lock until it is killed (the way a long run would)
HOLDER = """
import sys, time
from difftrain.runtime.locks import writer_lock
with writer_lock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


def _hold(folder: Path, what: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), what], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file's checksum but the lock's own (the holder's, killed with its note left)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (LOCK_NAME, NOTE_NAME)
    }


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=300)


def test_the_lock_is_reentrant_in_a_process_and_exclusive_between_processes(tmp_path):
    with writer_lock(tmp_path, "cache"):
        assert holds(tmp_path)
        note = json.loads((tmp_path / NOTE_NAME).read_text())
        assert note["pid"] == os.getpid() and note["host"] and note["started"]
        with writer_lock(tmp_path, "cache"):  # the same process again (precompute inside train): counted
            assert holds(tmp_path)
        assert holds(tmp_path)
        other = subprocess.run(
            [sys.executable, "-c", HOLDER, str(tmp_path), "cache"], capture_output=True, text=True, timeout=60
        )
        assert other.returncode != 0 and "FolderBusy" in other.stderr and f"pid {os.getpid()}" in other.stderr
    assert not holds(tmp_path) and not (tmp_path / NOTE_NAME).exists()  # released, its note removed
    with pytest.raises(RuntimeError), writer_lock(tmp_path, "cache"):  # released on an error too
        raise RuntimeError("boom")
    assert not holds(tmp_path) and not (tmp_path / NOTE_NAME).exists()


@pytest.mark.slow
def test_a_second_run_into_a_busy_run_folder_refuses_at_once_and_changes_nothing(tiny_model, dataset, tmp_path):
    sets = tiny_sets(tiny_model, dataset, tmp_path, **{"train.max_steps": 2})
    args = [a for s in sets for a in ("--set", s)]
    first = _run("train", "--recipe", "tiny-sdxl-lora", *args)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    before = _snapshot(run)
    holder = _hold(run, "run folder")
    try:
        t = time.time()
        r = _run("train", "--recipe", "tiny-sdxl-lora", *args, "--set", "train.learning_rate=1e-5")
        took = time.time() - t
    finally:
        holder.kill()
        holder.wait()
    text = " ".join(r.stderr.split())
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"The run folder {run} is in use by another difftrain process: pid {holder.pid}" in text
    assert "Wait for it to finish or stop it, or use another run folder" in text
    assert took < 60  # refused before loading the model or training (the first run took its load and two steps)
    assert (
        len(before) > 5 and _snapshot(run) == before
    )  # no file of the first run changed: not its metrics, config, LoRA or checkpoints


@pytest.mark.slow
def test_precompute_into_a_busy_cache_refuses_and_a_killed_writers_lock_is_taken_over(dataset, tiny_model, tmp_path):
    sets = tiny_sets(tiny_model, dataset, tmp_path)
    args = [a for s in sets for a in ("--set", s)]
    cache = tmp_path / "cache"
    holder = _hold(cache, "cache")
    try:
        r = _run("precompute", "--recipe", "tiny-sdxl-lora", *args)
    finally:
        holder.send_signal(signal.SIGKILL)  # killed: its note stays, the OS drops its lock
        holder.wait()
    assert r.returncode == 1 and f"The cache {cache} is in use by another difftrain process: pid {holder.pid}" in (
        " ".join(r.stderr.split())
    )
    assert not (cache / "index.json").exists()  # nothing encoded
    assert json.loads((cache / NOTE_NAME).read_text())["pid"] == holder.pid
    r = _run("precompute", "--recipe", "tiny-sdxl-lora", *args)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stderr.split())
    assert f"taking over the cache {cache}: pid {holder.pid}" in text and "no longer running" in text
    assert (cache / "index.json").exists() and not (cache / NOTE_NAME).exists()
    assert (cache / LOCK_NAME).exists()  # the lock file stays (its lock is the OS's, taken and dropped)
    # a reader needs no lock: cache info and verify run while a writer holds the cache
    holder = _hold(cache, "cache")
    try:
        assert _run("cache", "info", cache).returncode == 0
        assert _run("cache", "verify", cache).returncode == 0
        pruned = _run("cache", "prune", cache)  # prune writes: refused
    finally:
        holder.kill()
        holder.wait()
    assert pruned.returncode == 1 and "is in use by another difftrain process" in pruned.stderr
