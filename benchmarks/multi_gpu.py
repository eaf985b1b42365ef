"""Several GPUs through `difftrain train --gpus N`: throughput against one GPU, host RAM summed over the
ranks (and per rank) during load and training, peak GPU memory per rank.

Random weights of the full-size bundled architecture (a single file, written once), a synthetic cache of
the real shapes (8 items per GPU), each case one `difftrain train --gpus N` run. While it runs, this script
samples every worker's /proc/<pid>/smaps_rollup: Rss (what `top` shows: includes the safetensors pages the
ranks map, once per rank), Pss (shared pages split among the ranks that map them: the sum over ranks is
the node's real use) and Anonymous (private copies). "load" is until the first training step is logged.

    python benchmarks/multi_gpu.py --work /tmp/mg --out $OUT --cases L1,L2,L4,Z4
    python benchmarks/multi_gpu.py --work /tmp/mg --out $OUT --cases F1,F2,Z2      # issue 28: per GPU vs one GPU
    DIFFTRAIN_BENCH_TINY=1 python benchmarks/multi_gpu.py --work /tmp/mg --cases L1,L2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

TINY = os.environ.get("DIFFTRAIN_BENCH_TINY") == "1"
SDXL = [
    "train.batch_size=1",
    "data.resolution=1024",
    "lora.rank=16",
    "train.mixed_precision=bf16",
    "memory.weights.kind=bf16",
    "memory.activations.kind=checkpoint",
    "train.learning_rate=1e-4",
    "report.to=[]",
    "report.html=false",
]
# the big transformers' full-size settings beside their family and shapes: batch 1, bf16, checkpointing, lr 1e-5
BIG_BF16 = [
    "train.batch_size=1",
    "train.mixed_precision=bf16",
    "memory.weights.kind=bf16",
    "memory.activations.kind=checkpoint",
    "train.learning_rate=1e-5",
    "report.to=[]",
    "report.html=false",
]
COG5B = [
    "family=cogvideox",
    "model.config=cogvideox-5b",
    "data.resolution=592",
    "data.bucket_step=16",
    "data.frames=49",
    *BIG_BF16,
]
QWEN = [
    "family=qwen-image",
    "model.config=qwen-image",
    "data.resolution=1024",
    "data.min_side=256",
    "data.max_side=2048",
    *BIG_BF16,
]
ZERO3 = [
    "memory.engine.kind=deepspeed",
    "memory.engine.stage=3",
    "memory.engine.offload_optimizer_device=none",
    "train.method=full",
    "save.formats=[]",
]
FULL = ["train.method=full", "save.formats=[]"]
# torch's FSDP2 (memory.engine fsdp): fp32 master shares, bf16 compute, torch's AdamW (issue 28, item 3)
FSDP = ["memory.engine.kind=fsdp", "train.method=full", "save.formats=[]", "memory.optimizer.kind=adamw"]
ZERO_FILES = Path(__file__).parent / "zero"  # DeepSpeed settings tried against the generated config (issue 28, item 1)
#: name: (what, family sets, gpus, extra sets, job). Each case's per-GPU throughput is printed against the 1-GPU
#: case of its job run in the same call (the job's best single-GPU recipe where one is listed), so a sharded run
#: slower than one GPU shows at once (issue 28, item 4).
CASES = {
    "L1": ("SDXL LoRA r16 1024, DDP, 1 GPU", SDXL, 1, [], "sdxl-lora"),
    "L2": ("SDXL LoRA r16 1024, DDP, 2 GPUs", SDXL, 2, [], "sdxl-lora"),
    # compiled with CUDA graphs, as speed auto runs a long LoRA job (one process, and now under DDP too)
    "L1-graphs": (
        "SDXL LoRA r16 1024, compiled + CUDA graphs, 1 GPU",
        SDXL,
        1,
        ["speed.compile=true", "speed.cuda_graphs=true"],
        "sdxl-lora-graphs",
    ),
    "L2-graphs": (
        "SDXL LoRA r16 1024, DDP, compiled + CUDA graphs, 2 GPUs",
        SDXL,
        2,
        ["speed.compile=true", "speed.cuda_graphs=true"],
        "sdxl-lora-graphs",
    ),
    # DDP's own options (memory.engine ddp): no copy of the gradients into buckets; the same graph every step
    "L2-view": (
        "SDXL LoRA r16 1024, DDP gradient_as_bucket_view, 2 GPUs",
        SDXL,
        2,
        ["memory.engine.kind=ddp", "memory.engine.gradient_as_bucket_view=true"],
        "sdxl-lora",
    ),
    "L2-static": (
        "SDXL LoRA r16 1024, DDP static_graph + gradient_as_bucket_view, 2 GPUs",
        SDXL,
        2,
        ["memory.engine.kind=ddp", "memory.engine.gradient_as_bucket_view=true", "memory.engine.static_graph=true"],
        "sdxl-lora",
    ),
    "L4": ("SDXL LoRA r16 1024, DDP, 4 GPUs", SDXL, 4, [], "sdxl-lora"),
    # the best single-GPU SDXL full fine-tune as shipped (recipe sdxl-full: AdamW8bit, checkpointing)
    "F1": ("SDXL full, recipe sdxl-full, 1 GPU", SDXL, 1, FULL, "sdxl-full"),
    # the same recipe on several GPUs with the engine left to auto (the default)
    "F2": ("SDXL full, recipe sdxl-full, engine auto, 2 GPUs", SDXL, 2, FULL, "sdxl-full"),
    # F2 with diffusers' GEGLU ops (speed.geglu torch): does the Triton backward change the eager step
    "F2-torch-geglu": (
        "SDXL full, recipe sdxl-full, engine auto, speed.geglu torch, 2 GPUs",
        SDXL,
        2,
        FULL + ["speed.geglu=torch"],
        "sdxl-full",
    ),
    # the same recipes compiled (speed auto compiles a long run; a 10-step benchmark would stay eager)
    "F1-compile": (
        "SDXL full, recipe sdxl-full + speed.compile, 1 GPU",
        SDXL,
        1,
        FULL + ["speed.compile=true"],
        "sdxl-full",
    ),
    "F2-compile": (
        "SDXL full, recipe sdxl-full + speed.compile, engine auto (DDP), 2 GPUs",
        SDXL,
        2,
        FULL + ["speed.compile=true"],
        "sdxl-full",
    ),
    # CUDA graphs named by hand beside DDP (speed auto leaves them off with several processes: not measured), and the
    # 1-GPU recipe compiled without them: how much of the compiled 1-GPU step is the graphs'
    "F2-graphs": (
        "SDXL full, recipe sdxl-full + speed.compile + speed.cuda_graphs, engine auto (DDP), 2 GPUs",
        SDXL,
        2,
        FULL + ["speed.compile=true", "speed.cuda_graphs=true"],
        "sdxl-full",
    ),
    # DDP compiled without CUDA graphs (speed auto records them beside DDP since 2026-11-26): the compiled step a
    # sharded engine (whose gathers run inside the blocks) is compared with
    "F2-compile-nographs": (
        "SDXL full, recipe sdxl-full + speed.compile without CUDA graphs, engine auto (DDP), 2 GPUs",
        SDXL,
        2,
        FULL + ["speed.compile=true", "speed.cuda_graphs=false"],
        "sdxl-full",
    ),
    "F1-compile-nographs": (
        "SDXL full, recipe sdxl-full + speed.compile without CUDA graphs, 1 GPU",
        SDXL,
        1,
        FULL + ["speed.compile=true", "speed.cuda_graphs=false"],
        "sdxl-full",
    ),
    "Z4": ("SDXL full, ZeRO-3, 4 GPUs", SDXL, 4, ZERO3, "sdxl-full"),
    "Z1": ("SDXL full, ZeRO-3, 1 GPU", SDXL, 1, ZERO3, "sdxl-full-zero3"),
    "Z2": ("SDXL full, ZeRO-3, 2 GPUs", SDXL, 2, ZERO3, "sdxl-full"),
    # the same without deepspeed.zero.Init (each process loads the whole UNet; DeepSpeed partitions it after)
    "Z4-no-init": ("SDXL full, ZeRO-3 without zero.Init, 4 GPUs", SDXL, 4, ZERO3, "sdxl-full"),
    # ZeRO-3 with DeepSpeed's settings for many small parameters and re-gathers (benchmarks/zero/*.json)
    "Z2-persist": (
        "SDXL full, ZeRO-3 + persist.json, 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'persist.json'}"],
        "sdxl-full",
    ),
    "Z2-buckets": (
        "SDXL full, ZeRO-3 + buckets.json, 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'buckets.json'}"],
        "sdxl-full",
    ),
    "Z2-no-overlap": (
        "SDXL full, ZeRO-3 + no_overlap.json, 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'no_overlap.json'}"],
        "sdxl-full",
    ),
    "Z2-leaf": (
        "SDXL full, ZeRO-3 + leaf.json (blocks as leaf modules), 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'leaf.json'}"],
        "sdxl-full",
    ),
    "Z2-leaf-persist": (
        "SDXL full, ZeRO-3 + leaf_persist.json (leaf blocks, small parameters kept), 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'leaf_persist.json'}"],
        "sdxl-full",
    ),
    "Z2-coarse": (
        "SDXL full, ZeRO-3 + coarse_leaf_persist.json (whole transformer stacks as leaves), 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'coarse_leaf_persist.json'}"],
        "sdxl-full",
    ),
    "Z2-blocks": (
        "SDXL full, ZeRO-3 + block_leaf_persist.json (the UNet's down/mid/up blocks as leaves), 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'block_leaf_persist.json'}"],
        "sdxl-full",
    ),
    "Z2-deepcompile": (
        "SDXL full, ZeRO-3 + DeepCompile (deepcompile.json, DeepSpeed's own settings), 2 GPUs",
        SDXL,
        2,
        ZERO3 + ["memory.engine.family_settings=false", f"memory.engine.config_file={ZERO_FILES / 'deepcompile.json'}"],
        "sdxl-full",
    ),
    # DeepSpeed's own torch.nn.functional.linear replacement off (memory_efficient_linear: its backward is Python,
    # 743 calls a step in the Z2 cProfile): the native linear, over SDXL's measured settings
    "Z2-native-linear": (
        "SDXL full, ZeRO-3 + native_linear.json, 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'native_linear.json'}"],
        "sdxl-full",
    ),
    # and parameters under 1e7 elements kept whole (most of SDXL's; 1,913 partition calls a step in the profile)
    "Z2-native-linear-persist": (
        "SDXL full, ZeRO-3 + native_linear_persist.json, 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'native_linear_persist.json'}"],
        "sdxl-full",
    ),
    "Z2-allreduce": (
        "SDXL full, ZeRO-3 + allreduce_fetch.json, 2 GPUs",
        SDXL,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'allreduce_fetch.json'}"],
        "sdxl-full",
    ),
    "S2": (
        "SDXL full, ZeRO-2 (optimizer on the GPU), 2 GPUs",
        SDXL,
        2,
        [z.replace("stage=3", "stage=2") for z in ZERO3],
        "sdxl-full",
    ),
    "P1": ("SDXL full, FSDP2, 1 GPU", SDXL, 1, FSDP, "sdxl-full-fsdp"),
    "P2": ("SDXL full, FSDP2, 2 GPUs", SDXL, 2, FSDP, "sdxl-full"),
    # each block's forward compiled under FSDP's eager hooks (named: speed auto keeps FSDP eager until this measures)
    "P2-compile": ("SDXL full, FSDP2 + speed.compile, 2 GPUs", SDXL, 2, FSDP + ["speed.compile=true"], "sdxl-full"),
    "P2-keep-compile": (
        "SDXL full, FSDP2 without resharding after forward + speed.compile, 2 GPUs",
        SDXL,
        2,
        FSDP + ["memory.engine.reshard_after_forward=false", "speed.compile=true"],
        "sdxl-full",
    ),
    "P2-keep": (
        "SDXL full, FSDP2 without resharding after forward, 2 GPUs",
        SDXL,
        2,
        FSDP + ["memory.engine.reshard_after_forward=false"],
        "sdxl-full",
    ),
    "CP2": ("CogVideoX-5b full 49x480x720, FSDP2, 2 GPUs", COG5B, 2, FSDP, "cog5b-full"),
    # CogVideoX-5b full does not fit one 80 GB GPU without offload: its 1-GPU case is the offloaded recipe
    "C1": ("CogVideoX-5b full 49x480x720, recipe cogvideox-5b-full-12gb, 1 GPU", COG5B, 1, FULL, "cog5b-full"),
    "C2": ("CogVideoX-5b full 49x480x720, ZeRO-3, 2 GPUs", COG5B, 2, ZERO3, "cog5b-full"),
    # ZeRO-3 with CogVideoX's blocks as leaf modules and small parameters kept (SDXL's measured recipe, issue 28)
    "C2-leaf": (
        "CogVideoX-5b full 49x480x720, ZeRO-3 + cog_leaf_persist.json, 2 GPUs",
        COG5B,
        2,
        ZERO3 + [f"memory.engine.config_file={ZERO_FILES / 'cog_leaf_persist.json'}"],
        "cog5b-full",
    ),
    # the 1-GPU recipe as shipped on 2 GPUs, engine left to auto (its fused backward rules DDP out: FSDP is taken)
    "CA2": (
        "CogVideoX-5b full 49x480x720, recipe cogvideox-5b-full-12gb, engine auto, 2 GPUs",
        COG5B,
        2,
        FULL,
        "cog5b-full",
    ),
    # the same on 4 GPUs: the issue's 2-to-4-GPU scaling target for CogVideoX-5b (samples/s of CA4 over CA2's)
    "CA4": (
        "CogVideoX-5b full 49x480x720, recipe cogvideox-5b-full-12gb, engine auto, 4 GPUs",
        COG5B,
        4,
        FULL,
        "cog5b-full",
    ),
    # issue 53: Qwen-Image's 20 B full fine-tune on FSDP2 (planned 91 GiB a GPU over 4: an H200's card, not an H100's),
    # and with every share in host RAM (offload_params: the optimizer steps on the CPU; 4 H100s)
    "QP4": ("Qwen-Image full 1024, FSDP2, 4 GPUs", QWEN, 4, FSDP, "qwen-full"),
    "QP4-off": (
        "Qwen-Image full 1024, FSDP2 with its shares in host RAM, 4 GPUs",
        QWEN,
        4,
        FSDP + ["memory.engine.offload_params=true"],
        "qwen-full",
    ),
    # the recipe for two 80 GB cards as shipped (bf16 master shares, torchao's 8-bit AdamW), each process capped as
    # an 80 GB card leaves torch's allocator (memory/card.py: 80 GiB less the H100's context, libraries and margin)
    "QF2": (
        "Qwen-Image full 1024, recipe qwen-image-full-2x80gb, 2 GPUs capped as 80 GB cards",
        QWEN,
        2,
        ["save.formats=[]", "train.gpu_memory_limit_gib=78.95"],
        "qwen-full",
    ),
    # fp32 master shares with the same 8-bit AdamW (planned 106 GiB a GPU over 2: an H200's, or 4 H100s)
    "QF2-fp32": (
        "Qwen-Image full 1024, FSDP2 fp32 master + torchao 8-bit AdamW, 2 GPUs",
        QWEN,
        2,
        FSDP[:-1] + ["memory.optimizer.kind=adamw8bit", "memory.optimizer.backend=torchao"],
        "qwen-full",
    ),
    "CL2": ("CogVideoX-5b LoRA r64 49x480x720, DDP, 2 GPUs", COG5B, 2, ["lora.rank=64", "lora.alpha=64"], "cog5b-lora"),
}
#: cases trained from a recipe as shipped (its sets on top of the recipe's): name -> recipe
RECIPE = {
    "F1": "sdxl-full",
    "F2": "sdxl-full",
    "F1-compile": "sdxl-full",
    "F2-compile": "sdxl-full",
    "F2-graphs": "sdxl-full",
    "F1-compile-nographs": "sdxl-full",
    "F2-compile-nographs": "sdxl-full",
    "F2-torch-geglu": "sdxl-full",
    "C1": "cogvideox-5b-full-12gb",
    "CA2": "cogvideox-5b-full-12gb",
    "CA4": "cogvideox-5b-full-12gb",
    "QF2": "qwen-image-full-2x80gb",
}


# a case that says it runs a recipe must name it here (F2-torch-geglu once ran the default recipe instead)
_UNNAMED = [n for n, c in CASES.items() if ("recipe " in c[0]) != (n in RECIPE)]
assert not _UNNAMED, f"cases whose description and RECIPE disagree: {_UNNAMED}"


def per_gpu_ratios(rows: list[dict]) -> dict[str, float]:
    """Each case's samples/s per GPU over the samples/s of its job's 1-GPU case in ``rows`` (the same call)."""
    base: dict[str, float] = {}
    for r in rows:  # the first 1-GPU case of each job run in the call
        if r.get("gpus") == 1 and r.get("samples_per_s"):
            base.setdefault(CASES[r["case"]][4], r["samples_per_s"])
    out = {}
    for r in rows:
        b = base.get(CASES[r["case"]][4])
        if b and r.get("samples_per_s") and r.get("gpus"):
            out[r["case"]] = r["samples_per_s"] / (r["gpus"] * b)
    return out


def _build_random(family: str, config: str, path: str, device: str, parts: list[str]) -> None:
    from difftrain.families.registry import get_family

    get_family(family).build_random(config, Path(path), device=device, parts=parts)


def prepare(sets: list[str], work: Path, gpus: int, recipe: str | None = None) -> tuple[Path, Path, Path]:
    """The random model file, stand-in tokenizers and a synthetic cache of 8 items per GPU."""
    import torch

    from difftrain.config.load import resolve
    from difftrain.families.registry import get_family
    from difftrain.flows.bench import synthetic_cache, synthetic_tokenizers
    from difftrain.planning.parts import plan_parts

    cfg = resolve(recipe=recipe, sets=sets).config
    fam = get_family(cfg.family)
    parts = plan_parts(cfg, fam)[0]
    model = work / f"random-{cfg.model.config}.safetensors"
    if not model.exists():
        # in a process of its own: what it leaves on GPU 0 (its CUDA context, cached blocks) would be counted in
        # that GPU's nvidia-smi peak beside rank 0's (QF2's first run: 139.7 GiB on GPU 0 against 67.1 on GPU 1)
        import multiprocessing

        device = "cuda" if torch.cuda.is_available() else "cpu"
        child = multiprocessing.get_context("spawn").Process(
            target=_build_random, args=(cfg.family, cfg.model.config, str(model), device, parts)
        )
        child.start()
        child.join()
        if child.exitcode != 0 or not model.exists():
            raise SystemExit(f"building the random {cfg.model.config} weights failed (exit code {child.exitcode})")
    tok = synthetic_tokenizers(work / "tok")
    video = getattr(fam, "video", False)
    cache = work / f"cache-{cfg.model.config}-{8 * gpus}"
    if not (cache / "index.json").exists():
        synthetic_cache(cfg, cache, n=8 * gpus, size=(480, 720) if video else None)
    return model, tok, cache


class Sampler(threading.Thread):
    """Peaks of Rss / Pss / Anonymous over the difftrain workers (per pid, and summed), split load / train."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir, self.stop = run_dir, False
        self.peak = {"load": {}, "train": {}}

    @staticmethod
    def workers() -> list[int]:
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                env = (d / "environ").read_bytes()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"LOCAL_RANK=" in env and b"difftrain" in cmd:
                out.append(int(d.name))
        return out

    @staticmethod
    def smaps(pid: int) -> dict:
        vals = {}
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in ("Rss", "Pss", "Anonymous"):
                    vals[k] = int(v.split()[0]) / 2**20  # kB -> GiB
        except OSError:
            pass
        return vals

    @staticmethod
    def available() -> float:
        """The node's MemAvailable in GiB (page cache that can be dropped counts as available)."""
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
        return 0.0

    def run(self):
        base = self.available()
        while not self.stop:
            m = self.run_dir / "metrics.jsonl"
            phase = "train" if m.exists() and m.stat().st_size > 0 else "load"
            per = {pid: self.smaps(pid) for pid in self.workers()}
            per = {p: v for p, v in per.items() if v}
            if per:
                peak = self.peak[phase]
                for k in ("Rss", "Pss", "Anonymous"):
                    total = sum(v.get(k, 0) for v in per.values())
                    peak[f"sum_{k}"] = max(peak.get(f"sum_{k}", 0), total)
                    peak[f"max_rank_{k}"] = max(peak.get(f"max_rank_{k}", 0), max(v.get(k, 0) for v in per.values()))
                peak["ranks"] = max(peak.get("ranks", 0), len(per))
                peak["node_used"] = max(peak.get("node_used", 0), base - self.available())
            time.sleep(0.05)


