"""Checkpoints: atomic folders under <output_dir>/checkpoints/step-NNNNNNNN.

A checkpoint holds everything exact resume needs (trainable weights,
optimizer, LR scheduler, grad scaler, step/epoch/sampler position, every RNG
state), the exportable LoRA, and the resolved config. It is written to a
temporary folder and renamed, so a crash mid-save leaves the previous
checkpoints untouched and no half-written one that looks complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import CheckpointError

PREFIX = "step-"


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


def list_checkpoints(output_dir: Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "trainer_state.json").exists()
    ]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def resolve_resume(output_dir: Path, resume: str) -> Path:
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(
                f"--resume latest: there is no checkpoint in {Path(output_dir) / 'checkpoints'}.",
                hint="Train with train.checkpoint_every set, or give a checkpoint folder path.",
            )
        return found[-1]
    p = Path(resume)
    if not (p / "trainer_state.json").exists():
        raise CheckpointError(
            f"{p} is not a difftrain checkpoint (no trainer_state.json).",
            hint="Give a folder like <output_dir>/checkpoints/step-00000100, or --resume latest.",
        )
    return p


def prune(output_dir: Path, keep: int | None) -> None:
    if not keep:
        return
    for p in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def remove_unfinished(output_dir: Path) -> list[Path]:
    """Remove the temporary folders of checkpoint writes a crash (kill -9, power loss) cut short: atomic_dir names
    them ``.step-NNNNNNNN.<random>.tmp``; nothing ever reads them. Returns what was removed."""
    root = Path(output_dir) / "checkpoints"
    stale = sorted(root.glob(f".{PREFIX}*.tmp")) if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale
