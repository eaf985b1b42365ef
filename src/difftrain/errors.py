"""difftrain's exceptions.

Every error a user can cause is a DifftrainError: a sentence saying what went
wrong and where, plus a hint naming the next thing to try. The CLI maps them
once, at the top (cli/app.py); library code only raises.
"""

from __future__ import annotations

import errno


class DifftrainError(Exception):
    """A failure the user can act on. exit_code 1 = failure, 2 = bad usage/config."""

    exit_code = 1
    #: already said where it is reported (an elastic restart ending at once with the error its first start printed:
    #: the launcher's last message repeats it): the CLI exits with the code and prints nothing
    said_elsewhere = False

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message if not self.hint else f"{self.message}\n{self.hint}"


class UsageError(DifftrainError):
    exit_code = 2


class ConfigError(UsageError):
    """Invalid configuration. `problems` lists (dotted path, message) pairs."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None, hint: str | None = None):
        super().__init__(message, hint)
        self.problems = problems or []

    def __str__(self) -> str:
        lines = [self.message] + [f"  {path}: {msg}" for path, msg in self.problems]
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class RecipeNotFound(UsageError):
    pass


class ModelLoadError(DifftrainError):
    pass


class UnsafeCheckpoint(UsageError):
    """A pickle-based checkpoint was given without --allow-pickle."""


class DataError(DifftrainError):
    pass


class CacheMismatch(DifftrainError):
    pass


class CheckpointError(DifftrainError):
    pass


class BackendUnavailable(DifftrainError):
    pass


class SweepStorageError(DifftrainError):
    """A sweep's Optuna storage cannot be reached or written (exit 1)."""


class StudyMismatch(UsageError):
    """A sweep's study was made by another base config, cache or search space (exit 2)."""


class LossNotFinite(DifftrainError):
    """The loss became NaN or infinite: the run diverged (a sweep records the trial as 'nan')."""


class Interrupted(DifftrainError):
    """Ctrl+C: the run stopped after saving its state (exit code 130, as a shell reports SIGINT)."""

    exit_code = 130


#: what torch (CUDA's allocator) and the host say when memory runs out
OOM_WORDS = ("out of memory", "can't allocate memory")
#: what to do about it
OOM_HINT = (
    "Lower train.batch_size, data.resolution or lora.rank, or use a recipe for a smaller GPU tier (`difftrain plan` "
    "predicts the peak)."
)


#: what to do about any other exception that is not a DifftrainError
DEBUG_HINT = "Run again with DIFFTRAIN_DEBUG=1 for the traceback, and report it if it looks like a bug."


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is memory running out, on the GPU or the host."""
    return isinstance(e, MemoryError) or any(m in str(e).lower() for m in OOM_WORDS)


def unexpected_words(e: BaseException) -> tuple[str, str]:
    """What to say of an exception that is not a DifftrainError, and what to do next: memory running out, or an
    unexpected error (the console's message and a restart's note say the same)."""
    if is_oom(e):
        return f"out of memory: {str(e).splitlines()[0] if str(e) else ''}", OOM_HINT
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = f" writing {e.filename}" if e.filename else ""
        return (
            f"the disk is full{where} (No space left on device).",
            "Free space there, or put the cache, the run folder or bench's --work on another disk; what was "
            "written before is intact (checkpoints and caches are written atomically), and a rerun continues.",
        )
    return f"an unexpected {type(e).__name__}: {e}", DEBUG_HINT
