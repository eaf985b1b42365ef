"""The one explicit training loop: step, accumulate, clip, log, checkpoint.

Reads only the precompute cache: the VAE and (unless their LoRA is trained)
the text encoders are never loaded. Everything random is drawn from a seeded
generator whose state, with the sampler position, is saved in every
checkpoint, so N steps + resume + N steps equal 2N steps in one go.

The rooms around it: ``setup`` builds the parts in the technique order, ``feed`` makes the batches,
``objectives`` the losses, ``guards`` stops or skips on non-finite numbers and Ctrl+C, ``readback`` reads the
step numbers back in batches, ``checkpoint`` saves and resumes, ``export`` writes LoRAs and full models.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.progress import TextColumn

from ..config.schema import Config
from ..console import RateColumn, info, progress, warn
from ..data.index import IndexItem
from ..errors import DifftrainError, Interrupted, unexpected_words
from ..families.registry import get_family
from ..memory import activation_offload
from ..memory.plan import weights_dtype
from ..planning.parts import live_stages, plan_parts
from ..runtime import distributed as dist_
from ..speed import attention as speed_attention
from ..speed import auto as speed_auto
from ..speed import regional_compile
from ..utils import atomic_write_text, read_json_object
from . import checkpoint as ckpt
from . import run_folder as rf
from .cache_check import check_cache
from .export import LORA_FILE, Exporter
from .feed import Accumulation, Feed, Position
from .guards import Guards, check_replicas
from .objectives import Draws, Objective
from .profile import StepProfiler
from .profile import wanted as profile_wanted
from .readback import Pending, Readback, Sink, rss_peak_gib
from .setup import build_parts, choose_engine, choose_speed, prepare_process, training_device

if TYPE_CHECKING:
    from .validation import ValidationInputs

__all__ = ["LORA_FILE", "Hooks", "TrainResult", "Trainer", "train"]


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    lora_path: Path | None = None
    checkpoints: list[Path] = field(default_factory=list)
    saved: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)
    #: (step, validation loss) at every validation.every_n_steps and at the end, when items are held out
    val_losses: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Hooks:
    """What a benchmark may ask of a run: steps whose numbers are always read back (so the GPU is waited for
    exactly there; ``difftrain bench`` times between them), and a call after every optimizer step (its profiler)."""

    flush_steps: set[int] = field(default_factory=set)
    after_step: Callable[[], None] | None = None
    #: the step count speed auto weighs the compile time against, instead of this run's (a benchmark's few steps
    #: stand for a real run's many)
    planned_steps: int | None = None


class Trainer:
    def __init__(self, cfg: Config, config_yaml: str | None = None, hooks: Hooks | None = None) -> None:
        self.cfg = cfg
        self.config_yaml = config_yaml
        self.family = get_family(cfg.family)
        self.world = dist_.world_from_env()
        self.device = training_device(cfg, self.world)
        self.out = Path(cfg.train.output_dir)
        self.hooks = hooks or Hooks()
        if hooks is None and (want := profile_wanted()) is not None:  # DIFFTRAIN_PROFILE_DIR: one step profiled
            self.hooks.after_step = StepProfiler(*want, rank=self.world.rank).after_step
        self.guards = Guards(cfg, self.out, self.world)
        self.pos = Position()
        self.samples: list[Path] = []  # validation samples written so far
        self._val_seconds = 0.0

    # ---------------------------------------------------------------- set-up
    def setup(self, resume: Path | None = None) -> None:
        """Everything before the first step: the engine chosen (``resume``: the checkpoint this run continues, known to
        the first process), the cache checked against the config, the parts built, the schedules, the objective,
        and the rooms that save and export."""
        cfg, fam = self.cfg, self.family
        from .validation import check_inputs

        check_inputs(cfg, fam)  # said now, not at the first validation round
        prepare_process(cfg, self.world, self.device)
        self.cfg = cfg = choose_engine(cfg, self.world, self.device, resume)
        # auto resolved (FA4 where installed and running); an attention kernel the device lacks, named before loading
        self._attention_asked = cfg.speed.attention
        self.cfg, line = speed_auto.resolve_attention(cfg, self.device)
        self.cfg = cfg = speed_auto.resolve_geglu(self.cfg, self.device)
        if line and self.world.main:
            info(line)
        self.feed = Feed(cfg, fam, self.device)
        parts, lrs = plan_parts(cfg, fam)
        init = self._read_lora_init([p for p in parts if p in lrs])
        live = live_stages(cfg, fam, lrs)
        check_cache(cfg, fam, self.feed.cache, self.feed.index, live)
        if live:
            info(
                f"text encoders are trained: captions are encoded on the fly each step ({', '.join(live)}); "
                "those cached embeddings are not used"
            )
        self._steps()
        shapes = len(set(self.feed.bucket_keys()))
        self.cfg, self.speed = choose_speed(
            cfg, fam, self.world, self.device, self.hooks.planned_steps or self.total_steps, shapes
        )
        cfg = self.cfg
        if self.world.main:
            info(self.speed.line())
        self.parts = build_parts(cfg, fam, self.world, self.device, parts, lrs, live, init)
        self.feed.live_stages = live
        self.feed.encode_live = self._encode_live
        self._schedules()
        self.exporter = Exporter(cfg, fam, self.world, self.out, self.parts)
        self.checkpointer = ckpt.Checkpointer(
            cfg, self.out, self.world, self.device, self.parts, self.exporter, self.config_yaml
        )
        self.readback = Readback(cfg, self.world, self.device, self.guards, self.total_steps)

    def _read_lora_init(self, trained: list[str]) -> tuple[dict, dict] | None:
        """LoRA's file layouts checked, and lora.init_weights read (and checked against the model's names),
        before anything loads."""
        if self.cfg.train.method != "lora":
            return None
        from ..lora import files as lora_files

        lora_files.formats(self.cfg, self.family)  # a layout the family lacks is refused before anything loads
        lora_files.check_kohya_names(self.cfg, self.family, trained)  # and an adapter the layout cannot name
        if self.cfg.lora.init_weights is None:
            return None
        return lora_files.read_lora(Path(self.cfg.lora.init_weights), self.cfg, self.family, trained)

    def _encode_live(self, stage: str, captions: list[str]) -> dict[str, torch.Tensor]:
        """Captions through a trained text stage (its DDP wrappers on several processes)."""
        comps = {**self.parts.comps, **self.parts.wrapped}
        return self.family.encode_prompts(comps, captions, stage, self.cfg.text_encoders)

    def _steps(self) -> None:
        """The sampler and the step count (before the parts: speed auto weighs the compile time against it)."""
        t = self.cfg.train
        # the global batch: batch_size per process (as the diffusers scripts and sd-scripts count it)
        sampler = self.feed.start(t.batch_size * self.world.size)
        per_epoch = math.ceil(len(sampler) / t.grad_accum)
        self.total_steps = t.max_steps or per_epoch * t.epochs

    def _schedules(self) -> None:
        """Learning-rate schedule, noise scheduler and objective, precisions, the generator."""
        cfg, t = self.cfg, self.cfg.train
        from diffusers.optimization import get_scheduler

        self.lr_scheduler = get_scheduler(
            t.lr_scheduler, self.parts.optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=self.total_steps
        )
        noise_scheduler = self.family.training_scheduler(cfg.model)
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.mixed_precision)
        compute_dtype = weights_dtype(cfg.memory)  # inputs match the (non-fp8) weights
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.mixed_precision == "fp16")
        self.gen = torch.Generator(device=self.device).manual_seed(t.seed)
        self.draws = Draws(self.gen, self.device)
        self.objective = Objective(cfg, self.family, noise_scheduler, self.draws, compute_dtype, amp_dtype)

    @property
    def schedule(self) -> ckpt.Schedule:
        return ckpt.Schedule(self.total_steps, self.feed.global_batch, self.lr_scheduler, self.scaler, self.gen)

    # ---------------------------------------------------------------- losses
    def loss(
        self,
        batch: dict[str, torch.Tensor],
        fixed: tuple[torch.Tensor, torch.Tensor] | None = None,
        per_sample: bool = False,
    ) -> torch.Tensor:
        """The training loss of a micro-batch (see :meth:`Objective.loss`), through the denoiser as it trains."""
        denoiser = self.parts.denoiser(self.family.denoiser)
        return self.objective.loss(denoiser, batch, fixed, per_sample)

    def validation_loss(self) -> float | None:
        """Mean loss over the held-out items (see :func:`validation.held_out_loss`); None when none are held out."""
        from .validation import held_out_loss

        denoiser = self.parts.comps[self.family.denoiser]
        return held_out_loss(self.loss, self.feed, denoiser, self.cfg.validation, self.device)

    # ---------------------------------------------------------------- the run
    def run(self, resume: str | None = None, stop_at: int | None = None, overwrite: bool = False) -> TrainResult:
        """Train to the configured step count; ``stop_at`` ends early (with a checkpoint), as an interruption would.
        The first process holds the run folder's writer lock throughout (``locks.writer_lock``) and claims the
        folder for this run before anything loads (``run_folder.claim``): a new run into another run's folder is
        refused unless ``overwrite``, and a checkpoint of another run is not resumed into it. Under ``difftrain
        train --gpus N`` the launcher did both, once, and an elastic restart of the group continues from the newest
        checkpoint by itself."""
        import os

        self._stepped = False  # an optimizer step done in this start (see the except below)
        try:
            if not self.world.main:
                rf.check_failure(self.out)  # a restart after a user error: the same error, at once
                return self._run(None, stop_at)  # the first process's claim reaches it after the group forms
            from ..runtime.locks import writer_lock

            by_launcher = os.environ.get(rf.ENV_CLAIMED) == "1"
            with contextlib.nullcontext() if by_launcher else writer_lock(self.out, "run folder"):
                if by_launcher or rf.restarted_by_same_agent(self.out):
                    rf.check_failure(self.out)  # a restart after a user error: the same error, at once
                    claim = rf.claimed(self.out, resume)
                    if claim.kind == "restart":
                        rf.take(self.out, claim)
                        self._say_restart(claim)
                else:
                    claim = rf.claim(self.out, resume, overwrite)
                    rf.take(self.out, claim)
                return self._run(claim, stop_at)
        except DifftrainError as e:
            if not isinstance(e, Interrupted):
                rf.note_failure(self.out, e)
            raise
        except Exception as e:
            # an unexpected exception before this start's first step that no restart can get past (not a lost
            # process or the group's communication): the agent's restarts would each load the model to meet it
            # again (2 H200s: a ZeRO-3 setting that failed in step 1 cost three restarts, ~40 s each)
            if not self._stepped and not dist_.restart_may_help(e):
                message, hint = unexpected_words(e)
                rf.note_failure(self.out, e, message=message, hint=hint)
            raise
        finally:
            from ..memory.fsdp import release_group

            release_group()  # FSDP's group of one, where one process made it for itself

    def _say_restart(self, claim: Any) -> None:
        import os

        n, most = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        where = (
            f"from {claim.resume} (step {ckpt.step_of(claim.resume)})"
            if claim.resume is not None
            else "from step 0 (no checkpoint yet: train.checkpoint_every sets how often one is written)"
        )
        warn(f"restart {n} of {most}: a process of the group ended (its error is above); training continues {where}")

    def _run(self, claim: Any, stop_at: int | None) -> TrainResult:
        t0 = time.time()
        self.setup(claim.resume if claim is not None else None)
        stats = {"load_seconds": round(time.time() - t0, 2), "peak_rss_gib_load": round(rss_peak_gib(), 3)}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stats["gpu_alloc_gib_after_load"] = round(torch.cuda.memory_allocated(self.device) / 2**30, 3)
        if self.world.distributed:
            claim = dist_.broadcast_object(claim, self.world)
            if not self.world.main and self.world.local_rank == 0:
                rf.check_shared(self.out, claim.run_id)  # another machine: the same folder?
        self.checkpointer.run_id = claim.run_id
        if claim.resume is not None:
            self.checkpointer.load(claim.resume, self.pos, self.schedule, self.feed)
        self.out.mkdir(parents=True, exist_ok=True)
        if self.world.main:  # before this run writes any checkpoint of its own
            for p in ckpt.remove_unfinished(self.out):
                info(f"removed {p.name}: a checkpoint write a crash cut short")
        if self.config_yaml is not None and self.world.main:
            atomic_write_text(self.out / "config.yaml", self.config_yaml)
        end = min(self.total_steps, stop_at) if stop_at else self.total_steps
        result = TrainResult(self.out, end)
        from .sinks import MetricSinks, NoSinks, write_report_page

        metrics: Any = (
            MetricSinks(self.out, self.cfg.report, self.cfg.model_dump(mode="json"), name=self.out.name)
            if self.world.main
            else NoSinks()
        )
        self._val_seconds, start_step, t_loop = 0.0, self.pos.step, time.time()
        try:
            with self.guards.ctrl_c():
                self._loop(result, metrics, stats, end, t0)
        finally:
            metrics.close()
        done = self.pos.step - start_step
        if done:  # optimizer steps only: validation rounds are timed apart
            stats["s_per_step"] = round((time.time() - t_loop - self._val_seconds) / done, 4)
        stats["validation_seconds"] = round(self._val_seconds, 2)
        result = self._finish(result, stats, t0)
        if self.cfg.report.html and self.world.main:
            write_report_page(self.out)
        return result

    def _fa4_calls(self) -> int | None:
        if self.cfg.speed.attention != "fa4":
            return None
        from ..speed import fa4

        return fa4.calls

    def _say_fa4(self, before: int) -> None:
        from ..speed import fa4

        ran, line = fa4.first_step_line(before)
        if self.world.main:  # only an explicit fa4 that no call reached is worth a warning
            (info if ran or self._attention_asked == "auto" else warn)(line)

    def _loop(self, result: TrainResult, metrics: Any, stats: dict, end: int, t0: float) -> None:
        pos = self.pos
        loss_col = TextColumn("loss {task.fields[loss]:.4f}  {task.fields[mem]}")
        with progress(loss_col, RateColumn()) as bar:
            compiling = self.speed.compile and self.device.type == "cuda"
            first = f"compiling (~{self.speed.compile_s:.0f} s)" if compiling else "training"
            task = bar.add_task(first, total=self.total_steps, completed=pos.step, loss=float("nan"), mem="")
            self.sink = Sink(metrics, result.losses, bar, task, t0)
            self.readback.start(pos.step)
            if pos.step == 0:
                rf.injected_kill(self.world.rank, 0)  # the tests' fault before the first step, if any
            acc = Accumulation()
            fa4_before = self._fa4_calls()  # speed.attention fa4: whether the first step's attention reached it
            while pos.step < end:
                batches = self.feed.epoch_batches(pos)
                while pos.batch_pos < len(batches) and pos.step < end:
                    if self._micro_batch(batches[pos.batch_pos], acc):
                        acc = Accumulation()
                        self._stepped = True
                        self._after_step(result, metrics, stats, end)
                        if fa4_before is not None:
                            self._say_fa4(fa4_before)
                            fa4_before = None
                        if compiling:  # the first step compiled the blocks: the next run of this config starts warm
                            compiling = False
                            bar.update(task, description="training")
                            if self.world.main:
                                regional_compile.mark_warm(self.cfg.speed, regional_compile.warm_key(self.cfg))
                if pos.batch_pos >= len(batches):
                    self._end_epoch(result)
        if pos.step >= self.total_steps:
            self._validate("final", stats, metrics, result)
        g = self.guards
        if g.fp16_skipped:
            stats["fp16_skipped_steps"] = g.fp16_skipped
            warn(
                f"the fp16 grad scaler skipped {g.fp16_skipped} of {pos.step} steps (gradients overflowed; it lowers "
                "its scale each time): many skips mean mixed_precision bf16 would train better"
            )
        if g.nonfinite_skipped:
            stats["nonfinite_skipped_steps"] = g.nonfinite_skipped

    def _micro_batch(self, idx: list[int], acc: Accumulation) -> bool:
        """Forward and backward of the batch at the sampler's position; True when it completed an optimizer step."""
        cfg, pos, t = self.cfg, self.pos, self.cfg.train
        prior = self.feed.prior_batch(len(idx), pos.epoch, pos.batch_pos) if self.feed.prior_items else None
        pos.batch_pos += 1
        scale = 1.0
        if self.world.distributed:
            if len(idx) < self.world.size:  # a bucket's tail too small to share: skipped
                return False
            sl = dist_.local_slice(len(idx), self.world)
            self.draws.share = (sl, len(idx))
            # the averaged gradient is the global batch's mean: weight this slice by its share
            scale = self.world.size * (sl.stop - sl.start) / len(idx)
            idx = idx[sl]
            prior = prior[sl] if prior is not None else None
        batch = self.feed.batch([self.feed.items[i] for i in idx], pos.epoch, augment=True)
        finite = Feed.finite(batch)
        acc.inputs_finite = finite if acc.inputs_finite is None else acc.inputs_finite & finite
        sync = self.parts.no_sync() if acc.micro + 1 < t.grad_accum else contextlib.nullcontext()
        if cfg.speed.cuda_graphs:  # a new step: the graphs' earlier outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        with sync, speed_attention.attention_context(cfg.speed, self.device, self.family.avoid_cudnn_attention):
            loss, prior_value = self._micro_step(batch, prior, scale)
        acc.prior = acc.prior + prior_value
        acc.loss = acc.loss + loss
        acc.micro += 1
        if acc.micro < t.grad_accum:
            return False
        self.guards.inputs_finite = acc.inputs_finite
        grad_norm = self._optimizer_step(acc.loss)
        if self.parts.ema is not None:
            self.parts.ema.update(pos.step)
        prior_loss = acc.prior if self.feed.prior_items else None
        lr = self.lr_scheduler.get_last_lr()[0]
        self.readback.pending.append(
            Pending(pos.step, pos.epoch, acc.loss, grad_norm, prior_loss, acc.inputs_finite, lr)
        )
        if self.hooks.after_step is not None:
            self.hooks.after_step()
        return True

    def _after_step(self, result: TrainResult, metrics: Any, stats: dict, end: int) -> None:
        """What is due after an optimizer step: a flush, a checkpoint, a validation round, an export, a stop."""
        t, v, step = self.cfg.train, self.cfg.validation, self.pos.step
        every = self.cfg.save.every_n_steps
        save_now = bool(t.checkpoint_every and step % t.checkpoint_every == 0)
        validate_now = bool(v.every_n_steps and step % v.every_n_steps == 0 and step < self.total_steps)
        export_now = bool(t.method == "full" and every and step % every == 0 and step < self.total_steps)
        stop = False
        if (
            save_now
            or validate_now
            or export_now
            or step >= end
            or step >= self.readback.flush_at
            or step in self.hooks.flush_steps
            or (self.guards.interrupt and not self.world.distributed)
        ):
            stop = self._flush()  # the losses are checked before anything is saved from these weights
        if save_now:
            result.checkpoints.append(self.save_checkpoint())
        if validate_now:
            self._validate(f"step-{step:08d}", stats, metrics, result)
        if export_now:
            result.saved += self.export_model(f"step-{step:08d}")
        if stop:
            self._stop_now()
        rf.injected_kill(self.world.rank, step)  # the tests' and benchmarks' fault (DIFFTRAIN_TEST_KILL), if any

    def _end_epoch(self, result: TrainResult) -> None:
        pos, t = self.pos, self.cfg.train
        pos.epoch += 1
        pos.batch_pos = 0
        every = self.cfg.save.every_n_epochs
        if t.method == "full" and every and pos.epoch % every == 0 and pos.step < self.total_steps:
            result.saved += self.export_model(f"epoch-{pos.epoch:04d}")

    def _flush(self) -> bool:
        return self.readback.flush(self.pos.step, self.sink)

    @property
    def flush_times(self) -> dict[int, float]:
        """Step -> the time its numbers were back on the host (``difftrain bench`` times between them)."""
        return self.readback.flush_times

    def _micro_step(
        self, batch: dict[str, torch.Tensor], prior: list[IndexItem] | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Loss and backward of one micro-batch; (its loss, its prior loss) as device tensors, read at the flush."""
        t, db = self.cfg.train, self.cfg.dreambooth
        prior_value: torch.Tensor | float = 0.0
        if prior is not None and self.parts.wrapped:
            # DDP takes one forward per backward: instance and class images in one batch (one bucket), split after
            pb = self.feed.batch(prior)
            both = {k: torch.cat([batch[k], pb[k]]) for k in batch}
            n = batch["latents"].shape[0]
            per = self.loss(both, per_sample=True)
            prior_loss = per[n:].mean()
            prior_value = prior_loss.detach() / t.grad_accum
            loss = per[:n].mean() + db.prior_loss_weight * prior_loss
        else:
            loss = self.loss(batch)
            if prior is not None:
                # as diffusers' DreamBooth scripts: instance loss + prior_loss_weight * class loss
                prior_loss = self.loss(self.feed.batch(prior))
                prior_value = prior_loss.detach() / t.grad_accum
                loss = loss + db.prior_loss_weight * prior_loss
        loss = loss / t.grad_accum
        if scale != 1.0:
            loss = loss * scale
        value = loss.detach()  # scaled: its mean over the processes is the global batch's loss (read at the flush)
        engine = self.parts.engine
        if engine is not None:  # DeepSpeed accumulates, clips and steps at its boundary
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        else:
            self.scaler.scale(loss).backward()
        if self.parts.block_swap is not None:
            self.parts.block_swap.end_backward()
        return value, prior_value * scale  # both weighted alike: their means over the processes are the global ones

    def _optimizer_step(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Clip, step, schedule; returns the gradient norm (a device tensor) where one was computed."""
        t, p, pos = self.cfg.train, self.parts, self.pos
        if p.engine is not None:  # the engine stepped in engine.step()
            self.lr_scheduler.step()
            pos.step += 1
            return None
        fp16 = self.scaler.is_enabled()
        skip_mode = t.nonfinite == "skip" and not fp16  # the fp16 scaler skips overflowing steps itself
        norm = None
        if t.max_grad_norm or skip_mode:
            self.scaler.unscale_(p.optimizer)
            grads = [q.grad for q in p.params if q.grad is not None]
            norm = (
                torch.nn.utils.clip_grad_norm_(p.params, t.max_grad_norm)
                if t.max_grad_norm
                else torch.nn.utils.get_total_norm(grads)
            )
            if p.fsdp:  # over sharded gradients the norm is a DTensor: its whole value
                from ..memory.fsdp import full_norm

                norm = full_norm(norm)
        if skip_mode and norm is not None and not bool(torch.isfinite(norm + loss)):  # skip mode's one host sync
            self._skip_step(float(loss), float(norm))
        else:
            before = self.scaler.get_scale() if fp16 else None
            self.scaler.step(p.optimizer)
            self.scaler.update()
            self.guards.stepped(pos.step + 1, fp16 and self.scaler.get_scale() < before)  # type: ignore[operator]
        self.lr_scheduler.step()
        p.optimizer.zero_grad(set_to_none=True)
        pos.step += 1
        return norm

    def _skip_step(self, loss: float, norm: float) -> None:
        """train.nonfinite skip: this step's update is dropped (weights and optimizer state unchanged); too many in
        a row stop the run, after logging the steps before."""
        g, step = self.guards, self.pos.step + 1
        if g.skip(step, loss, norm):
            self._flush()  # the steps before it into the log
            g.diverged(step, loss, norm, bool(g.inputs_finite), f"{g.skipped_run} steps in a row: ")

    def _stop_now(self) -> None:
        saved = ckpt.checkpoint_dir(self.out, self.pos.step)
        if not saved.exists():
            saved = self.save_checkpoint()
        raise Interrupted(
            f"Interrupted at step {self.pos.step} of {self.total_steps}: the training state is saved in {saved}.",
            hint="Continue with the same command plus --resume latest.",
        )

    # ---------------------------------------------------------------- saving
    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.pos, self.schedule)

    def export_model(self, tag: str | None) -> list[Path]:
        """A full fine-tune in save.formats (nothing without formats: the parts training lacks are not loaded)."""
        if not self.cfg.save.formats:
            return []
        return self.exporter.export_model(tag)

    def _finish(self, result: TrainResult, stats: dict, t0: float) -> TrainResult:
        t = self.cfg.train
        if self.parts.wrapped:
            check_replicas(self.parts.params, self.world, self.device)
        stats["peak_rss_gib_train"] = round(rss_peak_gib(), 3)
        if self.device.type == "cuda":
            stats["gpu_peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            stats["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(self.device) / 2**30, 3)
        # the offloaded checkpoints' host slab (12.8 GiB for Wan 14B at 480x832x81) is given back before the final
        # save: the save's host copies (2.1 GiB for Wan 14B's LoRA and its 8-bit AdamW state) came on top of it and
        # made the run's host peak (H200, 2026-11-27: 31.6 GiB at 720p where training peaked at 29.4)
        activation_offload.reset_arena()
        t_save = time.time()
        # a final training state: always for LoRA (small); for a full fine-tune (weights plus
        # optimizer state, several times the model) only when checkpoints were asked for
        wants_final = t.method == "lora" or t.checkpoint_every
        if wants_final and (not t.checkpoint_every or self.pos.step % t.checkpoint_every):
            result.checkpoints.append(self.save_checkpoint())
        if t.method == "lora":
            result.lora_path = self.exporter.export_lora(self.out / LORA_FILE)
        elif self.cfg.save.formats:
            result.saved += self.export_model(None)
        stats["save_seconds"] = round(time.time() - t_save, 2)
        stats["peak_rss_gib_end"] = round(rss_peak_gib(), 3)
        result.seconds = time.time() - t0
        name = "stats.json" if self.world.main else f"stats.rank{self.world.rank}.json"  # every process's memory
        # a resumed run keeps what the earlier part measured and this part did not (s/step of no steps)
        stats = {**read_json_object(self.out / name), **stats}
        result.stats = stats
        atomic_write_text(self.out / name, json.dumps(stats, indent=1) + "\n")
        return result

    # ---------------------------------------------------------------- validation
    def validation_inputs(self) -> ValidationInputs:
        """What a validation round reads of this run (the parts it holds, where, in which precisions)."""
        from .validation import ValidationInputs

        obj = self.objective
        return ValidationInputs(self.cfg, self.family, self.parts.comps, self.device, obj.compute_dtype, obj.amp_dtype)

    def _validate(self, tag: str, stats: dict, metrics: Any, result: TrainResult) -> None:
        """A validation round: the held-out loss (into metrics.jsonl and the result) and the samples.
        GPU memory before the first round and the peak with them go into stats (the memory report
        cogvideox-factory publishes: after load, before validation, with validation, end)."""
        v, dev, step = self.cfg.validation, self.device, self.pos.step
        val_items = self.feed.val_items
        if not (v.prompts or val_items) or not self.world.main:  # the others wait for it at their next collective
            return
        t_val = time.time()
        if dev.type == "cuda":
            peak = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
            stats.setdefault("gpu_peak_alloc_gib_before_validation", peak)
        if val_items:
            val = self.validation_loss()
            assert val is not None  # there are held-out items
            result.val_losses.append((step, val))
            metrics.log({"step": step, "val_loss": val})
            info(f"validation loss at step {step}: {val:.5f} ({len(val_items)} held-out items)")
        if v.prompts:
            from .validation import validate

            self.samples += validate(self.validation_inputs(), tag)
        if dev.type == "cuda":
            stats["gpu_peak_alloc_gib_with_validation"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
            stats["gpu_alloc_gib_after_validation"] = round(torch.cuda.memory_allocated(dev) / 2**30, 3)  # freed?
        self._val_seconds += time.time() - t_val


def train(
    cfg: Config,
    resume: str | None = None,
    config_yaml: str | None = None,
    stop_at: int | None = None,
    overwrite: bool = False,
) -> TrainResult:
    return Trainer(cfg, config_yaml).run(resume, stop_at=stop_at, overwrite=overwrite)
