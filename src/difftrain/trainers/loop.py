"""The one explicit training loop: step, accumulate, clip, log, checkpoint.

Reads only the precompute cache: the VAE and (unless their LoRA is trained)
the text encoders are never loaded. Everything random is drawn from a seeded
generator whose state, with the sampler position, is saved in every
checkpoint, so N steps + resume + N steps equal 2N steps in one go.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import ProgressColumn, TextColumn
from rich.text import Text
from torch.nn.parallel import DistributedDataParallel

from .. import distributed as dist_
from .. import speed as speed_
from ..config.schema import Config
from ..console import info, progress, warn
from ..data.batches import BucketBatchSampler
from ..data.cache import DataCache, cache_dir_for, check_index
from ..data.captions import CaptionAugment, live_caption, pick_text
from ..errors import (
    CacheMismatch,
    CheckpointError,
    ConfigError,
    DifftrainError,
    Interrupted,
    LossNotFinite,
    ModelLoadError,
)
from ..families.base import stage_precisions
from ..families.registry import get_family
from ..memory.plan import (
    apply_activations,
    apply_offload,
    apply_weights,
    apply_weights_before_adapters,
    load_device,
    make_optimizer,
    weights_dtype,
)
from ..utils import atomic_dir, atomic_write_text, pick_device, read_json_object, stored_float_dtype, to_dtype
from . import checkpoint as ckpt
from .cache_check import check_cache
from .ema import EMA
from .lora import adapter_metadata, add_lora, export_layers, trainable_state
from .state import load_tree, save_tree

LORA_FILE = "pytorch_lora_weights.safetensors"


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


class RateColumn(ProgressColumn):
    """Optimizer steps per second (or seconds per step when slower than 1 it/s)."""

    def render(self, task) -> Text:
        speed = task.speed
        if not speed:
            return Text("-- it/s")
        return Text(f"{speed:.2f} it/s" if speed >= 1 else f"{1 / speed:.2f} s/it")


def _snr(alphas_cumprod: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a = alphas_cumprod.to(t.device)[t].float()
    return a / (1 - a)


def _rss_peak_gib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU"
    return f"{_rss_peak_gib():.2f} GiB RSS"


def plan_parts(cfg: Config, family) -> tuple[list[str], dict[str, float]]:
    """Which parts training loads, and the learning rate of each trained part.

    A text stage runs on the fly when one of its encoders trains; the other
    stages come from the cache (SD3 trains CLIP LoRA over cached T5 embeddings).
    """
    t = cfg.train
    te = family.trainable_text_encoders
    lrs = {}
    if t.method == "lora":
        lrs[family.denoiser] = t.learning_rate
        if t.train_text_encoders:
            lrs.update(dict.fromkeys(te, t.learning_rate))
    else:
        f = cfg.full
        if f.train_unet:
            lrs[family.denoiser] = t.learning_rate
        if f.train_text_encoder_1:
            lrs[te[0]] = f.learning_rate_te1 or t.learning_rate
        if f.train_text_encoder_2:
            lrs[te[1]] = f.learning_rate_te2 or t.learning_rate
    parts = [family.denoiser] + [p for s in live_stages(cfg, family, lrs) for p in family.text_stages[s]]
    return parts, lrs


def live_stages(cfg: Config, family, lrs: dict) -> list[str]:
    """The text stages encoded each step (one of their encoders trains)."""
    return [s for s in family.enabled_stages(cfg.text_encoders) if any(p in lrs for p in family.text_stages[s])]


def sample_sigmas(flow, n: int, shift: float, gen: torch.Generator, device) -> torch.Tensor:
    """Noise levels in (0, 1) drawn as diffusers' SD3 scripts and sd-scripts do, then shifted.

    logit_normal: sigmoid of N(mean, std); mode: 1 - u - scale (cos^2(pi u / 2) - 1 + u)
    (Esser et al. 2024, eq. 20); uniform: u. Shift: s' = shift s / (1 + (shift - 1) s).
    """
    if flow.timestep_sampling == "logit_normal":
        u = torch.sigmoid(flow.logit_mean + flow.logit_std * torch.randn(n, generator=gen, device=device))
    else:
        u = torch.rand(n, generator=gen, device=device)
        if flow.timestep_sampling == "mode":
            u = 1 - u - flow.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    u = u.clamp(1e-5, 1 - 1e-5)
    return shift * u / (1 + (shift - 1) * u)


def flow_loss_weight(kind: str, sigmas: torch.Tensor) -> torch.Tensor | None:
    """SD3's loss weightings (diffusers' compute_loss_weighting_for_sd3)."""
    if kind == "sigma_sqrt":
        return sigmas.float() ** -2.0
    if kind == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas**2
        return 2 / (math.pi * bot)
    return None


def memory_hints(cfg: Config) -> dict:
    family = get_family(cfg.family)
    parts, lrs = plan_parts(cfg, family)
    video = {"frames": cfg.data.frames} if getattr(family, "video", False) else {}
    return family.memory_hints(
        cfg.model, cfg.lora.targets, cfg.lora.rank, cfg.data.resolution, parts, list(lrs), cfg.train.method, **video
    )


def plan_memory(cfg: Config):
    """The planner's estimate for a config: no weight is loaded."""
    from ..memory.planner import estimate

    return estimate(cfg, memory_hints(cfg))