class DeviceUsed(threading.Thread):
    """Peak memory used on each GPU as the driver counts it (nvidia-smi, once a second): torch's reserved memory plus
    what its allocator does not see (the CUDA context, the libraries, NCCL's buffers): what a card must hold."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.peak = False, []

    def run(self):
        while not self.stop:
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10,
                ).stdout.split()  # fmt: skip
                used = [int(x) / 1024 for x in out]  # MiB -> GiB
                self.peak = [max(a, b) for a, b in itertools.zip_longest(self.peak, used, fillvalue=0.0)]
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return
            time.sleep(1.0)


def run_case(name: str, work: Path, steps: int, profile_step: int | None = None, python: bool = False) -> dict:
    what, fam_sets, gpus, extra, _job = CASES[name]
    recipe = RECIPE.get(name)
    # speed.sync_seconds=0: each step's record is written when it finished (step times are read from them)
    sets = fam_sets + extra + ["train.device=cuda", "speed.sync_seconds=0"]
    if TINY:
        sets = (
            [
                s.replace("sdxl-base-1.0", "sdxl-tiny")
                .replace("cogvideox-5b", "cogvideox-tiny")
                .replace("resolution=1024", "resolution=128")
                .replace("resolution=592", "resolution=64")
                .replace("frames=49", "frames=9")
                .replace("=cuda", "=cpu")
                for s in sets
                if "engine" not in s
            ]
            + ["memory.optimizer.kind=adamw"] * (name in RECIPE)
            + [
                "data.min_side=32",
                "model.config="
                + (
                    "cogvideox-tiny"
                    if "cogvideox" in str(fam_sets)
                    else "qwen-image-tiny"
                    if fam_sets is QWEN
                    else "sdxl-tiny"
                ),
            ]
        )
    model, tok, cache = prepare(sets, work, gpus, recipe)
    run_dir = work / f"run-{name}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    # no checkpoint at all: a full fine-tune's final training state (weights and optimizer) is not what is measured
    sets += [
        f"model.path={model}",
        f"model.tokenizer_path={tok}",
        f"data.cache_dir={cache}",
        f"train.output_dir={run_dir}",
        f"train.max_steps={steps}",
        "train.checkpoint_every=null",
    ]
    cmd = [sys.executable, "-m", "difftrain", "train", "--gpus", str(gpus), *[a for s in sets for a in ("--set", s)]]
    if recipe:
        cmd += ["--recipe", recipe]
    sampler = Sampler(run_dir)
    sampler.start()
    used = DeviceUsed()
    used.start()
    t0 = time.time()
    env = {**os.environ, "DIFFTRAIN_PROGRESS": "0"}
    if name.endswith("-no-init"):
        env["DIFFTRAIN_ZERO3_INIT"] = "0"
    prof = work / f"prof-{name}"
    if profile_step:  # every rank profiles this step (trainers/profile.py)
        import shutil

        shutil.rmtree(prof, ignore_errors=True)
        env.update(DIFFTRAIN_PROFILE_DIR=str(prof), DIFFTRAIN_PROFILE_STEP=str(profile_step))
        if python:  # cProfile instead of torch.profiler: where the host's Python goes
            env["DIFFTRAIN_PROFILE_PYTHON"] = "1"
    if gpus == 1:
        env["LOCAL_RANK"] = "0"  # one plain process: marked so that the sampler finds it (a world of one)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sampler.stop = used.stop = True
    wall = time.time() - t0
    if p.returncode != 0:
        # the tail is the launcher's note; the workers' tracebacks come before it
        return {"case": name, "what": what, "error": p.stderr[-3000:], "output": (p.stdout + p.stderr)[-60000:]}
    stats = [
        json.loads((run_dir / ("stats.json" if r == 0 else f"stats.rank{r}.json")).read_text()) for r in range(gpus)
    ]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    times = [r["time"] for r in rows]
    dts = [b - a for a, b in itertools.pairwise(times)][2:]  # the first steps warm up
    s_step = statistics.median(dts) if dts else None
    profile = [json.loads(p.read_text()) for p in sorted(prof.glob("profile.rank*.json"))] if profile_step else []
    return {
        "case": name,
        "what": what,
        "gpus": gpus,
        "profile": profile,
        "wall_s": round(wall, 1),
        "s_per_step": s_step and round(s_step, 3),
        "samples_per_s": s_step and round(gpus / s_step, 3),
        "host": sampler.peak,
        "gpu_peak_alloc_gib": [s.get("gpu_peak_alloc_gib") for s in stats],
        "gpu_peak_reserved_gib": [s.get("gpu_peak_reserved_gib") for s in stats],
        "gpu_used_peak_gib": [round(u, 2) for u in used.peak],  # nvidia-smi: the whole card's use, every GPU
        "load_seconds": [s.get("load_seconds") for s in stats],
        # what the run said of its speed choice (compiled or not, CUDA graphs or not, and why)
        "speed": [x for x in (p.stdout + p.stderr).splitlines() if "speed" in x.lower()][:4],
        # the same seed and data in every case of a job: a setting that changes the maths shows here
        "losses": [round(r["loss"], 5) for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default="L1,L2,L4,Z4")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile-step", type=int, default=None, help="profile this step on every rank (not timed)")
    ap.add_argument("--profile-cases", default=None, help="profile only these cases (comma-separated; default all)")
    ap.add_argument("--profile-python", action="store_true", help="profile the host's Python (cProfile) instead")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    profiled = set(a.profile_cases.split(",")) if a.profile_cases else None
    for name in a.cases.split(","):
        step = a.profile_step if profiled is None or name in profiled else None
        r = run_case(name, a.work, a.steps, step, a.profile_python)
        rows.append(r)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "multi_gpu.json").write_text(json.dumps(rows, indent=1))
            if a.profile_step:  # every case's rank-0 operator tables, in one file
                tables = [  # every rank's, for cProfile (where each rank waits)
                    f"===== {c['case']} {f.stem}\n" + f.read_text()
                    for c in rows
                    for f in sorted((a.work / f"prof-{c['case']}").glob("profile.rank*.txt"))
                    if a.profile_python or f.stem == "profile.rank0"
                ]
                (a.out / "profiles.txt").write_text("\n\n".join(tables))
        print(json.dumps(r)[:1500], flush=True)
    ratios = per_gpu_ratios(rows)
    print(
        "\n| case | GPUs | s/step | samples/s | per GPU vs the job's 1-GPU case | host GiB load: sum Pss / sum Rss / max "
        "rank Rss / sum Anon / node MemAvailable drop | host GiB train: sum Pss / sum Rss / sum Anon / node drop | GPU "
        "peak alloc GiB per rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    prof_lines = []
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} {r['what']} | error: {r['error'][-300:]!r} |")
            continue
        ld, tr = r["host"]["load"], r["host"]["train"]
        eff = f"{ratios[r['case']]:.2f}x" if r["case"] in ratios else ""
        f = lambda d, k: f"{d.get(k, 0):.2f}"
        print(
            f"| {r['case']} {r['what']} | {r['gpus']} | {r['s_per_step']} | {r['samples_per_s']} | {eff} | "
            f"{f(ld, 'sum_Pss')} / {f(ld, 'sum_Rss')} / {f(ld, 'max_rank_Rss')} / {f(ld, 'sum_Anonymous')} / {f(ld, 'node_used')} | "
            f"{f(tr, 'sum_Pss')} / {f(tr, 'sum_Rss')} / {f(tr, 'sum_Anonymous')} / {f(tr, 'node_used')} | {r['gpu_peak_alloc_gib']} |"
        )
        for p in r.get("profile", []):
            if p.get("python"):  # cProfile: the tables are in profiles.txt
                prof_lines.append(f"| {r['case']} | {p['rank']} | {p['wall_ms']} | (cProfile) | | | |")
                continue
            prof_lines.append(
                f"| {r['case']} | {p['rank']} | {p['wall_ms']} | {p['gpu_ms']['compute']} | {p['gpu_ms']['communication']} "
                f"| {p['gpu_ms']['copies']} | {p['kernel_launches']} |"
            )
    if prof_lines:  # where the profiled step went, per rank
        print("\n| case | rank | step wall ms | GPU compute ms | GPU communication ms | copies ms | kernel launches |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(prof_lines))


if __name__ == "__main__":
    main()
