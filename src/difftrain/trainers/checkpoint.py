"""Checkpoints: atomic folders under <output_dir>/checkpoints/step-NNNNNNNN.

A checkpoint holds everything exact resume needs (trainable weights,
optimizer, LR scheduler, grad scaler, step/epoch/sampler position, every RNG
state), the exportable LoRA, and the resolved config. It is written to a
temporary folder and renamed, so a crash mid-save leaves the previous
checkpoints untouched and no half-written one that looks complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config.schema import Config
from ..console import info
from ..errors import CheckpointError, DifftrainError
from ..lora.adapters import trainable_state
from ..runtime import distributed as dist_
from ..utils import atomic_dir
from .state import load_tree, save_tree

if TYPE_CHECKING:  # a cycle at import time otherwise
    from .export import Exporter
    from .feed import Feed, Position
    from .parts import Parts

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
    return sorted(done, key=step_of)


def step_of(folder: Path) -> int:
    """A checkpoint folder's step, from its name (step-NNNNNNNN)."""
    return int(Path(folder).name[len(PREFIX) :])


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


# ------------------------------------------------------------------ the training state
@dataclass
class Schedule:
    """What a checkpoint stores besides the parts: the step counts, the learning-rate schedule, the fp16 grad
    scaler and the training generator."""

    total_steps: int
    global_batch: int
    lr_scheduler: Any
    scaler: torch.amp.GradScaler
    gen: torch.Generator


