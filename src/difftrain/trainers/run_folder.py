"""A run folder belongs to one run (issue 26).

``<output_dir>/run.json`` names the run that owns the folder: a random id made when it started, and its history
(each start, resume, elastic restart or fork: when, where, from which checkpoint). Every checkpoint records the id
in its ``trainer_state.json``. Before anything loads, the first process claims the folder (:func:`claim`):

- a new run (no ``--resume``) into a folder that holds another run's outputs (:data:`RUN_OUTPUTS`) is refused, naming
  the choices: ``--resume latest``, ``--overwrite`` (the old run's checkpoints, metrics and exports are removed
  first, so nothing of it can be picked up later), or another folder;
- a resume checks that the checkpoint belongs to the folder's run (same id), or, into a folder with no run of its
  own yet, starts a new run there recorded as forked from it;
- an elastic restart of a multi-process run (torchrun's agent after a process died: ``TORCHELASTIC_RESTART_COUNT``
  above 0) continues by itself from the newest complete checkpoint, whatever ``--resume`` or ``--overwrite`` the
  command line carries: the launcher (``difftrain train --gpus N``) claimed the folder once, before starting the
  workers, and holds its lock across the restarts (``DIFFTRAIN_CLAIMED``; a torchrun the user started is known by
  its agent's host and pid, recorded in the history).

Checkpoints written before run.json existed carry no id: they are accepted (nothing says otherwise) and the folder
adopts them. Nothing here is a lock: ``locks.writer_lock`` keeps a second process out while the first one runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..console import info
from ..errors import DifftrainError, UsageError
from ..utils import atomic_write_text, read_json_object
from . import checkpoint as ckpt

RUN_FILE = "run.json"
#: set by the launcher (``difftrain train --gpus N``) for its workers: it took the folder's lock and claim
ENV_CLAIMED = "DIFFTRAIN_CLAIMED"
#: torchrun's count of the group's restarts (0 on the first start)
ENV_RESTARTS = "TORCHELASTIC_RESTART_COUNT"
#: what shows that a run trained in a folder: any of them present (a file, or a folder with something in it) and a
#: new run there is refused. config.yaml is not one (a sweep writes its trial's config there before the trial
#: trains), nor run.json alone (a start that failed before its first step), and files a user put there are left alone.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "stats.json",
    "pytorch_lora_weights.safetensors",
    "checkpoints",
    "samples",
    "saved",
    "model.safetensors",
    "diffusers",
)
#: also the run's, and removed with it by --overwrite
RUN_EXTRAS = (RUN_FILE, "tensorboard", "wandb", "plots", "report.html")


class RunFolderTaken(UsageError):
    """The output folder holds another run's files, or the checkpoint belongs to another run."""


@dataclass
class Claim:
    run_id: str
    #: the checkpoint to resume from (None: from step 0)
    resume: Path | None
    #: how this start continues the folder's history: new, overwrite, resume, fork, restart
    kind: str


def _nonempty(p: Path) -> bool:
    return any(p.iterdir()) if p.is_dir() else p.exists() and p.stat().st_size > 0


def outputs(out: Path) -> list[Path]:
    """What in ``out`` shows that a run trained there (:data:`RUN_OUTPUTS`; empty files and folders do not)."""
    out = Path(out)
    return [out / n for n in RUN_OUTPUTS if (out / n).exists() and _nonempty(out / n)]


def read_run(out: Path) -> dict:
    return read_json_object(Path(out) / RUN_FILE)


def checkpoint_run_id(folder: Path) -> str | None:
    state = read_json_object(Path(folder) / "trainer_state.json")
    rid = state.get("run_id")
    return rid if isinstance(rid, str) else None


def restart_count(env=os.environ) -> int:
    try:
        return int(env.get(ENV_RESTARTS, "0") or 0)
    except ValueError:
        return 0


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def _describe(paths: list[Path]) -> str:
    names = []
    for p in paths:
        if p.name == "checkpoints":
            n = len(ckpt.list_checkpoints(p.parent))
            names.append(f"checkpoints/ ({n} checkpoint{'s' if n != 1 else ''})")
        else:
            names.append(p.name + ("/" if p.is_dir() else ""))
    return ", ".join(names)


def remove_outputs(out: Path) -> list[Path]:
    """``--overwrite``: the earlier run's outputs removed (files a user put in the folder stay)."""
    out = Path(out)
    gone = [out / n for n in (*RUN_OUTPUTS, *RUN_EXTRAS) if (out / n).exists() or (out / n).is_symlink()]
    gone += sorted(out.glob("stats.rank*.json"))
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return gone


def claim(out: Path, resume: str | None = None, overwrite: bool = False) -> Claim:
    """Decide, before anything loads, which run this start is and where it resumes from (see the module's text);
    refuses with :class:`RunFolderTaken`. Writes nothing: :func:`take` does, once the claim is decided."""
    out = Path(out)
    folder_id = read_run(out).get("run_id")
    found = outputs(out)
    if resume:
        folder = ckpt.resolve_resume(out, resume)
        cid = checkpoint_run_id(folder)
        inside = folder.resolve().parent.parent == out.resolve()
        if overwrite:
            if inside:
                raise RunFolderTaken(
                    f"--overwrite with --resume {resume}: the checkpoint {folder} is in the folder --overwrite would "
                    "empty.",
                    hint="Leave out --overwrite to continue that run, or give another --output-dir to start a new "
                    "run from this checkpoint.",
                )
            return Claim(new_run_id(), folder, "fork")
        if folder_id is not None and cid is not None and cid != folder_id:
            where = "among this folder's checkpoints" if inside else f"in {folder.parent.parent}"
            raise RunFolderTaken(
                f"The checkpoint {folder} belongs to run {cid} ({where}), but {out} holds run {folder_id}: resuming "
                "it here would mix two runs' checkpoints, metrics and exports.",
                hint="Resume it into another --output-dir (the new folder is recorded as its fork), or add "
                "--overwrite to replace this folder's run with it.",
            )
        if inside or (folder_id is not None and cid == folder_id):
            return Claim(folder_id or cid or new_run_id(), folder, "resume")
        if found:
            raise RunFolderTaken(
                f"{out} holds another run's files ({_describe(found)}), and the checkpoint {folder} is not one of "
                "its own.",
                hint="Resume into another --output-dir (a fork of that run), or add --overwrite to remove this "
                "folder's run first.",
            )
        return Claim(new_run_id(), folder, "fork")
    if found and not overwrite:
        n = len(ckpt.list_checkpoints(out))
        choices = ["--resume latest to continue it" if n else None, "--overwrite to start over (its files are removed)"]
        raise RunFolderTaken(
            f"{out} holds another run's files ({_describe(found)}): a new run there would mix its metrics, "
            "checkpoints and exports with that run's.",
            hint="Use " + ", ".join(c for c in choices if c) + ", or another --output-dir.",
        )
    return Claim(new_run_id(), None, "overwrite" if found else "new")


def claimed(out: Path, resume: str | None = None, env=os.environ) -> Claim:
    """A worker's view of a folder its launcher claimed (``DIFFTRAIN_CLAIMED``; the launcher took the claim): the
    first start resumes from ``--resume`` as given; an elastic restart continues from the newest complete
    checkpoint (the claim made the folder this run's alone), or from ``--resume`` when the group died before its
    first one."""
    out = Path(out)
    rid = read_run(out).get("run_id")
    if not isinstance(rid, str):
        raise RunFolderTaken(
            f"{out / RUN_FILE} is missing or damaged, though the launcher wrote it before starting this process: "
            "on several machines, train.output_dir must be one folder they all see (shared storage).",
            hint="Put train.output_dir (and data.cache_dir) on storage every machine mounts at the same path.",
        )
    restarts = restart_count(env)
    if restarts:
        done = ckpt.list_checkpoints(out)
        if done:
            return Claim(rid, done[-1], "restart")
    return Claim(rid, ckpt.resolve_resume(out, resume) if resume else None, "restart" if restarts else "launched")


def check_shared(out: Path, run_id: str) -> None:
    """On a machine other than the first process's: its run folder must be the same folder (shared storage), or
    checkpoints written there could not be resumed here."""
    if read_run(out).get("run_id") != run_id:
        raise RunFolderTaken(
            f"{out} on this machine does not hold run {run_id}, which the first process claimed in its own "
            f"{out}: on several machines, train.output_dir must be one folder they all see.",
            hint="Put train.output_dir on storage every machine mounts at the same path (NFS, a shared disk).",
        )


def agent_id() -> str | None:
    """Which torchrun agent runs this process (host and the agent's pid): the same across the group's restarts."""
    return f"{socket.gethostname()}:{os.getppid()}" if ENV_RESTARTS in os.environ else None


def restarted_by_same_agent(out: Path) -> bool:
    """An elastic restart (by a torchrun the user started, with no launcher claim) of the run that claimed ``out``:
    its last start was made under this very agent."""
    history = read_run(out).get("history")
    last = history[-1] if isinstance(history, list) and history and isinstance(history[-1], dict) else {}
    return restart_count() > 0 and agent_id() is not None and last.get("agent") == agent_id()


