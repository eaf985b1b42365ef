"""difftrain bench memory / speed: a config's peak memory and step speed on random data of the real shapes.

The model is a random-weight copy of the bundled architecture (or the
config's own model), the cache holds random latents and embeddings of the
shapes precompute would write at the config's resolution, and the config
trains for a few steps. Reported beside the planner's prediction, so a user
can check a recipe on their own GPU before preparing any data.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config.load import validate
from ..config.schema import Config, SpeedConfig
from ..config.schema.memory import ActNone
from ..console import warn
from ..data.cache import DataCache
from ..data.index import CacheIndex, IndexItem
from ..errors import UsageError
from ..families.registry import get_family
from ..families.tokenizers import tiny_clip_vocab
from ..memory import checkpoint_policy
from ..memory.card import Overhead, allocator_budget, measure_overhead
from ..memory.planner import Estimate
from ..planning.estimate import plan_memory
from ..planning.parts import plan_parts
from ..speed.measure import peak_matmul_tflops
from ..speed.regional_compile import recompile_limit_hits
from ..trainers.loop import Hooks, Trainer
from ..trainers.profile import LAUNCH_KEYS, StepProfiler, python_wanted
from ..utils import free_memory, pick_device


@dataclass
class CardFit:
    """A run under the allocator cap a card of ``card_gib`` leaves (``bench memory --card``)."""

    card_gib: float
    overhead: Overhead  # measured on this GPU before the run
    budget_gib: float  # what torch's allocator was allowed to reserve
    planned_card_gib: float  # the planner's total on the card: reserved + context + libraries + display
    fits: bool
    headroom_gib: float | None = None  # the budget less the reserved peak, when it fits
    error: str | None = None  # the out-of-memory message, when it does not
    cut: str | None = None  # the planner's largest GPU term, when it does not


@dataclass
class BenchResult:
    peak_after_load_gib: float | None
    peak_train_alloc_gib: float | None
    peak_train_reserved_gib: float | None
    s_per_step: float | None  # None: the run did not finish (a card it does not fit)
    planned_alloc_gib: float
    planned_reserved_gib: float
    stats: dict = field(default_factory=dict)
    card: CardFit | None = None
    planned_host_gib: float | None = None  # the planner's host RAM (compare with stats' peak RSS)
    speed: str | None = None  # what speed auto chose, and why (SpeedChoice.line)
    warmup: int = 0  # the steps before s_per_step's (compiling and CUDA graph recording fall in them)


def synthetic_tokenizers(folder: Path) -> Path:
    """Offline stand-ins for the CLIP tokenizers a single file lacks (ids fit any CLIP vocabulary)."""
    if not (folder / "tokenizer_2").exists():
        tiny_clip_vocab(folder / "tokenizer")
        tiny_clip_vocab(folder / "tokenizer_2", pad_token="!")
    return folder


def _architecture(cfg: Config) -> str:
    assert cfg.model.config is not None, "the config's validator names the family's default architecture"
    return cfg.model.config


def synthetic_cache(
    cfg: Config,
    root: Path,
    n: int = 4,
    size: tuple[int, int] | None = None,
    buckets: list[tuple[int, int]] | None = None,
) -> Path:
    """``size`` (height, width): a non-square shape (CogVideoX's 480x720); default the square resolution.
    ``buckets`` (image families): ``n`` items of each (height, width), which the sampler draws in random order
    as it does a real dataset's aspect buckets."""
    family = get_family(cfg.family)
    video = {"frames": cfg.data.frames} if family.video else {}
    if size is not None and not family.video:  # an image family: one bucket of that shape
        if buckets:
            raise UsageError("--size and --buckets both give the image shape", hint="Give one of them.")
        buckets, size = [size], None
    # a (height, width) size is given only for the video families, whose cache_shapes take one
    shapes = family.cache_shapes(_architecture(cfg), size or cfg.data.resolution, **video)  # type: ignore[arg-type]
    if buckets and family.video:
        raise UsageError("--buckets is for the image families; a video's size is --size HxW")
    cache = DataCache(root)
    g = torch.Generator().manual_seed(0)
    items = []
    side = cfg.data.resolution
    sizes = [b for b in buckets for _ in range(n)] if buckets else [(side, side)] * n
    factor = side // shapes["latent"]["latents"][-1]  # the VAE's spatial factor (8; Qwen-Image 2.1's 16)
    for i, (h, w) in enumerate(sizes):
        lat_shapes = dict(shapes["latent"])
        if buckets:
            for k in ("latents", "reference_latents"):  # the edit families' references are fitted to the bucket
                if k in lat_shapes:
                    lat_shapes[k] = (*lat_shapes[k][:-2], h // factor, w // factor)
        lat = {
            k: torch.zeros(v, dtype=torch.int64) if k == "crop" else torch.randn(v, generator=g)
            for k, v in lat_shapes.items()
        }
        cache.put(f"lat{i}", lat)
        texts = {}
        for stage in family.enabled_stages(cfg.text_encoders):
            cache.put(f"{stage}{i}", family.synthetic_text(stage, shapes[stage], lat_shapes["latents"], g))
            texts[stage] = f"{stage}{i}"
        items.append(
            IndexItem(
                key=f"img{i}",
                image=f"img{i}.png",
                caption=f"a photo of a cat, number {i}",
                bucket=(w, h),
                original_size=(h, w),
                latent=f"lat{i}",
                texts=texts,
            )
        )
    cache.flush()
    cache.write_json("index.json", CacheIndex(items, family=family.name).to_json())
    return root


def _prepare(
    cfg: Config,
    work: Path,
    steps: int,
    size: tuple[int, int] | None,
    run: str = "run",
    buckets: list[tuple[int, int]] | None = None,
) -> Config:
    """The config on a random-weight model of its architecture and a random cache of its shapes, for ``steps``."""
    family = get_family(cfg.family)
    device = pick_device(cfg.train.device)
    update: dict = {}
    if cfg.model.path is None:
        parts = plan_parts(cfg, family)[0]  # only what training loads (SD3's T5 alone is 4.7 B parameters)
        path = work / f"random-{cfg.model.config}-{'-'.join(parts)}.safetensors"
        if not path.exists():
            family.build_random(_architecture(cfg), path, device=device, parts=parts)
            free_memory(device)  # built on the GPU: its blocks go back before anything is measured
        tok = synthetic_tokenizers(work / "tokenizers")
        update["model"] = cfg.model.model_copy(update={"path": path, "tokenizer_path": tok})
    tag = f"{size[0]}x{size[1]}" if size else str(cfg.data.resolution)
    if buckets:
        tag = "buckets-" + "-".join(f"{h}x{w}" for h, w in buckets)
    cache_dir = synthetic_cache(
        cfg, work / f"cache-{tag}-{cfg.data.frames}", size=size, buckets=buckets, n=2 if buckets else 4
    )
    update["data"] = cfg.data.model_copy(update={"cache_dir": cache_dir})
    update["train"] = cfg.train.model_copy(
        update={"max_steps": steps, "output_dir": work / run, "checkpoint_every": None, "device": str(device)}
    )
    update["save"] = cfg.save.model_copy(update={"formats": [], "every_n_epochs": None, "every_n_steps": None})
    return cfg.model_copy(update=update)


def bench_memory(
    cfg: Config,
    work: Path,
    steps: int = 6,
    size: tuple[int, int] | None = None,
    card_gib: float | None = None,
    planned_steps: int | None = None,
    buckets: list[tuple[int, int]] | None = None,
    warmup: int | None = None,
) -> BenchResult:
    """Train ``cfg`` for ``steps`` on random data of its shapes; with ``card_gib``, under the allocator cap such a
    card leaves (the context and libraries measured on this GPU now, and the display margin, taken off). The step
    time is the mean of the steps after ``warmup`` (default: two, or none of a single step)."""
    warm = min(2, steps - 1) if warmup is None else warmup
    if warm < 0:  # the CLI's own check (min=0) stops this first; a caller of this function gets the same words
        raise UsageError(
            f"--warmup {warm}: the warm-up is a number of steps, 0 or more.",
            hint="Train more steps than the warm-up, e.g. --steps 8 --warmup 0.",
        )
    if warm >= steps:
        raise UsageError(
            f"--warmup {warm} leaves no timed step of --steps {steps}.",
            hint=f"Train more steps than the warm-up, e.g. --steps {warm + 8} --warmup {warm}.",
        )
    work = Path(work)
    device = pick_device(cfg.train.device)
    run_cfg = _prepare(cfg, work, steps, size, buckets=buckets)
    plan = plan_memory(run_cfg)
    card = None
    if card_gib is not None:
        if device.type != "cuda":
            raise UsageError(
                "--card caps a CUDA GPU's allocator as the card would leave it; this run has no CUDA GPU.",
                hint="Run it on a GPU, or use `difftrain plan --vram` for the prediction alone.",
            )
        overhead = measure_overhead(device)
        budget = allocator_budget(card_gib, overhead)
        card = CardFit(card_gib, overhead, round(budget, 3), round(plan.card_total, 2), fits=True)
        run_cfg = run_cfg.model_copy(
            update={"train": run_cfg.train.model_copy(update={"gpu_memory_limit_gib": max(budget, 0.01)})}
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # the GPU is waited for at the end of the warm-up and at the last step
    trainer = Trainer(run_cfg, hooks=Hooks(flush_steps={warm} if warm > 0 else set(), planned_steps=planned_steps))
    try:
        result = trainer.run(overwrite=True)  # its own scratch folder
    except torch.OutOfMemoryError as e:
        if card is None:
            raise
        return _no_fit(card, plan, device, str(e))
    times = trainer.flush_times
    per_step = [(times[steps] - times[warm]) / (steps - warm)] if warm > 0 else [result.seconds / max(1, steps)]
    s = result.stats
    if card is not None:
        card.headroom_gib = round(card.budget_gib - (s.get("gpu_peak_reserved_gib") or 0.0), 3)
    return BenchResult(
        peak_after_load_gib=s.get("gpu_alloc_gib_after_load"),
        peak_train_alloc_gib=s.get("gpu_peak_alloc_gib"),
        peak_train_reserved_gib=s.get("gpu_peak_reserved_gib"),
        s_per_step=round(per_step[0], 3),
        planned_alloc_gib=round(plan.gpu_total, 2),
        planned_reserved_gib=round(plan.gpu_reserved, 2),
        stats=s,
        card=card,
        planned_host_gib=round(plan.host_total, 2),
        speed=trainer.speed.line(),
        warmup=warm,
    )


def _no_fit(card: CardFit, plan: Estimate, device: torch.device, error: str) -> BenchResult:
    """The result of a run the card's cap stopped: the peaks it reached and the term to cut first."""
    card.fits = False
    card.error = error.splitlines()[0] if error else "out of memory"
    card.cut = largest_term(plan)
    gib = lambda v: round(v / 2**30, 3)
    return BenchResult(
        peak_after_load_gib=None,
        peak_train_alloc_gib=gib(torch.cuda.max_memory_allocated(device)),
        peak_train_reserved_gib=gib(torch.cuda.max_memory_reserved(device)),
        s_per_step=None,
        planned_alloc_gib=round(plan.gpu_total, 2),
        planned_reserved_gib=round(plan.gpu_reserved, 2),
        card=card,
        planned_host_gib=round(plan.host_total, 2),
    )


def largest_term(plan: Estimate) -> str:
    """What to cut first on a card a run does not fit: the planner's largest GPU term, with the technique that
    shrinks it."""
    name, gib = max(plan.gpu.items(), key=lambda kv: kv[1])
    how = {
        "weights": "memory.weights {kind: fp8} or memory.offload {kind: block_swap}",
        "activations": "memory.activations {kind: checkpoint}, a lower data.resolution or train.batch_size",
        "optimizer state": "memory.optimizer {kind: adamw8bit} or {kind: cpu_offload}",
        "gradients": "memory.fused_backward or memory.optimizer {kind: cpu_offload, offload_gradients: true}",
        "EMA": "ema.device: cpu",
    }.get(name, "`difftrain plan --vram` for a plan that fits")
    return f"{name} ({gib:.2f} GiB planned): {how}"


# ------------------------------------------------------------------ speed
EAGER = SpeedConfig(  # the diffusers scripts' way
    compile=False,
    cuda_graphs=False,
    sync_seconds=0,
    pin_memory=False,
    optimizer_kernels="foreach",
    geglu="torch",
    channels_last=False,
    lora_kernel="peft",
)


def baseline_config(base: Config, speed_keys: set[str]) -> Config:
    """The baseline of ``bench speed``: ``base`` with the speed section of the eager diffusers-script way (EAGER),
    except the speed options named in ``speed_keys`` (from ``--baseline-set speed.X=...``), which keep ``base``'s
    values - so float8 can be timed against a compiled bf16 run, or max-autotune against compile's default."""
    from pydantic import ValidationError

    from ..config.load import validation_problems
    from ..errors import ConfigError

    speed = {**EAGER.model_dump(), **{k: getattr(base.speed, k) for k in speed_keys}}
    try:
        return validate({**base.model_dump(), "speed": speed})  # the whole config checked again
    except ValidationError as e:
        raise ConfigError(
            "The baseline's configuration (the config with --baseline-set, speed options not named there "
            "off) has problems:",
            validation_problems(e),
            hint="Name the speed options the baseline needs with --baseline-set too, e.g. "
            "--baseline-set speed.compile=true.",
        ) from None


@dataclass
class SpeedRow:
    name: str
    s_per_step: float
    samples_per_s: float
    first_step_s: float  # set-up of the loop to the end of step 1: compiling, when compiled
    warmup_overhead_s: float  # the warm-up steps' time beyond as many timed steps: compile and autotuning
    peak_alloc_gib: float | None
    peak_reserved_gib: float | None = None
    profile: dict | None = None
    compile: dict | None = None  # torch's own compile-time phases (s) and graph count, compiled runs only
    tflops: float | None = None
    mfu: float | None = None
    speed: str = ""  # what speed auto chose, and why
    step_s: list[float] | None = None  # every step's seconds (bench speed --step-times)


def _timed_run(
    cfg: Config,
    warmup: int,
    profile: Path | None = None,
    planned_steps: int | None = None,
    step_times: bool = False,
) -> tuple[Trainer, dict[int, float], dict]:
    """Train; with ``profile``, two steps run after the timed ones (the profiler's warm-up and the profiled step, the
    GPU synchronised at their edges so the profiled step holds its own kernels only) and its summary comes back.
    ``step_times``: the numbers are read back (the GPU waited for) after every step, not only at 1 and ``warmup``."""
    end = cfg.train.max_steps
    assert end is not None, "a benchmark trains a set number of steps"
    flush = set(range(1, end + 1)) if step_times else {1, warmup}
    hooks = Hooks(flush_steps=flush, planned_steps=planned_steps)  # read back (the GPU waited for) exactly here
    trainer = Trainer(cfg, hooks=hooks)
    if profile is None:
        trainer.run(overwrite=True)
        return trainer, trainer.flush_times, {}
    timed = end - 2
    hooks.flush_steps |= {timed, end - 1}
    if python_wanted():  # DIFFTRAIN_PROFILE_PYTHON=1: the profiled step under cProfile (the host's own time)
        sp = StepProfiler(profile.parent, end, rank=0)
        hooks.after_step = sp.after_step
        trainer.run(overwrite=True)
        profile.write_text((profile.parent / "profile.rank0.txt").read_text())
        times = trainer.flush_times
        return trainer, times, {"python": True, "step_ms": round((times[end] - times[end - 1]) * 1e3, 1)}
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # repeat=1: one cycle, so the table read after the block is the profiled step's, whatever follows it
    with torch_profile(activities=acts, schedule=schedule(wait=timed, warmup=1, active=1, repeat=1)) as prof:

        def hook() -> None:
            if trainer.pos.step >= timed and torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.step()

        hooks.after_step = hook
        trainer.run(overwrite=True)
    times = trainer.flush_times
    return trainer, times, {**_profile_summary(prof, profile), "step_ms": round((times[end] - times[end - 1]) * 1e3, 1)}


# What a kernel's name says it does. cuDNN/cuBLAS/CUTLASS names on Hopper: convolutions carry fprop/dgrad/wgrad
# (implicit GEMMs), attention flash/fmha/sdpa, dense matmuls gemm/nvjet; inductor's fused kernels are triton_poi
# (pointwise), triton_red/per (reductions: norms, sums), triton_tem (its own matmul/convolution templates).
# Inductor's own kernels first: their names also list the aten ops they fused (e.g. convolution_backward).
KERNEL_KINDS = (
    ("fused pointwise (inductor)", ("triton_poi",)),
    ("fused reductions, norms (inductor)", ("triton_red", "triton_per")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn", "dot_do_o", "convert_dq")),  # + cuDNN's bwd helpers
    ("layout transposes", ("nchwtonhwc", "nhwctonchw")),  # cuDNN turning NCHW tensors channels-last and back
    ("convolution", ("fprop", "dgrad", "wgrad", "conv", "implicit_gemm", "winograd", "triton_tem_fused_convolution")),
    ("matmul", ("gemm", "nvjet", "cublas", "cutlass", "triton_tem", "xmma", "matmul", "splitkreduce")),
    ("optimizer", ("multi_tensor", "foreach", "adam", "fused_sgd", "koptimizer")),  # + bitsandbytes' kOptimizer*
    ("norms (aten)", ("group_norm", "layer_norm", "groupnorm", "layernorm", "rms_norm", "rowwisemoments")),
    ("copies, memset", ("memcpy", "memset", "copy_kernel", "cat_", "catarray")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(m in low for m in marks):
            return kind
    return "other (aten elementwise, reductions)"


def kernel_breakdown(kernels: list[tuple[str, float, int]]) -> dict[str, dict]:
    """(kernel name, GPU microseconds, count) rows -> per kind: ms, share of the GPU time, kernel count."""
    total = sum(us for _, us, _ in kernels) or 1.0
    out: dict[str, dict] = {}
    for name, us, n in kernels:
        d = out.setdefault(kernel_kind(name), {"ms": 0.0, "share": 0.0, "kernels": 0})
        d["ms"] += us / 1e3
        d["kernels"] += n
    for d in out.values():
        d["share"] = round(d["ms"] * 1e3 / total, 4)
        d["ms"] = round(d["ms"], 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def kinds_line(by_kind: dict[str, dict]) -> str:
    """One line of a breakdown: "matmul 103.4 ms (38%), attention ..." (bench speed's output, benchmarks/speed.py)."""
    return ", ".join(f"{k} {v['ms']:.1f} ms ({v['share']:.0%})" for k, v in by_kind.items())


def _profile_summary(prof, path: Path) -> dict:
    """GPU time and launches of the profiled step: how much of the step the GPU computed, and on what."""
    ev = prof.key_averages()
    text = ev.table(sort_by="self_cpu_time_total", row_limit=40)  # where the host's time goes
    if torch.cuda.is_available():
        text = ev.table(sort_by="self_device_time_total", row_limit=40) + "\n\nBy host time:\n" + text
    path.write_text(text)
    kernels = sum(e.count for e in ev if e.key in LAUNCH_KEYS)
    graph_launches = sum(e.count for e in ev if e.key in ("cudaGraphLaunch", "cuGraphLaunch"))
    from torch.autograd import DeviceType

    # the kernels' own rows only: an operator's row repeats the time of the kernels it launched
    # (not the step's and compiled graphs' GPU-side annotations, "ProfilerStep#n" and "## Call CompiledFxGraph ...")
    rows = [
        (e.key, e.self_device_time_total, e.count)
        for e in ev
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and not e.key.startswith(("ProfilerStep", "## "))
    ]
    gpu_us = sum(us for _, us, _ in rows)
    return {
        "cpu_ms": round(sum(e.self_cpu_time_total for e in ev) / 1e3, 2),
        "kernel_launches": kernels,
        "graph_launches": graph_launches,
        "gpu_ms": round(gpu_us / 1e3, 2),
        "gpu_kernels": sum(n for _, _, n in rows),
        "by_kind": kernel_breakdown(rows),
    }


def _compile_totals() -> tuple[dict[str, float], int]:
    """torch's compile timers so far in this process (dynamo's ``compile_times``, every phase) and its graph count."""
    import torch._dynamo.utils as dyn

    try:
        names, values = dyn.compile_times(repr="csv", aggregate=True)
        totals = {n: float(str(v)) for n, v in zip(names, values)}
    except Exception:  # noqa: BLE001 - a private torch API: report nothing rather than fail the benchmark
        totals = {}
    return totals, int(dyn.counters["stats"].get("unique_graphs", 0))


def compile_phases(top: int = 8, since: tuple[dict[str, float], int] | None = None) -> dict:
    """Where compiling went, from torch's own timers: the slowest phases in seconds and the number of distinct
    graphs, counted from ``since`` (a ``_compile_totals()`` taken before the run; the timers are process-wide, so
    a compiled baseline would otherwise count in the next run). Phases nest (tracing and inductor's codegen sit
    inside ``_compile.compile_inner``), so they do not add up."""
    (before, graphs0), (now, graphs) = since or ({}, 0), _compile_totals()
    phases = sorted(((n, v - before.get(n, 0.0)) for n, v in now.items()), key=lambda kv: -kv[1])[:top]
    return {"phases_s": {n: round(v, 2) for n, v in phases}, "graphs": graphs - graphs0}


#: count a step's FLOPs on fake tensors first (torch's FakeTensorMode: shapes only, no memory); tests of the real
#: count's memory handling switch it off
FAKE_COUNT = True


def step_flops(trainer: Trainer) -> tuple[float, bool] | None:
    """Model FLOPs of one optimizer step (forward and backward, as torch.utils.flop_counter counts them), with
    gradient checkpointing switched off so recomputed forwards are not counted: second value True.

    The step runs on fake tensors (torch's FakeTensorMode over the trainer's own modules: every op's output shape
    and no memory, so a step without checkpoints is counted at any size); where some op cannot run on them (data-
    dependent code, a kernel without a fake implementation) it runs for real. Where checkpointing cannot be switched
    off, the step is counted with it and the recomputed forwards are taken off (second value False: an estimate): a
    no-grad forward's count times the share of it recomputed (1/every of the blocks, twice with
    memory.activations.split's segments), the blocks being nearly all of a denoiser's forward. That is where a
    compiled trainer's checkpointing sits inside its blocks (speed.checkpoint_inside), and, counted for real, where a
    step without checkpoints would not fit the GPU (the planner's figure for it, checked before trying, as running
    out of memory on a GPU is not always given back: Wan 14B's count after a failed try ran out of memory again with
    138 GiB held, H200, 2026-11-28). A compiled trainer is counted with its compiled blocks run eagerly (the counter
    cannot see inside compiled graphs). None where even the checkpointed step runs out of memory: a warning says so,
    and the run's times stand without an MFU. Fake tensors leave what a block swap or offload hook would have
    copied uncopied: counted after the timed steps, as bench speed does, nothing trains after it."""
    cfg = trainer.cfg
    stance = torch.compiler.set_stance("force_eager") if cfg.speed.compile else contextlib.nullcontext()
    with stance:
        if FAKE_COUNT:
            # whatever fake tensors cannot run is counted for real below (_count_flops drops a fake step's gradients)
            with contextlib.suppress(Exception):
                return _step_flops(trainer, fake=True)
        return _step_flops(trainer, fake=False)


def _step_flops(trainer: Trainer, fake: bool) -> tuple[float, bool] | None:
    cfg = trainer.cfg
    got = _eager_step_flops(trainer, fake)
    if got is None:
        return None
    count, exact = got
    act = cfg.memory.activations
    if act.kind != "checkpoint" or (exact and not cfg.speed.compile):
        return count, True
    kept: list[float] = []  # save_attention: the kept attentions' FLOPs, which the recompute skips
    try:
        forward = _count_flops(trainer, grad=False, fake=fake, kept=kept if act.save_attention else None)
    except torch.OutOfMemoryError:
        free_memory(trainer.device)
        return count, False
    share = (2 if act.split else 1) / act.every
    return count - share * (forward - sum(kept)), False


class _KeptAttentionFlops(TorchDispatchMode):
    """The FLOPs of the attention calls memory.activations.save_attention keeps (checkpoint_policy.keeps: those over
    enough keys), by torch.utils.flop_counter's own formulas: what a checkpointed block's recompute does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None and checkpoint_policy.keeps(func, args):
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def _count_flops(trainer: Trainer, grad: bool = True, fake: bool = False, kept: list[float] | None = None) -> float:
    """One step's FLOPs (a no-grad forward's where not ``grad``) as torch.utils.flop_counter counts them; ``fake``:
    on fake tensors (the batch made fake, the modules' own tensors taken in as fake ones). ``kept``: a list the
    FLOPs of the attentions save_attention keeps are appended to."""
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import FlopCounterMode

    batch = trainer.feed.batch(trainer.feed.items[: trainer.cfg.train.batch_size])
    mode: contextlib.AbstractContextManager = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode as fm:
            if fake:
                batch = tree_map(lambda v: fm.from_tensor(v) if isinstance(v, torch.Tensor) else v, batch)
            attention = _KeptAttentionFlops() if kept is not None else contextlib.nullcontext()
            with FlopCounterMode(display=False) as fc, attention:
                if grad:
                    trainer.loss(batch).backward()
                else:
                    with torch.no_grad():
                        trainer.loss(batch)
    finally:
        trainer.parts.optimizer.zero_grad(set_to_none=True)  # a fake step's gradients are fake: never kept
    if isinstance(attention, _KeptAttentionFlops) and kept is not None:
        kept.append(attention.flops * trainer.cfg.train.grad_accum)
    return fc.get_total_flops() * trainer.cfg.train.grad_accum


def _without_checkpoints_fits(trainer: Trainer) -> bool:
    """Whether the planner puts a step without checkpointing inside the GPU's memory (with a margin: the count runs
    eagerly). Off a GPU, always; a step whose activations the planner cannot count, never."""
    cfg, device = trainer.cfg, trainer.device
    if device.type != "cuda" or cfg.memory.activations.kind != "checkpoint":
        return True
    try:
        memory = cfg.memory.model_copy(update={"activations": ActNone()})
        est = plan_memory(cfg.model_copy(update={"memory": memory}))
    except Exception:  # noqa: BLE001 - any config the planner cannot take: do not risk running out of memory
        return False
    free, _total = torch.cuda.mem_get_info(device)
    return not est.unknown_activations and est.gpu_reserved * 2**30 * 1.15 < free + torch.cuda.memory_reserved(device)


def _eager_step_flops(trainer: Trainer, fake: bool = False) -> tuple[float, bool] | None:
    den = trainer.parts.comps[trainer.family.denoiser]
    flags = {
        m: m.gradient_checkpointing
        for m in den.modules()
        if isinstance(getattr(m, "gradient_checkpointing", None), bool)
    }
    if any(flags.values()) and (fake or _without_checkpoints_fits(trainer)):
        try:
            for m in flags:
                m.gradient_checkpointing = False
            return _count_flops(trainer, fake=fake), True
        except torch.OutOfMemoryError:
            pass
        finally:
            for m, f in flags.items():
                m.gradient_checkpointing = f
    # Out of the except block, then collected: the failed try's tensors live as long as its error (the traceback
    # holds the frames of the step it stopped) and, where a reference cycle runs through it, until the collector
    # runs.
    trainer.parts.optimizer.zero_grad(set_to_none=True)
    free_memory(trainer.device)
    try:  # no switch on (checkpointing off, or inside compiled blocks): counted as configured
        return _count_flops(trainer, fake=fake), not any(flags.values())
    except torch.OutOfMemoryError:
        pass
    trainer.parts.optimizer.zero_grad(set_to_none=True)
    free_memory(trainer.device)
    warn("bench speed: counting the step's FLOPs ran out of GPU memory even with checkpointing; no MFU reported")
    return None


def bench_speed(
    cfg: Config,
    work: Path,
    steps: int = 10,
    warmup: int = 3,
    baseline: Config | None = None,
    size: tuple[int, int] | None = None,
    profile: bool = False,
    planned_steps: int | None = None,
    buckets: list[tuple[int, int]] | None = None,
    step_times: bool = False,
) -> dict:
    """Time ``cfg`` (and ``baseline``, by default the same config run eagerly) for ``warmup`` + ``steps`` steps on
    random weights and data of the real shapes; FLOPs counted once on the eager run, MFU against the dense matmul
    peak measured in the same process."""
    work = Path(work)
    device = pick_device(cfg.train.device)
    peak = peak_matmul_tflops(device)
    # the baseline runs eagerly unless it was given speed options (baseline_config), e.g. float8 against compiled bf16
    runs = (
        [("compiled baseline" if baseline.speed.compile is True else "eager baseline", baseline)]
        if baseline is not None
        else []
    )
    runs.append(("config", cfg))
    rows, flops = [], None
    for name, c in runs:
        c = c.model_copy(
            update={
                "report": c.report.model_copy(update={"to": [], "html": False}),
                "validation": c.validation.model_copy(update={"prompts": [], "loss_items": 0}),
            }
        )
        run_cfg = _prepare(c, work, warmup + steps + (2 if profile else 0), size, run=name.split()[0], buckets=buckets)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prof = work / f"profile-{name.split()[0]}.txt" if profile else None
        compile_before = _compile_totals()
        trainer, times, summary = _timed_run(run_cfg, warmup, prof, planned_steps, step_times)
        compiled = trainer.speed.compile
        per = (times[warmup + steps] - times[warmup]) / steps
        bs = c.train.batch_size * c.train.grad_accum
        peak_mem = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
        peak_res = round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if device.type == "cuda" else None
        if flops is None and (
            not c.speed.float8 or name == runs[-1][0]
        ):  # model FLOPs: bf16 matmuls if any run has them
            counted = step_flops(trainer)
            flops = (counted, bs) if counted is not None else None
        compiled = trainer.speed.compile
        rows.append(
            SpeedRow(
                name,
                round(per, 4),
                round(bs / per, 3),
                round(times[1] - times[0], 2),
                round(max(0.0, times[warmup] - times[0] - warmup * per), 2),
                peak_mem,
                peak_reserved_gib=peak_res,
                profile=summary or None,
                compile=compile_phases(since=compile_before) if compiled else None,
                speed=trainer.speed.line(),
                step_s=[round(times[i] - times[i - 1], 4) for i in range(1, warmup + steps + 1)]
                if step_times
                else None,
            )
        )
        del trainer
        if compiled:  # dynamo's per-code caches are process-wide: the next run's blocks (same forward code,
            from torch import _dynamo  # other layers, e.g. float8's) would hit its recompile limit and run eagerly

            _dynamo.reset()
        free_memory(device)
    if flops is not None:
        _throughput(rows, [c for _, c in runs], flops, peak)
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_tflops": float(f"{peak:.4g}"),
        "torch": torch.__version__,
        "steps": steps,
        "warmup": warmup,
        "flops_per_step": flops[0][0] if flops else None,
        "flops_exact": flops[0][1] if flops else None,
        "rows": [r.__dict__ for r in rows],
        "recompile_limit_hits": recompile_limit_hits(),  # blocks dynamo left eager (speed.configure_compile's watch)
    }
    if len(rows) == 2:
        out["speedup"] = round(rows[0].s_per_step / rows[1].s_per_step, 3)
    (work / "bench_speed.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def _throughput(rows: list[SpeedRow], cfgs: list[Config], flops: tuple[tuple[float, bool], int], peak: float) -> None:
    """Each row's TFLOP/s and MFU: the model FLOPs counted once (for ``flops[1]`` samples), scaled to its batch."""
    (count, _exact), bs0 = flops
    for r, c in zip(rows, cfgs):
        f = count * (c.train.batch_size * c.train.grad_accum) / bs0
        r.tflops = float(f"{f / r.s_per_step / 1e12:.4g}")
        r.mfu = float(f"{f / r.s_per_step / 1e12 / peak:.4g}")