class Trainer:
    def __init__(self, cfg: Config, config_yaml: str | None = None):
        self.cfg = cfg
        self.config_yaml = config_yaml
        self.family = get_family(cfg.family)
        self.world = dist_.world_from_env()
        self.device = pick_device(cfg.train.device)
        if self.world.distributed and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", self.world.local_rank)  # one GPU per process
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.out = Path(cfg.train.output_dir)
        self.wrapped: dict[str, torch.nn.Module] = {}  # DDP wrappers of the trained parts, for their forward
        self._share: tuple[slice, int] | None = None  # this process's slice of the global batch, and its size
        self._plan: tuple[int, list[list[int]]] | None = None  # (epoch, batches) of an epoch re-cut on resume
        self.flush_steps: set[int] = set()  # steps always read back (difftrain bench speed times between them)
        self.flush_times: dict[int, float] = {}  # step -> time its numbers were back on the host
        self.step_hook = None  # called after every optimizer step (difftrain bench speed's profiler)

    # ---------------------------------------------------------------- set-up
    def _load_index(self) -> tuple[DataCache, list[dict]]:
        cache = DataCache(cache_dir_for(self.cfg))
        index = cache.read_json("index.json")
        if index:
            check_index(index, cache.root / "index.json")
        if not index or not index.get("items"):
            raise CacheMismatch(
                f"No precomputed data in {cache.root}.",
                hint="Run `difftrain precompute` with the same recipe/config first.",
            )
        if index.get("family") != self.family.name:
            raise CacheMismatch(
                f"The cache at {cache.root} was made for {index.get('family')!r}, not {self.family.name!r}.",
                hint="Point data.cache_dir at the cache of this model family, or run precompute again.",
            )
        self.index = index
        return cache, index["items"]

    def _setup(self):
        cfg, t = self.cfg, self.cfg.train
        dist_.init(self.world, self.device)
        if t.gpu_memory_limit_gib and self.device.type == "cuda":
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            total = torch.cuda.get_device_properties(idx).total_memory / 2**30
            torch.cuda.set_per_process_memory_fraction(min(1.0, t.gpu_memory_limit_gib / total), idx)
        # seed before anything random happens (the LoRA init draws from the global RNG)
        random.seed(t.seed)
        torch.manual_seed(t.seed)
        self.cache, items = self._load_index()
        # DreamBooth prior preservation: class images ride along with each instance batch
        self.items = [it for it in items if not it.get("prior")]
        self.prior_items = [it for it in items if it.get("prior")]
        if cfg.dreambooth.with_prior_preservation and not self.prior_items:
            raise CacheMismatch(
                "dreambooth.with_prior_preservation is set but the cache has no class images.",
                hint="Run `difftrain precompute` with the same config (it generates and caches them).",
            )
        if not self.items:
            raise CacheMismatch(
                f"The cache at {self.cache.root} holds class images only.", hint="Run precompute with data.dir set."
            )
        self.val_items = self._hold_out()
        speed_.check_attention(cfg.speed, self.device)  # an attention kernel the device lacks, named before loading
        parts, lrs = plan_parts(cfg, self.family)
        init = None
        if t.method == "lora":
            from . import lora_files

            lora_files.formats(cfg, self.family)  # a layout the family lacks is refused before anything loads
            if cfg.lora.init_weights is not None:  # read (and checked against the model's names) before loading it
                init = lora_files.read_lora(
                    Path(cfg.lora.init_weights), cfg, self.family, [p for p in parts if p in lrs]
                )
        self.live_stages = live_stages(cfg, self.family, lrs)
        check_cache(cfg, self.family, self.cache, self.index, self.live_stages)
        self.caption_aug = CaptionAugment.from_config(cfg.data)
        if self.live_stages:
            info(
                f"text encoders are trained: captions are encoded on the fly each step ({', '.join(self.live_stages)}); "
                "those cached embeddings are not used"
            )
        den = self.family.denoiser
        e = cfg.memory.engine
        # a full fine-tune under ZeRO-3 builds the denoiser partitioned. Not with LoRA: peft reads the whole shape
        # of each adapted weight, which a partitioned one no longer has (its frozen base is then loaded by every
        # process from the same memory-mapped pages, one copy in host RAM, before DeepSpeed partitions it).
        # DIFFTRAIN_ZERO3_INIT=0 takes that path for full fine-tunes too (for comparison in benchmarks/multi_gpu.py)
        zero3 = (
            e.kind == "deepspeed"
            and e.stage == 3
            and den in parts
            and t.method == "full"
            and os.environ.get("DIFFTRAIN_ZERO3_INIT") != "0"
        )
        loaded = [part for part in parts if not (zero3 and part == den)]
        self.comps = (
            self.family.load(
                cfg.model,
                loaded,
                dtype=weights_dtype(cfg.memory),
                device=load_device(cfg.memory, self.device),
                precision=stage_precisions(self.family, cfg.text_encoders, self.live_stages),
            )
            if loaded
            else {}
        )
        if zero3:
            self.comps[den] = self._partitioned_denoiser()
        self.trained: dict[str, torch.nn.Module] = {}
        self.block_swap = None
        groups = []
        for part in parts:
            module = self.comps[part]
            keep = self.family.high_precision_modules.get(part, ())
            apply_weights_before_adapters(cfg.memory, module, self.device, keep=keep)
            if cfg.speed.float8 and part == den and part in lrs:
                n = speed_.float8_training(module, self.device)
                info(f"speed.float8: {n} Linear layers of {part} compute in fp8 (torchao float8 training)")
            if part in lrs:
                if t.method == "lora":
                    targets = (
                        cfg.lora.targets if part == self.family.denoiser else self.family.text_encoder_lora_targets
                    )
                    try:
                        params = add_lora(module, cfg.lora, targets)
                    except ValueError as e:
                        raise DifftrainError(
                            f"LoRA: {e}.", hint="Check lora.targets against the model's module names."
                        ) from None
                    if init is not None:
                        self._init_lora(part, module, init)
                else:
                    module.requires_grad_(True)
                    params = list(module.parameters())
                module.train()
                self.trained[part] = module
                groups.append({"params": params, "lr": lrs[part]})
            # checkpointing pays on every module that backward runs through
            if part in lrs or part == self.family.denoiser:
                apply_activations(cfg.memory, module)
            swapped = part == self.family.denoiser and cfg.memory.offload.kind == "block_swap"
            if not (zero3 and part == den):  # ZeRO-3 placed each share of the weights where it belongs
                apply_weights(cfg.memory, module, self.device, keep=keep, swapped=swapped)
            if swapped:
                if self.device.type != "cuda":
                    warn("block swap on the CPU only copies weights around: it saves memory on a GPU")
                self.block_swap = apply_offload(
                    cfg.memory,
                    module,
                    self.family.swap_blocks(module),
                    self.device,
                    full=part in lrs and t.method == "full",
                )
                info(
                    f"block swap: {len(self.block_swap.swapped)} of {len(self.block_swap.units)} blocks of {part} "
                    f"({self.block_swap.swapped_bytes / 2**30:.2f} GiB) live in host RAM"
                )
            if part == den:
                self._speed_up(module)
        self.params = [p for g in groups for p in g["params"]]
        self.engine = None
        if cfg.memory.engine.kind == "deepspeed":
            from ..memory.deepspeed_engine import initialize

            # the validator allows the denoiser as the only trained part
            self.engine, self.optimizer = initialize(cfg, self.trained[self.family.denoiser], self.params)
        else:
            self.optimizer = make_optimizer(
                cfg.memory,
                groups,
                t.learning_rate,
                seed=t.seed,
                kernels=speed_.optimizer_kernels(cfg.speed, self.params),
            )
        if cfg.memory.optimizer.kind == "adamw8bit" and any(p.dtype == torch.bfloat16 for p in self.params):
            warn(
                "adamw8bit updates bf16 weights with round-to-nearest (no stochastic rounding): "
                "very small updates are lost; memory.optimizer.kind adamw rounds stochastically"
            )
        if self.world.distributed and cfg.memory.engine.kind in ("single", "ddp"):
            self._wrap_ddp()
        e = cfg.memory.engine
        if (
            self.world.distributed
            and e.kind == "deepspeed"
            and e.stage == 3
            and (cfg.validation.prompts or cfg.validation.loss_items)
        ):
            raise ConfigError(
                "validation with DeepSpeed ZeRO-3 on several processes is not supported yet (the first "
                "process alone cannot run a model whose weights are spread over all of them).",
                hint="Drop validation.prompts / validation.loss_items for this run, or use ZeRO-2.",
            )
        self.ema = None
        if cfg.ema.enabled:
            named = {
                f"{part}.{n}": p for part, m in self.trained.items() for n, p in m.named_parameters() if p.requires_grad
            }
            self.ema = EMA(named, cfg.ema.decay, cfg.ema.update_every, cfg.ema.device)
        # a batch never mixes sizes, nor (video) frame counts
        # the global batch: batch_size per process (as the diffusers scripts and sd-scripts count it)
        self.global_batch = t.batch_size * self.world.size
        self.sampler = BucketBatchSampler(self._bucket_keys(), self.global_batch, t.seed)
        per_epoch = math.ceil(len(self.sampler) / t.grad_accum)
        self.total_steps = t.max_steps or per_epoch * t.epochs
        from diffusers.optimization import get_scheduler

        self.lr_scheduler = get_scheduler(
            t.lr_scheduler, self.optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=self.total_steps
        )
        self.noise_scheduler = self.family.training_scheduler(cfg.model)
        if self.family.objective == "flow":
            self.flow_shift = cfg.flow.shift or float(self.noise_scheduler.config.get("shift", 1.0))
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.mixed_precision)
        self.compute_dtype = weights_dtype(cfg.memory)  # inputs match the (non-fp8) weights
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.mixed_precision == "fp16")
        self.gen = torch.Generator(device=self.device).manual_seed(t.seed)
        self.step = 0
        self.nonfinite_skipped = 0  # train.nonfinite skip: steps whose update was dropped
        self._skipped: set[int] = set()
        self._scaler_skipped: set[int] = set()
        self._interrupt = False
        self.fp16_skipped = 0  # steps the fp16 grad scaler skipped (an overflow; it then lowers its scale)
        self.epoch = 0
        self.batch_pos = 0

    def _speed_up(self, module: torch.nn.Module) -> None:
        """The speed section's changes to the denoiser, after the memory plan placed it."""
        sp = self.cfg.speed
        if sp.channels_last:
            speed_.channels_last(module)
        if sp.compile:
            act = self.cfg.memory.activations
            every = act.every if act.kind == "checkpoint" else 0
            n = speed_.compile_blocks(module, self.family.repeated_blocks, sp, checkpoint_every=every)
            info(
                f"speed.compile: {n} blocks of {self.family.denoiser} compile on their first step"
                f"{', checkpointed inside the compiled region' if every else ''} (cache: {speed_.compile_cache_dir(sp)})"
            )

    def _init_lora(self, part: str, module: torch.nn.Module, init: tuple[dict, dict]) -> None:
        """lora.init_weights: continue from a LoRA file (diffusers or kohya layout; ``init`` as read) of this part."""
        from . import lora_files

        src = Path(self.cfg.lora.init_weights)
        layers, file_alphas = init
        if part not in layers:
            raise ConfigError(
                f"lora.init_weights {src.name} has no {part} layers.",
                hint="Train only the parts the file adapts, or give the LoRA that has them.",
            )
        lora_files.load_into(module, part, layers[part], file_alphas.get(part, {}), adapter_metadata(module), src)
        info(f"{part}: LoRA weights taken from {src}")

    def _partitioned_denoiser(self) -> torch.nn.Module:
        """ZeRO-3: the denoiser built partitioned on every process (none holds it whole, on the GPU or in host
        RAM) and filled by the main process alone, from its memory-mapped weights, a few hundred MB at a time."""
        from ..memory.deepspeed_engine import build_partitioned

        cfg, den = self.cfg, self.family.denoiser

        def read() -> torch.nn.Module:
            # in the dtype the file stores (its pages memory-mapped, no private copy): the copy to each
            # GPU share converts; a dtype conversion here would hold a second, private copy of the model
            p = Path(cfg.model.path)
            files = [p] if p.is_file() else sorted((p / den).glob("*.safetensors"))
            dtype = stored_float_dtype(files) or weights_dtype(cfg.memory)  # None: not safetensors
            return self.family.load(cfg.model, [den], dtype=dtype, device="cpu")[den]

        try:
            return build_partitioned(cfg, lambda: self.family.empty_part(cfg.model, den), read, self.world.main)
        except ValueError as err:
            raise ModelLoadError(
                f"The {den} weights of {cfg.model.path} do not fit its config: {err}.",
                hint="Check model.config (single files) or the folder's config.json.",
            ) from None

    def _wrap_ddp(self) -> None:
        """DistributedDataParallel around each trained part (its gradients averaged in buckets during backward).
        The wrappers serve the forward passes only: state dicts, exports and validation use the parts
        themselves. Attribute reads fall through to the part, so family code that reads ``.config`` works."""
        import inspect

        e = self.cfg.memory.engine
        cap = getattr(e, "bucket_cap_mb", 25.0)
        n = sum(p.numel() for p in self.params)
        opts = dist_.ddp_options(n, dist_.backend_for(self.device), cap)
        opts["find_unused_parameters"] = getattr(e, "find_unused_parameters", False)
        params = inspect.signature(DistributedDataParallel).parameters
        if "init_sync" in params:
            opts["init_sync"] = False  # every process loaded the same weights and drew the same LoRA init
        if "forward_sync_buffers" in params:  # torch >= 2.13 names it so (broadcast_buffers is deprecated)
            opts["forward_sync_buffers"] = opts.pop("broadcast_buffers")
        ids = [self.device.index] if self.device.type == "cuda" else None
        for part, module in self.trained.items():
            self.wrapped[part] = _DDP(module, device_ids=ids, **opts)
        if self.cfg.memory.engine.kind == "single":
            info(f"{self.world.size} processes: gradients averaged with DDP (memory.engine ddp)")

    def _fwd(self, part: str) -> torch.nn.Module:
        w = self.wrapped.get(part)
        return w if w is not None else self.comps[part]

    def _check_replicas(self) -> None:
        """Several DDP processes must end with the same weights, bit for bit: compare checksums, and stop
        with the reason if they drifted apart (a nondeterministic kernel, a rank that skipped a step)."""
        if not self.wrapped:
            return
        import torch.distributed as dist

        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        mine = torch.zeros(2, dtype=torch.float64, device=dev)
        for p in self.params:
            d = p.detach().to(dev, torch.float64)
            mine[0] += d.sum()
            mine[1] += (d * d).sum()
        every = [torch.zeros_like(mine) for _ in range(self.world.size)]
        dist.all_gather(every, mine)
        if any(not torch.equal(every[0], e) for e in every[1:]):
            raise DifftrainError(
                f"The {self.world.size} processes ended with different weights (checksums "
                f"{[tuple(round(x, 6) for x in e.tolist()) for e in every]}).",
                hint="Report it with the config; a run on one process is unaffected.",
            )
        info(f"the {self.world.size} processes' trained weights agree (checksum {every[0][0].item():.6f})")

    def _bucket_keys(self) -> list:
        return [(*it["bucket"], it.get("frames", 1)) for it in self.items]

    def _epoch_batches(self) -> list[list[int]]:
        if self._plan is not None and self._plan[0] == self.epoch:
            return self._plan[1]
        self._plan = None
        return self.sampler.epoch(self.epoch)

    def _draw(self, draw, n_local: int) -> torch.Tensor:
        """``draw(n)`` for this process's items: on several processes the whole global batch is drawn on each
        (same generator, same seed) and sliced, so N processes see exactly the draws one process would."""
        if self._share is None:
            return draw(n_local)
        sl, n = self._share
        return draw(n)[sl]

    # ---------------------------------------------------------------- data
    def _hold_out(self) -> list[dict]:
        """``validation.loss_items`` items taken out of training for the validation loss: drawn with
        ``validation.seed`` from the items in content order, so every trial of a sweep over one cache
        holds out the same ones whatever its training seed."""
        n = self.cfg.validation.loss_items
        if not n:
            return []
        if n >= len(self.items):
            raise ConfigError(
                f"validation.loss_items is {n}, but the cache has {len(self.items)} training items.",
                hint="Hold out fewer items, so that some are left to train on.",
            )
        order = sorted(range(len(self.items)), key=lambda i: self.items[i]["latent"])
        pick = set(random.Random(f"difftrain-val:{self.cfg.validation.seed}").sample(order, n))
        held = [it for i, it in enumerate(self.items) if i in pick]
        self.items = [it for i, it in enumerate(self.items) if i not in pick]
        return held

    def _prior_batch(self, n: int) -> list[dict]:
        """n class items for the instance batch at the current position: a function of (seed, epoch, batch),
        so a resumed run draws the same ones. One bucket per batch (the instance batch's when it has one)."""
        rng = random.Random(f"difftrain-prior:{self.cfg.train.seed}:{self.epoch}:{self.batch_pos}")
        key = lambda it: (*it["bucket"], it.get("frames", 1))
        buckets = sorted({key(it) for it in self.prior_items})
        bucket = rng.choice(buckets)
        pool = [it for it in self.prior_items if key(it) == bucket]
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    def _batch(self, idx: list[int], items: list[dict] | None = None, augment: bool = False) -> dict[str, torch.Tensor]:
        """The tensors of a micro-batch. ``augment``: the captions as caption augmentation draws them this
        epoch (the training batches), else as written (validation, prior images)."""
        fam = self.family
        items = items if items is not None else [self.items[i] for i in idx]
        seed, aug = self.cfg.train.seed, self.caption_aug
        texts = [
            pick_text(it, aug, seed, self.epoch, self.index.get("empty_text")) if augment else it["texts"]
            for it in items
        ]
        lat_entries = [self.cache.get(it["latent"]) for it in items]
        rows = [fam.conditioning(it, le) for it, le in zip(items, lat_entries)]
        to = self._to_device
        batch = {"latents": to(torch.stack([le["latents"] for le in lat_entries]))}
        batch.update({k: to(torch.stack([r[k] for r in rows])) for k in rows[0]})
        stages = {}
        for stage in fam.enabled_stages(self.cfg.text_encoders):
            if stage in self.live_stages:
                comps = {**self.comps, **self.wrapped}
                captions = [
                    live_caption(it["caption"], aug, seed, self.epoch, it["key"]) if augment else it["caption"]
                    for it in items
                ]
                stages[stage] = fam.encode_prompts(comps, captions, stage, self.cfg.text_encoders)
            else:
                entries = [self.cache.get(tx[stage]) for tx in texts]
                stages[stage] = {k: to(torch.stack([e[k] for e in entries])) for k in entries[0]}
        batch.update(fam.combine_texts(stages, self.cfg.text_encoders))
        return batch

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A host tensor onto the training device. From pageable memory a copy waits for the GPU to finish its
        queue; from pinned memory it is queued behind it (speed.pin_memory)."""
        if self.device.type == "cuda" and self.cfg.speed.pin_memory and x.device.type == "cpu":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    # ---------------------------------------------------------------- one micro-batch
    def _loss(
        self,
        batch: dict[str, torch.Tensor],
        fixed: tuple[torch.Tensor, torch.Tensor] | None = None,
        per_sample: bool = False,
    ) -> torch.Tensor:
        """The training loss of a micro-batch. ``fixed = (noise, q)`` gives the noise and the noise level as
        a quantile q in (0, 1) instead of drawing them, and drops what only training adds (noise offset,
        image dropout, loss weighting): the validation loss, comparable across trials."""
        t = self.cfg.train
        latents = batch["latents"]
        b = latents.shape[0]
        if fixed is not None:
            noise = fixed[0]
        else:
            rest = tuple(latents.shape[1:])
            noise = self._draw(lambda n: torch.randn((n, *rest), generator=self.gen, device=self.device), b)
            if t.noise_offset:
                shape = (latents.shape[1],) + (1,) * (latents.ndim - 2)
                noise = noise + t.noise_offset * self._draw(
                    lambda n: torch.randn((n, *shape), generator=self.gen, device=self.device), b
                )
            if hasattr(self.family, "drop_image_conditioning"):  # image-to-video: sometimes train without the image
                batch = self.family.drop_image_conditioning(batch, self.gen)
        q = fixed[1] if fixed is not None else None
        if self.family.objective == "flow":
            noisy, timesteps, target, weight = self._flow_inputs(latents, noise, q)
        else:
            noisy, timesteps, target, weight = self._ddpm_inputs(latents, noise, q)
        if fixed is not None:
            weight = None
        with torch.autocast(
            self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
        ):
            cond = {
                k: (v.to(self.compute_dtype) if v.is_floating_point() and k != "time_ids" else v)
                for k, v in batch.items()
            }
            denoiser = (
                _EngineView(self.engine, self.comps[self.family.denoiser])
                if self.engine is not None
                else self._fwd(self.family.denoiser)
            )
            pred = self.family.denoise(denoiser, noisy.to(self.compute_dtype), timesteps, cond)
        loss = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=list(range(1, pred.ndim)))
        if weight is not None:
            loss = loss * weight
        return loss if per_sample else loss.mean()

    def _ddpm_inputs(self, latents, noise, q=None):
        """Epsilon or v-prediction from the scheduler config, with optional Min-SNR weighting."""
        t, sched = self.cfg.train, self.noise_scheduler
        n = sched.config.num_train_timesteps
        if q is None:
            timesteps = self._draw(
                lambda k: torch.randint(0, n, (k,), generator=self.gen, device=self.device), latents.shape[0]
            )
        else:
            timesteps = (q * n).long().clamp(0, n - 1)
        noisy = sched.add_noise(latents, noise, timesteps)
        pred_type = sched.config.prediction_type
        target = noise if pred_type == "epsilon" else sched.get_velocity(latents, noise, timesteps)
        weight = None
        if t.min_snr_gamma:
            # Min-SNR weighting (Hang et al. 2023): min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v
            snr = _snr(sched.alphas_cumprod, timesteps)
            weight = torch.clamp(snr, max=t.min_snr_gamma) / (snr + 1 if pred_type == "v_prediction" else snr)
        return noisy, timesteps, target, weight

    def _flow_inputs(self, latents, noise, q=None):
        """Rectified flow: x_s = (1 - s) x0 + s noise, target noise - x0 (SD3). A given quantile q is shifted
        as the scheduler shifts its sigmas."""
        if q is None:
            sigmas = self._draw(
                lambda k: sample_sigmas(self.cfg.flow, k, self.flow_shift, self.gen, self.device), latents.shape[0]
            )
        else:
            sigmas = self.flow_shift * q / (1 + (self.flow_shift - 1) * q)
        s = sigmas.reshape(-1, *([1] * (latents.ndim - 1)))
        noisy = (1 - s) * latents + s * noise
        return noisy, sigmas * 1000, noise - latents, flow_loss_weight(self.cfg.flow.loss_weighting, sigmas)

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Mean loss over the held-out items, each at ``validation.loss_timesteps`` fixed noise levels (the
        quantiles (k + 1/2) / K) with noise drawn on the CPU from a seed per item: the same triples on every
        call, device and trial, so two evaluations of the same weights agree and trials compare."""
        v = self.cfg.validation
        if not self.val_items:
            return None
        denoiser = self.comps[self.family.denoiser]
        was = denoiser.training
        denoiser.eval()
        total, n = 0.0, 0
        try:
            for j, item in enumerate(self.val_items):
                batch = self._batch([], [item])
                g = torch.Generator().manual_seed(v.seed * 1_000_003 + j)
                for k in range(v.loss_timesteps):
                    noise = torch.randn(batch["latents"].shape, generator=g).to(self.device)
                    q = torch.full((1,), (k + 0.5) / v.loss_timesteps, device=self.device)
                    total += self._loss(batch, fixed=(noise, q)).item()
                    n += 1
        finally:
            denoiser.train(was)
        return total / n

    # ---------------------------------------------------------------- the loop
    def run(self, resume: str | None = None, stop_at: int | None = None) -> TrainResult:
        """Train to the configured step count; ``stop_at`` ends early (with a checkpoint), as an interruption would."""
        t0 = time.time()
        self._setup()
        stats = {"load_seconds": round(time.time() - t0, 2), "peak_rss_gib_load": round(_rss_peak_gib(), 3)}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stats["gpu_alloc_gib_after_load"] = round(torch.cuda.memory_allocated(self.device) / 2**30, 3)
        if resume:
            self._load(ckpt.resolve_resume(self.out, resume))
        self.out.mkdir(parents=True, exist_ok=True)
        if self.world.main:  # before this run writes any checkpoint of its own
            for p in ckpt.remove_unfinished(self.out):
                info(f"removed {p.name}: a checkpoint write a crash cut short")
        if self.config_yaml is not None and self.world.main:
            atomic_write_text(self.out / "config.yaml", self.config_yaml)
        end = min(self.total_steps, stop_at) if stop_at else self.total_steps
        result = TrainResult(self.out, end)
        from .sinks import MetricSinks

        metrics = (
            MetricSinks(self.out, self.cfg.report, self.cfg.model_dump(mode="json"), name=self.out.name)
            if self.world.main
            else _NoSinks()
        )
        self._val_seconds, start_step, t_loop = 0.0, self.step, time.time()
        try:
            with self._ctrl_c():
                self._loop(result, metrics, stats, end, t0)
        finally:
            metrics.close()
        if self.step > start_step:  # optimizer steps only: validation rounds are timed apart
            stats["s_per_step"] = round((time.time() - t_loop - self._val_seconds) / (self.step - start_step), 4)
        stats["validation_seconds"] = round(self._val_seconds, 2)
        result = self._finish(result, stats, t0)
        if self.cfg.report.html and self.world.main:
            try:
                from ..report import write_run_report

                write_run_report(self.out)
            except ImportError as e:  # matplotlib missing: the run's results stand without their page
                warn(f"no report.html: {e} (pip install matplotlib)")
        return result

    def _loop(self, result: TrainResult, metrics, stats: dict, end: int, t0: float) -> None:
        t = self.cfg.train
        loss_col = TextColumn("loss {task.fields[loss]:.4f}  {task.fields[mem]}")
        with progress(loss_col, RateColumn()) as bar:
            task = bar.add_task("training", total=self.total_steps, completed=self.step, loss=float("nan"), mem="")
            self._log = (metrics, result, bar, task, t0)
            self._pending: list[dict] = []  # steps whose losses are still on the device
            self._flush_at, self._last_flush = self.step + 1, (time.time(), self.step)
            self.flush_times[self.step] = self._last_flush[0]
            accum, micro, prior_sum, bad_input = 0.0, 0, 0.0, None
            while self.step < end:
                batches = self._epoch_batches()
                while self.batch_pos < len(batches) and self.step < end:
                    idx = batches[self.batch_pos]
                    prior = self._prior_batch(len(idx)) if self.prior_items else None
                    self.batch_pos += 1
                    scale = 1.0
                    if self.world.distributed:
                        if len(idx) < self.world.size:  # a bucket's tail too small to share: skipped
                            continue
                        sl = dist_.local_slice(len(idx), self.world)
                        self._share = (sl, len(idx))
                        # the averaged gradient is the global batch's mean: weight this slice by its share
                        scale = self.world.size * (sl.stop - sl.start) / len(idx)
                        idx = idx[sl]
                        prior = prior[sl] if prior is not None else None
                    batch = self._batch(idx, augment=True)
                    finite = self._finite_inputs(batch)
                    bad_input = finite if bad_input is None else bad_input & finite
                    sync = self._no_sync() if micro + 1 < t.grad_accum else contextlib.nullcontext()
                    if self.cfg.speed.cuda_graphs:  # a new step: the graphs' earlier outputs are no longer read
                        torch.compiler.cudagraph_mark_step_begin()
                    with sync, speed_.attention_context(self.cfg.speed, self.device):
                        loss, prior_value = self._micro_step(batch, prior, scale)
                    prior_sum = prior_sum + prior_value
                    accum = accum + loss
                    micro += 1
                    if micro < t.grad_accum:
                        continue
                    self._inputs_finite = bad_input
                    grad_norm = self._optimizer_step(accum)
                    if self.ema is not None:
                        self.ema.update(self.step)
                    self._pending.append(
                        {
                            "step": self.step,
                            "epoch": self.epoch,
                            "loss": accum,
                            "grad_norm": grad_norm,
                            "prior_loss": prior_sum if self.prior_items else None,
                            "inputs_finite": bad_input,
                            "lr": self.lr_scheduler.get_last_lr()[0],
                        }
                    )
                    accum, micro, prior_sum, bad_input = 0.0, 0, 0.0, None
                    if self.step_hook is not None:
                        self.step_hook()
                    v, every = self.cfg.validation, self.cfg.save.every_n_steps
                    save_now = bool(t.checkpoint_every and self.step % t.checkpoint_every == 0)
                    validate_now = bool(
                        v.every_n_steps and self.step % v.every_n_steps == 0 and self.step < self.total_steps
                    )
                    export_now = bool(
                        t.method == "full" and every and self.step % every == 0 and self.step < self.total_steps
                    )
                    stop = False
                    if (
                        save_now
                        or validate_now
                        or export_now
                        or self.step >= end
                        or self.step >= self._flush_at
                        or self.step in self.flush_steps
                        or (self._interrupt and not self.world.distributed)
                    ):
                        stop = self._flush()  # the losses are checked before anything is saved from these weights
                    if save_now:
                        result.checkpoints.append(self.save_checkpoint())
                    if validate_now:
                        self._validate(f"step-{self.step:08d}", stats, metrics, result)
                    if export_now:
                        result.saved += self.export_model(f"step-{self.step:08d}")
                    if stop:
                        self._stop_now(result)
                if self.batch_pos >= len(batches):
                    self.epoch += 1
                    self.batch_pos = 0
                    every = self.cfg.save.every_n_epochs
                    if t.method == "full" and every and self.epoch % every == 0 and self.step < self.total_steps:
                        result.saved += self.export_model(f"epoch-{self.epoch:04d}")
        if self.step >= self.total_steps:
            self._validate("final", stats, metrics, result)
        if self.fp16_skipped:
            stats["fp16_skipped_steps"] = self.fp16_skipped
            warn(
                f"the fp16 grad scaler skipped {self.fp16_skipped} of {self.step} steps (gradients overflowed; it lowers "
                "its scale each time): many skips mean mixed_precision bf16 would train better"
            )
        if self.nonfinite_skipped:
            stats["nonfinite_skipped_steps"] = self.nonfinite_skipped

    def _finite_inputs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Whether a batch's cached tensors hold only finite numbers, as a device flag (read at the next flush)."""
        floats = [v for v in batch.values() if v.is_floating_point()]
        return torch.stack([torch.isfinite(v).all() for v in floats]).all()

    def _flush(self) -> bool:
        """Read the pending steps' numbers back from the device in one transfer (one all-reduce across processes),
        check them, log them and update the bar; returns whether any process asked to stop.

        Between flushes nothing in the loop waits for the GPU, so the host queues the next steps while it computes.
        The next flush is set a whole number of steps ahead (``speed.sync_seconds`` at the measured step time, as
        the first process measured it), so all processes flush at the same steps."""
        metrics, result, bar, task, t0 = self._log
        pend, self._pending = self._pending, []
        now = time.time()
        t_last, step_last = self._last_flush
        per_step = (now - t_last) / max(1, self.step - step_last)
        every = (
            max(1, min(1000, int(self.cfg.speed.sync_seconds / max(per_step, 1e-6))))
            if self.cfg.speed.sync_seconds
            else 1
        )
        keys = ("loss", "grad_norm", "prior_loss", "inputs_finite")
        row = [(1.0 if k == "inputs_finite" else float("nan")) if pe[k] is None else pe[k] for pe in pend for k in keys]
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        flat = (
            torch.stack([torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(()) for x in row])
            if row
            else torch.zeros(0, dtype=torch.float64, device=dev)
        )
        stop_local = 1.0 if self._interrupt else 0.0
        extra = torch.tensor([stop_local, every if self.world.main else 0], dtype=torch.float64, device=dev)
        flat = torch.cat([flat, extra])
        if self.world.distributed:
            import torch.distributed as dist

            dist.all_reduce(flat)
        values = flat.tolist()
        stop, every = values[-2] > 0, int(values[-1])
        n = self.world.size
        self._flush_at, self._last_flush = self.step + every, (time.time(), self.step)
        self.flush_times[self.step] = self._last_flush[0]
        for i, pe in enumerate(pend):
            loss, gnorm, prior, inputs_ok = values[i * 4 : (i + 1) * 4]
            # the processes' scaled shares sum to the global batch's mean; the gradient norm is the same on each
            loss, prior, gnorm = loss / n, prior / n, gnorm / n
            # a step skip mode dropped is not checked; one the fp16 scaler skipped has an overflowing norm by design
            norm_ok = pe["grad_norm"] is None or math.isfinite(gnorm) or pe["step"] in self._scaler_skipped
            if pe["step"] not in self._skipped and not (math.isfinite(loss) and norm_ok):
                self._diverged(pe["step"], loss, gnorm, inputs_ok >= n)
            result.losses.append(loss)
            if pe["step"] % self.cfg.train.log_every == 0 or pe["step"] == self.total_steps:
                rec = {
                    "step": pe["step"],
                    "epoch": pe["epoch"],
                    "loss": loss,
                    "lr": float(pe["lr"]),  # torchao keeps lr as a tensor
                    "time": round(now - t0, 4),
                }
                if pe["grad_norm"] is not None:
                    rec["grad_norm"] = gnorm
                if pe["prior_loss"] is not None:
                    rec["prior_loss"] = prior
                if pe["step"] in self._skipped or pe["step"] in self._scaler_skipped:
                    rec["skipped"] = True
                if self.device.type == "cuda":
                    rec["gpu_peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
                metrics.log(rec)
        if pend:
            bar.update(task, completed=self.step, loss=result.losses[-1], mem=_peak_memory(self.device))
        return stop

    def _diverged(self, step: int, loss: float, gnorm: float, inputs_ok: bool, prefix: str = "") -> None:
        """Stop the run at a NaN/inf loss or gradient norm: the step, the likely cause, the last good checkpoint."""
        t = self.cfg.train
        what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {gnorm}"
        if not inputs_ok:
            cause = (
                "that step's batch holds NaN/inf in its cached latents or text embeddings: a damaged or stale cache, "
                "or latents encoded by a VAE in fp16 (SDXL's overflows)"
            )
            fix = "Run `difftrain precompute` again (precompute.vae_dtype fp32 or bf16) into a fresh data.cache_dir."
        elif t.mixed_precision == "fp16" or self.cfg.memory.weights.kind == "fp16":
            cause = "fp16 overflowed (its largest number is 65504)"
            fix = "Use train.mixed_precision bf16 with memory.weights bf16."
        else:
            cause = f"the learning rate ({t.learning_rate:g}) may be too high for this run"
            fix = (
                "Lower train.learning_rate"
                + ("" if t.max_grad_norm else " or set train.max_grad_norm (e.g. 1.0)")
                + "; train.nonfinite: skip drops such steps instead of stopping."
            )
        good = [c for c in ckpt.list_checkpoints(self.out) if int(c.name.rsplit("-", 1)[-1]) < step]
        where = (
            f"The last good checkpoint is {good[-1]} (--resume it)." if good else "No checkpoint was saved before it."
        )
        raise LossNotFinite(f"{prefix}At step {step} {what}: {cause}. {where}", hint=fix)

    @contextmanager
    def _ctrl_c(self):
        """The first Ctrl+C (SIGINT) asks the loop to stop after the step under way, with a checkpoint: a save
        in progress completes first. A second one stops at once (the last complete checkpoint stays)."""
        import signal
        import threading

        self._interrupt = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            self._interrupt = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if self.world.main:
                warn(
                    "Ctrl+C: stopping after this step with a checkpoint (press it again to stop at once, "
                    "without saving)"
                )

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _stop_now(self, result: TrainResult) -> None:
        saved = ckpt.checkpoint_dir(self.out, self.step)
        if not saved.exists():
            saved = self.save_checkpoint()
        raise Interrupted(
            f"Interrupted at step {self.step} of {self.total_steps}: the training state is saved in {saved}.",
            hint="Continue with the same command plus --resume latest.",
        )

    def _finish(self, result: TrainResult, stats: dict, t0: float) -> TrainResult:
        t = self.cfg.train
        self._check_replicas()
        stats["peak_rss_gib_train"] = round(_rss_peak_gib(), 3)
        if self.device.type == "cuda":
            stats["gpu_peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            stats["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(self.device) / 2**30, 3)
        t_save = time.time()
        # a final training state: always for LoRA (small); for a full fine-tune (weights plus
        # optimizer state, several times the model) only when checkpoints were asked for
        wants_final = t.method == "lora" or t.checkpoint_every
        if wants_final and (not t.checkpoint_every or self.step % t.checkpoint_every):
            result.checkpoints.append(self.save_checkpoint())
        if t.method == "lora":
            result.lora_path = self.export(self.out / LORA_FILE)
        elif self.cfg.save.formats:
            result.saved += self.export_model(None)
        stats["save_seconds"] = round(time.time() - t_save, 2)
        stats["peak_rss_gib_end"] = round(_rss_peak_gib(), 3)
        result.seconds = time.time() - t0
        name = "stats.json" if self.world.main else f"stats.rank{self.world.rank}.json"  # every process's memory
        # a resumed run keeps what the earlier part measured and this part did not (s/step of no steps)
        stats = {**read_json_object(self.out / name), **stats}
        result.stats = stats
        atomic_write_text(self.out / name, json.dumps(stats, indent=1) + "\n")
        return result

    def _validate(self, tag: str, stats: dict, metrics, result: TrainResult) -> None:
        """A validation round: the held-out loss (into metrics.jsonl and the result) and the samples.
        GPU memory before the first round and the peak with them go into stats (the memory report
        cogvideox-factory publishes: after load, before validation, with validation, end)."""
        v = self.cfg.validation
        if not (v.prompts or self.val_items):
            return
        if not self.world.main:  # the other processes wait for it at their next collective
            return
        t_val = time.time()
        if self.device.type == "cuda":
            stats.setdefault(
                "gpu_peak_alloc_gib_before_validation", round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            )
        if self.val_items:
            val = self.validation_loss()
            result.val_losses.append((self.step, val))
            metrics.log({"step": self.step, "val_loss": val})
            info(f"validation loss at step {self.step}: {val:.5f} ({len(self.val_items)} held-out items)")
        if v.prompts:
            from .validation import validate

            self.samples = getattr(self, "samples", []) + validate(self, tag)
        if self.device.type == "cuda":
            stats["gpu_peak_alloc_gib_with_validation"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            stats["gpu_alloc_gib_after_validation"] = round(
                torch.cuda.memory_allocated(self.device) / 2**30, 3
            )  # freed again?
        self._val_seconds += time.time() - t_val

    def _micro_step(
        self, batch: dict[str, torch.Tensor], prior: list[dict] | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Loss and backward of one micro-batch; (its loss, its prior loss) as device tensors, read at the flush."""
        t = self.cfg.train
        prior_value = 0.0
        if prior is not None and self.wrapped:
            # DDP takes one forward per backward: instance and class images in one batch (one bucket), split after
            pb = self._batch([], prior)
            both = {k: torch.cat([batch[k], pb[k]]) for k in batch}
            n = batch["latents"].shape[0]
            per = self._loss(both, per_sample=True)
            prior_loss = per[n:].mean()
            prior_value = prior_loss.detach() / t.grad_accum
            loss = per[:n].mean() + self.cfg.dreambooth.prior_loss_weight * prior_loss
        else:
            loss = self._loss(batch)
            if prior is not None:
                # as diffusers' DreamBooth scripts: instance loss + prior_loss_weight * class loss
                prior_loss = self._loss(self._batch([], prior))
                prior_value = prior_loss.detach() / t.grad_accum
                loss = loss + self.cfg.dreambooth.prior_loss_weight * prior_loss
        loss = loss / t.grad_accum
        if scale != 1.0:
            loss = loss * scale
        value = loss.detach()  # scaled: its mean over the processes is the global batch's loss (read at the flush)
        if self.engine is not None:  # DeepSpeed accumulates, clips and steps at its boundary
            self.engine.backward(loss, scale_wrt_gas=False)
            self.engine.step()
        else:
            self.scaler.scale(loss).backward()
        if self.block_swap is not None:
            self.block_swap.end_backward()
        return value, prior_value * scale  # both weighted alike: their means over the processes are the global ones

    def _no_sync(self):
        """DDP's no_sync on every wrapper: micro-batches before the last of an accumulation keep their gradients local."""
        stack = contextlib.ExitStack()
        for w in self.wrapped.values():
            stack.enter_context(w.no_sync())
        return stack

    def _optimizer_step(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Clip, step, schedule; returns the gradient norm (a device tensor) where one was computed."""
        t = self.cfg.train
        if self.engine is not None:  # the engine stepped in engine.step()
            self.lr_scheduler.step()
            self.step += 1
            return None
        fp16 = self.scaler.is_enabled()
        skip_mode = t.nonfinite == "skip" and not fp16  # the fp16 scaler skips overflowing steps itself
        norm = None
        if t.max_grad_norm or skip_mode:
            self.scaler.unscale_(self.optimizer)
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = (
                torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)
                if t.max_grad_norm
                else torch.nn.utils.get_total_norm(grads)
            )
        if skip_mode and not bool(torch.isfinite(norm + loss)):  # the one host sync skip mode costs a step
            self._skip_step(float(loss), float(norm))
        else:
            self._skipped_run = 0
            before = self.scaler.get_scale() if fp16 else None
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if fp16 and self.scaler.get_scale() < before:
                self.fp16_skipped += 1
                self._scaler_skipped.add(self.step + 1)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def _skip_step(self, loss: float, norm: float) -> None:
        """train.nonfinite skip: this step's update is dropped (weights and optimizer state unchanged)."""
        self.nonfinite_skipped += 1
        self._skipped_run = getattr(self, "_skipped_run", 0) + 1
        self._skipped.add(self.step + 1)
        warn(
            f"step {self.step + 1}: loss {loss}, gradient norm {norm}: the update is skipped "
            f"({self.nonfinite_skipped} so far)"
        )
        if self._skipped_run >= 5:
            self._flush()  # the steps before it into the log
            self._diverged(
                self.step + 1, loss, norm, bool(self._inputs_finite), f"{self._skipped_run} steps in a row: "
            )

    # ---------------------------------------------------------------- state
    def _layers(self) -> dict[str, dict[str, torch.Tensor]]:
        from ..memory.deepspeed_engine import gathered

        with gathered(self.engine, self.params):  # ZeRO-3 partitions the LoRA weights too
            return {
                part: {n: t.detach().clone() for n, t in export_layers(m).items()} for part, m in self.trained.items()
            }

    def _lora_layers(self, use_ema: bool) -> dict[str, dict[str, torch.Tensor]]:
        """The LoRA weights to write: the trained ones, or the EMA's (copied out while swapped in)."""
        if not use_ema:
            return self._layers()
        with self._ema_swapped():
            return {k: {n: t.clone() for n, t in v.items()} for k, v in self._layers().items()}

    def _save_lora(self, folder: Path, use_ema: bool = False, layers: dict | None = None) -> None:
        meta = {part: adapter_metadata(m) for part, m in self.trained.items()}
        self.family.save_lora(
            folder, layers if layers is not None and not use_ema else self._lora_layers(use_ema), meta
        )

    @contextmanager
    def _ema_swapped(self):
        """Temporarily put the EMA weights into the (small, LoRA) trainable parameters."""
        backup = {n: p.detach().clone() for n, p in self.ema.params.items()}
        with torch.no_grad():
            for n, p in self.ema.params.items():
                p.copy_(self.ema.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.ema.params.items():
                    p.copy_(backup[n])

    def _use_ema_for_export(self) -> bool:
        return self.ema is not None and self.cfg.ema.export

    def export_model(self, tag: str | None) -> list[Path]:
        """Write the fine-tuned model in save.formats at save.precision (EMA weights if asked).

        Parts that training did not load (the VAE, frozen text encoders) are read
        from the base model for the export and freed after it.
        """
        sv, fam = self.cfg.save, self.family
        if not sv.formats:  # nothing to write: the VAE and text encoders are not loaded for it either
            return []
        if not self.world.main:
            from ..memory.deepspeed_engine import gathered

            for m in self.trained.values():  # ZeRO-3's gathers are collective: take part, write nothing
                if self.engine is not None:
                    with gathered(self.engine, list(m.parameters())):
                        pass
            return []
        dest = self.out if tag is None else self.out / "saved" / tag
        dtype = to_dtype(sv.precision)
        parts = (fam.denoiser, fam.image_encoder, *fam.text_encoders)
        missing = [p for p in parts if p not in self.comps]
        extra = fam.load(self.cfg.model, missing, dtype=dtype, device="cpu") if missing else {}
        modules = {p: self.comps.get(p, extra.get(p)) for p in parts}
        sds = {}
        from ..memory.deepspeed_engine import gathered

        for part, m in modules.items():
            if self.engine is not None and part in self.trained:
                with gathered(self.engine, list(m.parameters())):
                    sd = {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}
            else:
                sd = m.state_dict()
            if part in self.trained and self._use_ema_for_export():
                sd.update({n[len(part) + 1 :]: t for n, t in self.ema.shadow.items() if n.startswith(part + ".")})
            sds[part] = sd
        configs = fam.module_configs(modules)
        out = []
        if "single_file" in sv.formats:
            out.append(fam.save_single_file(sds, configs, dest / "model.safetensors", dtype=dtype))
        if "diffusers" in sv.formats:
            out.append(fam.save_diffusers(sds, configs, dest / "diffusers", self.cfg.model, dtype=dtype))
        del extra, sds
        info(f"saved {', '.join(str(p) for p in out)}")
        return out

    def export(self, path: Path) -> Path:
        """Write the LoRA as pytorch_lora_weights.safetensors (diffusers layout), atomically (the first process)."""
        if not self.world.main:
            if self.engine is not None:
                self._layers()  # ZeRO-3's gathers are collective: take part, write nothing
            return path
        from . import lora_files

        kinds = lora_files.formats(self.cfg, self.family)
        path.parent.mkdir(parents=True, exist_ok=True)
        layers = self._lora_layers(self._use_ema_for_export())
        meta = {part: adapter_metadata(m) for part, m in self.trained.items()}
        if "kohya" in kinds:  # first: a layer the kohya names cannot express stops before any file is replaced
            lora_files.write_kohya(path.parent / lora_files.KOHYA_FILE, self.cfg, self.family, layers, meta)
        if "diffusers" in kinds:
            with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as tmp:
                self.family.save_lora(Path(tmp), layers, meta)
                lora_files.add_metadata(Path(tmp) / LORA_FILE, lora_files.metadata(self.cfg, self.family, meta))
                os.replace(Path(tmp) / LORA_FILE, path)  # same folder, so the rename is atomic
        return path if "diffusers" in kinds else path.parent / lora_files.KOHYA_FILE

    def save_checkpoint(self) -> Path:
        """:meth:`_save_checkpoint`, with a full disk said as such: the folder being written is removed (by
        the atomic write) and the previous checkpoint, untouched, is named."""
        import errno

        try:
            return self._save_checkpoint()
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            prev = ckpt.list_checkpoints(self.out)
            kept = f"the previous checkpoint {prev[-1]} is intact" if prev else "there is no earlier checkpoint"
            raise CheckpointError(
                f"The disk is full: the checkpoint of step {self.step} could not be written in {self.out / 'checkpoints'} "
                f"(nothing half-written was left); {kept}.",
                hint="Free some space (or set train.keep_checkpoints lower), then resume with --resume latest.",
            ) from None

    def _save_checkpoint(self) -> Path:
        """The training state, atomically. Several processes: each takes part in what is collective (ZeRO's
        gathers and its own checkpoint files), the first one writes the rest and renames the folder."""
        final = ckpt.checkpoint_dir(self.out, self.step)
        if not self.world.distributed:
            with atomic_dir(final) as tmp:
                self._write_state(tmp, write=True)
        else:
            import shutil

            from ..utils import commit_dir

            tmp = final.with_name(f".{final.name}.shared.tmp")  # one name every process can compute
            if self.world.main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist_.barrier(self.world)
            self._write_state(tmp, write=self.world.main)
            dist_.barrier(self.world)
            if self.world.main:
                commit_dir(tmp, final)
        if self.world.main:
            ckpt.prune(self.out, self.cfg.train.keep_checkpoints)
        dist_.barrier(self.world)
        return final

    def _write_state(self, tmp: Path, write: bool) -> None:
        from ..memory.deepspeed_engine import gathered

        with gathered(self.engine, self.params):
            weights = {
                f"{part}.{n}": p.detach().clone()
                for part, m in self.trained.items()
                for n, p in trainable_state(m).items()
            }
        if write:
            save_tree(weights, tmp, "trainable")
        if self.engine is not None:
            # DeepSpeed's partitioned optimizer state, in DeepSpeed's own format (torch pickles: resuming
            # from them needs --allow-pickle, as any pickle does); every process writes its own partition
            self.engine.save_checkpoint(
                str(tmp / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=True
            )
        elif write:
            save_tree(self.optimizer.state_dict(), tmp, "optimizer")
        layers = self._layers() if self.cfg.train.method == "lora" and self.engine is not None else None
        if not write:
            return
        rng = {
            "python": list(random.getstate()[1]),
            "python_version": random.getstate()[0],
            "python_gauss": random.getstate()[2],
            "torch": torch.get_rng_state(),
            "generator": self.gen.get_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        save_tree(rng, tmp, "rng")
        if self.ema is not None:
            save_tree(self.ema.state_dict(), tmp, "ema")
        # scheduler state may hold tensors (torchao keeps lr as one): a tree, not JSON
        save_tree({"lr_scheduler": self.lr_scheduler.state_dict(), "scaler": self.scaler.state_dict()}, tmp, "schedule")
        state = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_pos": self.batch_pos,
            "total_steps": self.total_steps,
            "global_batch": self.global_batch,
            "world_size": self.world.size,
        }
        if self._plan is not None and self._plan[0] == self.epoch:
            state["epoch_plan"] = self._plan[1]  # an epoch re-cut for another process count: its batches
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
        if self.config_yaml is not None:
            (tmp / "config.yaml").write_text(self.config_yaml, encoding="utf-8")
        if self.cfg.train.method == "lora":
            self._save_lora(tmp, use_ema=self._use_ema_for_export(), layers=layers)

    def _universal(self, folder: Path) -> str:
        """DeepSpeed's universal checkpoint of ``folder``'s ZeRO state (made once, by the first process, beside
        the original and renamed into place when complete), and the engine told to load that format: how a
        ZeRO run resumes on another number of GPUs."""
        import argparse
        import shutil

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
        self.engine._config.load_universal_checkpoint = True  # read by load_checkpoint; DeepSpeed has no setter
        return out.name

    def _load(self, folder: Path) -> None:
        """:meth:`_load_state`; a checkpoint whose files hold the wrong types or shapes (damaged, or crafted) is a
        CheckpointError naming it, not whatever the step that trips on it raises."""
        try:
            self._load_state(folder)
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

    def _load_state(self, folder: Path) -> None:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
        if not (
            isinstance(state, dict)
            and all(type(state.get(k)) is int and state[k] >= 0 for k in ("step", "epoch", "batch_pos"))
        ):
            raise ValueError("trainer_state.json lacks step, epoch or batch_pos as non-negative integers")
        weights = load_tree(folder, "trainable")
        for part, m in self.trained.items():
            own = trainable_state(m)
            sub = {n[len(part) + 1 :]: w for n, w in weights.items() if n.startswith(part + ".")}
            if set(sub) != set(own):
                raise CheckpointError(
                    f"The checkpoint {folder} was made with a different LoRA setup for {part} "
                    f"({len(sub)} tensors saved, {len(own)} expected).",
                    hint="Resume with the config saved in the checkpoint folder (config.yaml).",
                )
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n in sub:
                        p.copy_(sub[n])
        if self.engine is not None:
            if not self.cfg.model.allow_pickle:
                raise CheckpointError(
                    f"{folder} holds DeepSpeed's optimizer state, which DeepSpeed stores as torch pickles; "
                    "difftrain does not unpickle files unless told to.",
                    hint="If you trust this folder (difftrain wrote it), resume with --allow-pickle.",
                )
            tag = "state"
            if state.get("world_size", 1) != self.world.size:  # ZeRO's partitions were cut for another count
                tag = self._universal(folder)
            self.engine.load_checkpoint(
                str(folder / "deepspeed"),
                tag=tag,
                load_module_strict=False,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        else:
            self.optimizer.load_state_dict(load_tree(folder, "optimizer", device=self.device))
        if self.ema is not None:
            self.ema.load_state_dict(load_tree(folder, "ema"))
        schedule = load_tree(folder, "schedule")
        self.lr_scheduler.load_state_dict(schedule["lr_scheduler"])
        self.scaler.load_state_dict(schedule["scaler"])
        rng = load_tree(folder, "rng")
        random.setstate((rng["python_version"], tuple(rng["python"]), rng["python_gauss"]))
        torch.set_rng_state(rng["torch"])
        self.gen.set_state(rng["generator"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step, self.epoch, self.batch_pos = state["step"], state["epoch"], state["batch_pos"]
        old_global = state.get("global_batch", self.global_batch)
        plan = state.get("epoch_plan")
        if old_global != self.global_batch or plan is not None:
            # another process count (or batch size): the rest of this epoch's items, re-cut to the new global batch
            old = (
                plan
                if plan is not None
                else BucketBatchSampler(self._bucket_keys(), old_global, self.cfg.train.seed).epoch(self.epoch)
            )
            self._plan = (self.epoch, recut(old[self.batch_pos :], self._bucket_keys(), self.global_batch))
            self.batch_pos = 0
            info(
                f"the global batch changed from {old_global} to {self.global_batch}: the rest of epoch {self.epoch} "
                f"({sum(map(len, self._plan[1]))} items) is re-cut into {len(self._plan[1])} batches"
            )
        info(f"resumed from {folder} at step {self.step} (epoch {self.epoch}, batch {self.batch_pos})")


def recut(batches: list[list[int]], keys: list, size: int) -> list[list[int]]:
    """The items of ``batches`` (in order) cut into batches of ``size`` within each bucket: every item once,
    buckets in the order they first appear. How an epoch continues when the global batch changes."""
    order: dict = {}
    for b in batches:
        for i in b:
            order.setdefault(keys[i], []).append(i)
    return [items[j : j + size] for items in order.values() for j in range(0, len(items), size)]


class _EngineView:
    """The DeepSpeed engine as the family sees the denoiser: calls run through the engine, attribute reads
    go to the model (the engine has a ``config`` of its own: DeepSpeed's, not the transformer's)."""

    def __init__(self, engine, module) -> None:
        self._engine, self._module = engine, module

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class _NoSinks:
    """The metric sinks of processes other than the first: they log nothing."""

    def log(self, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _DDP(DistributedDataParallel):
    """DDP whose attribute reads fall through to the wrapped module (family code reads ``.config``)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def train(
    cfg: Config, resume: str | None = None, config_yaml: str | None = None, stop_at: int | None = None
) -> TrainResult:
    return Trainer(cfg, config_yaml).run(resume, stop_at=stop_at)