class Checkpointer:
    """Saves and loads the training state of one run (every process takes part; the first one writes)."""

    def __init__(
        self,
        cfg: Config,
        out: Path,
        world: dist_.World,
        device: torch.device,
        parts: Parts,
        exporter: Exporter,
        config_yaml: str | None,
    ) -> None:
        self.cfg, self.out, self.world, self.device = cfg, out, world, device
        self.parts, self.exporter, self.config_yaml = parts, exporter, config_yaml
        #: the run that owns the folder (run_folder.claim): recorded in every checkpoint
        self.run_id: str | None = None

    # ---------------------------------------------------------------- save
    def save(self, pos: Position, sched: Schedule) -> Path:
        """:meth:`_save`, with a full disk said as such: the folder being written is removed (by the atomic
        write) and the previous checkpoint, untouched, is named."""
        import errno

        try:
            return self._save(pos, sched)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            prev = list_checkpoints(self.out)
            kept = f"the previous checkpoint {prev[-1]} is intact" if prev else "there is no earlier checkpoint"
            raise CheckpointError(
                f"The disk is full: the checkpoint of step {pos.step} could not be written in {self.out / 'checkpoints'} "
                f"(nothing half-written was left); {kept}.",
                hint="Free some space (or set train.keep_checkpoints lower), then resume with --resume latest.",
            ) from None

    def _save(self, pos: Position, sched: Schedule) -> Path:
        """The training state, atomically. Several processes: each takes part in what is collective (ZeRO's
        gathers and its own checkpoint files), the first one writes the rest and renames the folder."""
        final = checkpoint_dir(self.out, pos.step)
        if not self.world.distributed:
            with atomic_dir(final) as tmp:
                self._write(tmp, pos, sched, write=True)
        else:
            from ..utils import commit_dir

            tmp = final.with_name(f".{final.name}.shared.tmp")  # one name every process can compute
            if self.world.main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist_.barrier(self.world)
            self._write(tmp, pos, sched, write=self.world.main)
            dist_.barrier(self.world)
            if self.world.main:
                commit_dir(tmp, final)
        if self.world.main:
            prune(self.out, self.cfg.train.keep_checkpoints)
        dist_.barrier(self.world)
        return final

    def _write(self, tmp: Path, pos: Position, sched: Schedule, write: bool) -> None:
        from ..memory.deepspeed_engine import gathered

        p = self.parts
        if p.fsdp:  # every process writes its own shares of the weights and the optimizer state
            from ..memory import fsdp

            (module,) = p.trained.values()  # the validator allows the denoiser alone
            fsdp.save_shares(module, p.optimizer, tmp / "fsdp", self.world.rank, self.world.size)
        else:
            with gathered(p.engine, p.params):
                weights = {
                    f"{part}.{n}": w.detach().clone()
                    for part, m in p.trained.items()
                    for n, w in trainable_state(m).items()
                }
            if write:
                save_tree(weights, tmp, "trainable")
        if p.engine is not None:
            # DeepSpeed's partitioned optimizer state, in DeepSpeed's own format (torch pickles: resuming
            # from them needs --allow-pickle, as any pickle does); every process writes its own partition
            p.engine.save_checkpoint(
                str(tmp / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=True
            )
        elif write and not p.fsdp:  # FSDP's whole optimizer state is written above
            save_tree(p.optimizer.state_dict(), tmp, "optimizer")
        lora = self.cfg.train.method == "lora"
        layers = self.exporter.layers() if lora and p.engine is not None else None
        if not write:
            return
        self._write_rest(tmp, pos, sched)
        if lora:
            self.exporter.save_lora(tmp, use_ema=self.exporter.use_ema, layers=layers)

    def _write_rest(self, tmp: Path, pos: Position, sched: Schedule) -> None:
        """What the first process alone writes: the RNG states, the EMA, the schedules, the position."""
        rng = {
            "python": list(random.getstate()[1]),
            "python_version": random.getstate()[0],
            "python_gauss": random.getstate()[2],
            "torch": torch.get_rng_state(),
            "generator": sched.gen.get_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        save_tree(rng, tmp, "rng")
        if self.parts.ema is not None:
            save_tree(self.parts.ema.state_dict(), tmp, "ema")
        # scheduler state may hold tensors (torchao keeps lr as one): a tree, not JSON
        save_tree(
            {"lr_scheduler": sched.lr_scheduler.state_dict(), "scaler": sched.scaler.state_dict()}, tmp, "schedule"
        )
        state: dict[str, object] = {
            "step": pos.step,
            "epoch": pos.epoch,
            "batch_pos": pos.batch_pos,
            "total_steps": sched.total_steps,
            "global_batch": sched.global_batch,
            "world_size": self.world.size,
            "engine": self.cfg.memory.engine.model_dump(mode="json"),  # engine auto's choice, kept on resume
        }
        if self.run_id is not None:
            state["run_id"] = self.run_id
        if pos.plan is not None and pos.plan[0] == pos.epoch:
            state["epoch_plan"] = pos.plan[1]  # an epoch re-cut for another process count: its batches
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
        if self.config_yaml is not None:
            (tmp / "config.yaml").write_text(self.config_yaml, encoding="utf-8")

    # ---------------------------------------------------------------- load
    @staticmethod
    def recorded_engine(folder: Path) -> dict | None:
        """The memory.engine a checkpoint was made with (None: not recorded, or unreadable: load says why)."""
        try:
            engine = json.loads((Path(folder) / "trainer_state.json").read_text(encoding="utf-8")).get("engine")
        except (OSError, ValueError, AttributeError):
            return None
        return engine if isinstance(engine, dict) and isinstance(engine.get("kind"), str) else None

    def load(self, folder: Path, pos: Position, sched: Schedule, feed: Feed) -> None:
        """:meth:`_load`; a checkpoint whose files hold the wrong types or shapes (damaged, or crafted) is a
        CheckpointError naming it, not whatever the step that trips on it raises."""
        try:
            self._load(folder, pos, sched, feed)
        except DifftrainError:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
                raise
            raise CheckpointError(
                f"The checkpoint {folder} is damaged or does not fit this run "
                f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}).",
                hint="Resume with the config saved in the checkpoint folder (config.yaml), or from an "
                "earlier checkpoint.",
            ) from None

    def _load(self, folder: Path, pos: Position, sched: Schedule, feed: Feed) -> None:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
        if not (
            isinstance(state, dict)
            and all(type(state.get(k)) is int and state[k] >= 0 for k in ("step", "epoch", "batch_pos"))
        ):
            raise ValueError("trainer_state.json lacks step, epoch or batch_pos as non-negative integers")
        self._load_weights(folder)
        self._load_optimizer(folder, state)
        p = self.parts
        if p.ema is not None:
            p.ema.load_state_dict(load_tree(folder, "ema"))
        schedule = load_tree(folder, "schedule")
        sched.lr_scheduler.load_state_dict(schedule["lr_scheduler"])
        sched.scaler.load_state_dict(schedule["scaler"])
        rng = load_tree(folder, "rng")
        random.setstate((rng["python_version"], tuple(rng["python"]), rng["python_gauss"]))
        torch.set_rng_state(rng["torch"])
        sched.gen.set_state(rng["generator"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        pos.step, pos.epoch, pos.batch_pos = state["step"], state["epoch"], state["batch_pos"]
        feed.resume_epoch(
            pos, state.get("global_batch", sched.global_batch), sched.global_batch, state.get("epoch_plan")
        )
        info(f"resumed from {folder} at step {pos.step} (epoch {pos.epoch}, batch {pos.batch_pos})")

    def _load_weights(self, folder: Path) -> None:
        if self.parts.fsdp:
            self._load_sharded(folder)
            return
        if (folder / "fsdp").is_dir():
            raise CheckpointError(
                f"The checkpoint {folder} holds FSDP shares (it was made with memory.engine fsdp).",
                hint="Resume with memory.engine: {kind: fsdp} (and the memory.optimizer it trained with), as config.yaml "
                "in the checkpoint folder says.",
            )
        weights = load_tree(folder, "trainable")
        for part, m in self.parts.trained.items():
            own = trainable_state(m)
            sub = {n[len(part) + 1 :]: w for n, w in weights.items() if n.startswith(part + ".")}
            if set(sub) != set(own):
                raise CheckpointError(
                    f"The checkpoint {folder} was made with a different LoRA setup for {part} "
                    f"({len(sub)} tensors saved, {len(own)} expected).",
                    hint="Resume with the config saved in the checkpoint folder (config.yaml).",
                )
            with torch.no_grad():
                for n, w in m.named_parameters():
                    if n in sub:
                        w.copy_(sub[n])

    def _load_sharded(self, folder: Path) -> None:
        """FSDP: each process reads the rows of every weight and optimizer state it holds now from the shares the
        checkpoint's processes wrote (memory-mapped slices: another process count re-cuts them, and no process
        reads the whole model)."""
        from ..memory import fsdp

        p = self.parts
        (module,) = p.trained.values()
        if not (folder / "fsdp").is_dir():
            raise CheckpointError(
                f"The checkpoint {folder} holds no FSDP shares: it was made with another memory.engine.",
                hint="Resume with the config saved in the checkpoint folder (config.yaml).",
            )
        try:
            fsdp.load_shares(module, p.optimizer, folder / "fsdp", self.world.rank, self.world.size)
        except ValueError as e:
            raise CheckpointError(
                f"The checkpoint {folder} does not fit this run: {e}.",
                hint="Resume with the config saved in the checkpoint folder (config.yaml).",
            ) from None

    def _load_optimizer(self, folder: Path, state: dict) -> None:
        p = self.parts
        if p.fsdp:  # read with the weights (_load_sharded)
            return
        if p.engine is None:
            p.optimizer.load_state_dict(load_tree(folder, "optimizer", device=self.device))
            return
        if not self.cfg.model.allow_pickle:
            raise CheckpointError(
                f"{folder} holds DeepSpeed's optimizer state, which DeepSpeed stores as torch pickles; "
                "difftrain does not unpickle files unless told to.",
                hint="If you trust this folder (difftrain wrote it), resume with --allow-pickle.",
            )
        tag = "state"
        if state.get("world_size", 1) != self.world.size:  # ZeRO's partitions were cut for another count
            tag = self._universal(folder)
        p.engine.load_checkpoint(
            str(folder / "deepspeed"),
            tag=tag,
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )

    def _universal(self, folder: Path) -> str:
        """DeepSpeed's universal checkpoint of ``folder``'s ZeRO state (made once, by the first process, beside
        the original and renamed into place when complete), and the engine told to load that format: how a
        ZeRO run resumes on another number of GPUs."""
        import argparse

        out = folder / "deepspeed" / "state_universal"
        if self.world.main and not out.exists():
            from deepspeed.checkpoint import ds_to_universal

            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            info(
                f"the checkpoint's ZeRO state was cut for another number of GPUs: converting it to DeepSpeed's "
                f"universal format ({out})"
            )
            ds_to_universal.main(
                argparse.Namespace(
                    input_folder=str(folder / "deepspeed" / "state"),
                    output_folder=str(tmp),
                    num_extract_workers=4,
                    num_merge_workers=2,
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=True,
                )
            )
            os.replace(tmp, out)
        dist_.barrier(self.world)
        self.parts.engine._config.load_universal_checkpoint = True  # read by load_checkpoint; DeepSpeed has no setter
        return out.name