def take(out: Path, c: Claim) -> None:
    """Carry the claim out: ``--overwrite``'s removal, the metrics of steps a resume will run again, and the
    history in run.json (atomically)."""
    out = Path(out)
    if c.kind != "restart":
        clear_failure(out)  # a failure note of an earlier group's
    if c.kind in ("overwrite", "fork", "new"):
        real = outputs(out)  # overwrite (and a fork with --overwrite): another run's; else none
        gone = remove_outputs(out)  # and the traces of a start that failed before its first step
        if real:
            info(f"--overwrite: removed the earlier run's files from {out}: {_describe(gone)}")
    step = _resume_step(c.resume)
    keep = c.kind in ("resume", "restart")
    if keep:
        _cut_metrics(out, step)
    run = read_run(out) if keep else {}
    history: list = run["history"] if isinstance(run.get("history"), list) else []
    entry: dict = {
        "kind": c.kind,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "t": round(time.time(), 3),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": sys.argv,
    }
    if c.resume is not None:
        entry["from"] = str(c.resume)
        entry["step"] = step
    if c.kind == "fork" and c.resume is not None:
        entry["forked_from_run"] = checkpoint_run_id(c.resume)
    if c.kind == "restart":
        entry["restart"] = restart_count()
    if agent_id() is not None:
        entry["agent"] = agent_id()
    record(out, c.run_id, [*history, entry])


def record(out: Path, run_id: str, history: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / RUN_FILE, json.dumps({"run_id": run_id, "history": history}, indent=1) + "\n")


def _resume_step(folder: Path | None) -> int:
    if folder is None:
        return 0
    step = read_json_object(folder / "trainer_state.json").get("step", 0)
    return step if isinstance(step, int) else 0


def _cut_metrics(out: Path, step: int) -> None:
    """metrics.jsonl without the records of steps after ``step``: a resume runs them again (a crash, or an
    interruption after the checkpoint, left them), and two rows of one step would be two runs' numbers."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line a kill cut short
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(kept))


#: a user error (config, data, a diverged loss) a worker of an elastic group ended with: a restart would meet it again
FAILED_FILE = ".difftrain.failed.json"


class NotRestarted(DifftrainError):
    """An elastic restart after a user error: the error again, before anything loads (printed once, by the first
    start and the launcher's last message, not by every rank at every restart)."""

    said_elsewhere = True


def note_failure(out: Path, err: Exception, message: str | None = None, hint: str | None = None) -> None:
    """Under torchrun's agent: remember the error, so that the restarts the agent makes end at once with it (the
    agent restarts on any failure, and a user error would cost a model load each time). ``message`` and ``hint``:
    what to say of it, where not the error's own (an unexpected exception has neither)."""
    if ENV_RESTARTS not in os.environ or isinstance(err, NotRestarted):
        return
    msg = message or getattr(err, "message", str(err))
    data = {
        "message": msg,
        "hint": hint or getattr(err, "hint", None),
        "rank": os.environ.get("RANK"),
        "type": type(err).__name__,
    }
    with contextlib.suppress(OSError):  # the error itself is what matters
        atomic_write_text(Path(out) / FAILED_FILE, json.dumps(data) + "\n")


def check_failure(out: Path) -> None:
    """Raise the error an earlier start of this group ended with (see :func:`note_failure`)."""
    data = read_json_object(Path(out) / FAILED_FILE)
    if data and restart_count() > 0:
        raise NotRestarted(
            f"not restarted: rank {data.get('rank', '?')} ended with an error a restart would meet again: "
            f"{data.get('message', '?')}",
            hint=data.get("hint") or "Fix it and start the run again (--resume latest continues it).",
        )


def clear_failure(out: Path) -> None:
    (Path(out) / FAILED_FILE).unlink(missing_ok=True)


#: fault injection for the tests and benchmarks/restart_cost.py: "RANK:STEP" makes that process kill itself
#: (SIGKILL, as the out-of-memory killer would) once optimizer step STEP is done (0: before the first step), on the
#: group's first start only; "RANK:STEP:raise" raises an unexpected RuntimeError there instead, on every start (a
#: fault in the code, which a restart meets again)
ENV_TEST_KILL = "DIFFTRAIN_TEST_KILL"


def injected_kill(rank: int, step: int) -> None:
    spec = os.environ.get(ENV_TEST_KILL)
    if not spec:
        return
    r, s, *how = spec.split(":")
    if (int(r), int(s)) != (rank, step):
        return
    if how == ["raise"]:
        raise RuntimeError(f"injected fault at step {step} ({ENV_TEST_KILL})")
    if restart_count() == 0:
        import signal

        note = os.environ.get("DIFFTRAIN_TEST_KILL_NOTE")  # when it died: a benchmark times the restart from it
        if note:
            atomic_write_text(Path(note), f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
