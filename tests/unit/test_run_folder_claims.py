"""A run folder belongs to one run (issue 26, item 1): run_folder.claim's decisions on folders made by hand
(the console-script scenarios are in tests/cli/test_run_folder.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difftrain.trainers import run_folder as rf


def _ckpt(out: Path, step: int, run_id: str | None) -> Path:
    folder = out / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    state: dict = {"step": step, "epoch": 0, "batch_pos": step}
    if run_id is not None:
        state["run_id"] = run_id
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def _run_folder(out: Path, run_id: str, steps=(2, 4)) -> Path:
    out.mkdir(parents=True)
    rf.record(out, run_id, [{"kind": "new"}])
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5)))
    for s in steps:
        _ckpt(out, s, run_id)
    return out


def test_an_empty_or_user_filled_folder_is_claimed_as_a_new_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "config.yaml").write_text("a sweep's trial config")
    (tmp_path / "checkpoints").mkdir()  # empty: nothing of a run
    c = rf.claim(tmp_path)
    assert c.kind == "new" and c.resume is None and len(c.run_id) == 16
    assert rf.claim(tmp_path).run_id != c.run_id  # a fresh id each time


def test_the_traces_of_a_start_that_failed_before_its_first_step_do_not_make_a_run(tmp_path):
    rf.record(tmp_path, "aaaa", [{"kind": "new"}])
    (tmp_path / "metrics.jsonl").write_text("")  # opened, nothing logged
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_bytes(b"header")
    c = rf.claim(tmp_path)
    assert c.kind == "new"
    rf.take(tmp_path, c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"] and rf.read_run(tmp_path)["run_id"] == c.run_id


def test_a_new_run_into_another_runs_folder_is_refused_naming_the_choices(tmp_path):
    out = _run_folder(tmp_path / "run", "aaaa")
    with pytest.raises(rf.RunFolderTaken) as e:
        rf.claim(out)
    assert "holds another run's files" in e.value.message and "checkpoints/ (2 checkpoints)" in e.value.message
    assert "--resume latest" in e.value.hint and "--overwrite" in e.value.hint and "--output-dir" in e.value.hint
    # a folder with an exported LoRA only (no checkpoints): no --resume latest offered
    only = tmp_path / "lora"
    only.mkdir()
    (only / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    with pytest.raises(rf.RunFolderTaken) as e:
        rf.claim(only)
    assert "--resume latest" not in e.value.hint and "--overwrite" in e.value.hint


def test_overwrite_removes_the_old_runs_outputs_and_keeps_the_users_files(tmp_path):
    out = _run_folder(tmp_path / "run", "aaaa")
    (out / "notes.txt").write_text("mine")
    (out / "stats.rank1.json").write_text("{}")
    c = rf.claim(out, overwrite=True)
    assert c.kind == "overwrite"
    rf.take(out, c)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "run.json"]  # stats.rank1.json went too
    run = json.loads((out / "run.json").read_text())
    assert run["run_id"] == c.run_id != "aaaa" and [h["kind"] for h in run["history"]] == ["overwrite"]


def test_resume_checks_the_checkpoint_belongs_to_the_folders_run(tmp_path):
    out = _run_folder(tmp_path / "run", "aaaa")
    c = rf.claim(out, "latest")
    assert (c.kind, c.run_id, c.resume.name) == ("resume", "aaaa", "step-00000004")
    rf.take(out, c)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # nothing after step 4 to drop
    c = rf.claim(out, str(out / "checkpoints" / "step-00000002"))
    rf.take(out, c)  # the steps after 2 will run again: their rows go
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [h["kind"] for h in json.loads((out / "run.json").read_text())["history"]] == ["new", "resume", "resume"]
    # a checkpoint of another run placed among this folder's: refused
    _ckpt(out, 6, "bbbb")
    with pytest.raises(rf.RunFolderTaken, match="belongs to run bbbb"):
        rf.claim(out, "latest")


def test_another_folders_checkpoint_is_refused_into_a_taken_folder_and_forks_into_an_empty_one(tmp_path):
    a = _run_folder(tmp_path / "a", "aaaa")
    b = _run_folder(tmp_path / "b", "bbbb")
    before = sorted(str(p) for p in b.rglob("*"))
    with pytest.raises(rf.RunFolderTaken) as e:
        rf.claim(b, str(a / "checkpoints" / "step-00000002"))
    assert "belongs to run aaaa" in e.value.message and "another --output-dir" in e.value.hint
    assert sorted(str(p) for p in b.rglob("*")) == before
    c = rf.claim(tmp_path / "c", str(a / "checkpoints" / "step-00000002"))
    assert c.kind == "fork" and c.run_id not in ("aaaa", "bbbb")
    rf.take(tmp_path / "c", c)
    entry = json.loads((tmp_path / "c" / "run.json").read_text())["history"][-1]
    assert entry["forked_from_run"] == "aaaa" and entry["step"] == 2
    # --overwrite replaces b's run with the fork; --overwrite cannot empty the folder it resumes from
    c = rf.claim(b, str(a / "checkpoints" / "step-00000002"), overwrite=True)
    rf.take(b, c)
    assert rf.read_run(b)["run_id"] == c.run_id and not (b / "checkpoints").exists()
    with pytest.raises(rf.RunFolderTaken, match="--overwrite would empty"):
        rf.claim(a, "latest", overwrite=True)


def test_checkpoints_of_earlier_versions_carry_no_id_and_are_adopted(tmp_path):
    out = tmp_path / "old"
    _ckpt(out, 3, None)  # no run.json, no run_id: a folder from before run.json existed
    c = rf.claim(out, "latest")
    assert c.kind == "resume" and c.resume.name == "step-00000003"
    rf.take(out, c)
    assert rf.read_run(out)["run_id"] == c.run_id  # the folder now has a run of its own


def test_a_launched_worker_continues_from_the_newest_checkpoint_after_a_restart(tmp_path, monkeypatch):
    out = _run_folder(tmp_path / "run", "aaaa")
    monkeypatch.setenv(rf.ENV_RESTARTS, "0")
    c = rf.claimed(out, str(out / "checkpoints" / "step-00000002"))
    assert (c.kind, c.resume.name) == ("launched", "step-00000002")  # the first start: --resume as given
    monkeypatch.setenv(rf.ENV_RESTARTS, "1")
    c = rf.claimed(out, str(out / "checkpoints" / "step-00000002"))
    assert (c.kind, c.run_id, c.resume.name) == ("restart", "aaaa", "step-00000004")
    empty = tmp_path / "fresh"
    rf.take(empty, rf.claim(empty))
    assert rf.claimed(empty).resume is None  # died before its first checkpoint: from step 0
    (tmp_path / "nofile").mkdir()
    with pytest.raises(rf.RunFolderTaken, match="shared storage"):
        rf.claimed(tmp_path / "nofile")


def test_a_user_error_under_the_agent_ends_the_restarts_at_once(tmp_path, monkeypatch):
    from difftrain.errors import DataError, DifftrainError

    monkeypatch.delenv(rf.ENV_RESTARTS, raising=False)
    rf.note_failure(tmp_path, DataError("bad image", hint="fix it"))
    assert not (tmp_path / rf.FAILED_FILE).exists()  # not under an agent: nothing to remember
    monkeypatch.setenv(rf.ENV_RESTARTS, "0")
    monkeypatch.setenv("RANK", "1")
    rf.note_failure(tmp_path, DataError("bad image", hint="fix it"))
    rf.check_failure(tmp_path)  # the first start: nothing raised
    monkeypatch.setenv(rf.ENV_RESTARTS, "1")
    with pytest.raises(DifftrainError, match=r"not restarted: rank 1 ended with an error .*bad image"):
        rf.check_failure(tmp_path)
    rf.clear_failure(tmp_path)
    rf.check_failure(tmp_path)


def test_only_faults_a_restart_could_get_past_restart_the_group():
    """distributed.restart_may_help: lost peers, the group's communication and CUDA errors restart; a plain fault
    in the code (a shape that does not match) does not."""
    import torch.distributed as tdist

    from difftrain.runtime.distributed import restart_may_help

    assert not restart_may_help(RuntimeError("output with shape [0] doesn't match the broadcast shape [320, 640]"))
    assert not restart_may_help(ValueError("invalid literal for int() with base 10: '0a'"))
    assert restart_may_help(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert restart_may_help(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"))
    assert restart_may_help(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert restart_may_help(tdist.DistBackendError("anything"))


def test_an_unexpected_fault_is_noted_with_its_own_words_and_the_debug_hint(tmp_path, monkeypatch):
    from difftrain.errors import DifftrainError

    monkeypatch.setenv(rf.ENV_RESTARTS, "0")
    monkeypatch.setenv("RANK", "0")
    err = RuntimeError("shapes differ")
    rf.note_failure(tmp_path, err, message=f"an unexpected RuntimeError: {err}", hint="DIFFTRAIN_DEBUG=1")
    monkeypatch.setenv(rf.ENV_RESTARTS, "1")
    with pytest.raises(DifftrainError, match="would meet again: an unexpected RuntimeError: shapes differ") as e:
        rf.check_failure(tmp_path)
    assert e.value.hint == "DIFFTRAIN_DEBUG=1"


def test_the_injected_fault_raises_on_every_start_and_the_kill_spec_still_parses(monkeypatch):
    monkeypatch.setenv(rf.ENV_TEST_KILL, "1:0:raise")
    rf.injected_kill(0, 0)  # another rank: nothing
    rf.injected_kill(1, 1)  # another step: nothing
    for restarts in ("0", "2"):
        monkeypatch.setenv(rf.ENV_RESTARTS, restarts)
        with pytest.raises(RuntimeError, match="injected fault at step 0"):
            rf.injected_kill(1, 0)
    monkeypatch.setenv(rf.ENV_TEST_KILL, "1:3")
    rf.injected_kill(1, 3)  # a kill on a restarted group (restart count 2): nothing
