"""One writer at a time for a run folder, a cache and a sweep folder (issue 26).

An advisory lock on ``<folder>/.difftrain.lock`` through ``filelock`` (fcntl's flock on Linux and macOS, msvcrt's
locking on Windows: the operating system drops it when the process dies, however it dies), and beside it
``.difftrain.lock.json`` naming the holder: pid, host, start time and command. A second writer refuses at once,
naming the first. The holder removes the note on every way out it controls; a note found beside a lock nobody
holds was left by a process that was killed, and the new writer says it takes over. Re-entrant within a process
(a sweep's trial inside the sweep, precompute inside ``train``): the same folder's lock is counted, not taken twice.
Readers (``cache info``, ``cache verify``, ``sweep report``, training reading a cache) take no lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import DifftrainError

LOCK_NAME = ".difftrain.lock"
NOTE_NAME = ".difftrain.lock.json"

#: folders this process holds: resolved path -> how many blocks hold it now
_HELD: dict[Path, int] = {}


class FolderBusy(DifftrainError):
    """Another process writes into this folder now."""


def _note(folder: Path) -> dict:
    try:
        data = json.loads((folder / NOTE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _who(note: dict) -> str:
    if not note:
        return "another process (it left no note of itself)"
    cmd = " ".join(str(a) for a in note.get("command", []))[:160]
    return f"pid {note.get('pid', '?')} on {note.get('host', '?')}, since {note.get('started', '?')}" + (
        f" ({cmd})" if cmd else ""
    )


@contextlib.contextmanager
def writer_lock(folder: Path, what: str, wait_s: float = 0) -> Iterator[None]:
    """Hold ``folder``'s writer lock for the block; ``what`` names the folder in messages ("run folder", "cache",
    "sweep folder"). Raises :class:`FolderBusy` when another process holds it: at once, or after waiting ``wait_s``
    seconds for it (the machines of a multi-node run, sharing one cache, take turns at its precompute)."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    lock = FileLock(str(folder / LOCK_NAME), timeout=0, thread_local=False, preserve_lock_file=True)
    try:
        try:
            lock.acquire()
        except Timeout:
            if not wait_s:
                raise
            from ..console import info

            info(f"waiting for the {what} {folder}: {_who(_note(folder))} holds it")
            lock.acquire(timeout=wait_s)
    except Timeout:
        raise FolderBusy(
            f"The {what} {folder} is in use by another difftrain process: {_who(_note(folder))}.",
            hint=f"Wait for it to finish or stop it, or use another {what}. Nothing was written.",
        ) from None
    try:
        left = _note(folder)
        if left:  # its writer was killed before it could remove the note: the lock itself went with the process
            from ..console import warn

            warn(f"taking over the {what} {folder}: {_who(left)} left its lock note and is no longer running")
        note = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": sys.argv,
        }
        tmp = folder / f".{NOTE_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(note) + "\n", encoding="utf-8")
        os.replace(tmp, folder / NOTE_NAME)
        _HELD[key] = 1
        try:
            yield
        finally:
            _HELD.pop(key, None)
            with contextlib.suppress(OSError):
                (folder / NOTE_NAME).unlink()
    finally:
        lock.release()


def holds(folder: Path) -> bool:
    """Whether this process holds ``folder``'s writer lock now."""
    return Path(folder).resolve() in _HELD
