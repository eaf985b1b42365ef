"""Speed cases of issue 10 (docs/benchmarks.md, "Speed"): each case is one `difftrain bench speed` process
(a fresh torch.compile state), random weights of the real architecture, random cached data of the real shapes.

    python benchmarks/speed.py --out DIR [--cases S1,S2] [--work DIR]

Each case's JSON lands in DIR as soon as it finishes; a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# CogVideoX-2b LoRA r64 at 49x480x720 without checkpointing, compiled (the S4 cases), and how long each runs
_S4 = ["--recipe", "cogvideox-2b-lora-24gb", "--set", "memory.activations.kind=none", "--set", "lora.rank=64"]
_S4 += ["--set", "lora.alpha=64", "--set", "speed.compile=true"]
_S4_RUN = ["--size", "480x720", "--steps", "6", "--warmup", "2"]
# S2g-cudnn's config with FlashAttention-4 (speed.attention fa4), as the S2g-fa4, -regions and -unet-blocks cases run it
# the SDXL MFU job: LoRA at batch 4 without checkpointing (the S2 cases)
_S2G_JOB = ["--recipe", "sdxl-lora-8gb", "--set", "memory.activations.kind=none", "--set", "train.batch_size=4"]
_S2G_FA4 = _S2G_JOB + [
    "--set",
    "speed.compile=true",
    "--set",
    "speed.cuda_graphs=true",
    "--set",
    "speed.channels_last=true",
]
_S2G_FA4 += ["--set", "speed.attention=fa4"]
# the bench's baseline is the diffusers scripts' eager way (bench.EAGER); these put back the shipped host-side
# settings, which both baselines below keep
_HOST_BASELINE = ["--baseline-set", "speed.sync_seconds=2", "--baseline-set", "speed.pin_memory=true"]
_HOST_BASELINE += ["--baseline-set", "speed.optimizer_kernels=auto"]
# a baseline with S2g-fa4's whole speed section (the cases name what they compare on top)
_S2G_FA4_BASELINE = ["--baseline-set", "speed.compile=true", "--baseline-set", "speed.cuda_graphs=true"]
_S2G_FA4_BASELINE += ["--baseline-set", "speed.channels_last=true", "--baseline-set", "speed.attention=fa4"]
_S2G_FA4_BASELINE += _HOST_BASELINE
# the baseline with the speed section as shipped
_SHIPPED_BASELINE = ["--baseline-set", "speed.compile=auto", "--baseline-set", "speed.cuda_graphs=auto"]
_SHIPPED_BASELINE += _HOST_BASELINE + ["--baseline-set", "speed.geglu=auto"]

# name: (bench speed arguments, what it checks)
CASES = {
    # the first target: SDXL LoRA b1 in the 4 GiB tier's memory (fp8 weights, checkpointing), compiled,
    # against the eager checkpointed bf16 run (the reference's 0.64 s/step case)
    "S1": (
        ["--recipe", "sdxl-lora-4gb", "--set", "speed.compile=true", "--baseline-set", "memory.weights.kind=bf16"],
        "SDXL LoRA b1, 4 GiB tier memory, compiled vs eager checkpointed bf16",
    ),
    "S1w": (
        ["--recipe", "sdxl-lora-4gb", "--set", "speed.compile=true", "--no-baseline"],
        "S1's compiled run again, with the compiled kernels S1 left in the cache",
    ),
    "S1g": (
        [
            "--recipe",
            "sdxl-lora-4gb",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
            "--baseline-set",
            "memory.weights.kind=bf16",
        ],
        "S1 compiled with CUDA graphs (reduce-overhead), checkpointing inside the compiled blocks",
    ),
    "S1g-bf16": (
        [
            "--recipe",
            "sdxl-lora-4gb",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
            "--set",
            "memory.weights.kind=bf16",
            "--no-baseline",
        ],
        "S1g with bf16 weights: what the fp8 weights cost under compile + CUDA graphs (beside S1g's s/step)",
    ),
    "S3g": (
        [
            "--recipe",
            "sd3-lora-16gb",
            "--set",
            "memory.activations.kind=none",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
            "--no-baseline",
        ],
        "S3 compiled with CUDA graphs",
    ),
    "S1-bf16": (
        ["--recipe", "sdxl-lora-8gb", "--set", "speed.compile=true", "--no-baseline"],
        "SDXL LoRA b1 bf16 checkpointed, compiled",
    ),
    "S1-nockpt": (
        [
            "--recipe",
            "sdxl-lora-8gb",
            "--set",
            "speed.compile=true",
            "--set",
            "memory.activations.kind=none",
            "--baseline-set",
            "speed.compile=false",
        ],
        "SDXL LoRA b1 bf16 no checkpointing, compiled vs eager",
    ),
    "S2": (
        _S2G_JOB
        + [
            "--set",
            "speed.compile=true",
        ],
        "SDXL LoRA b4 no checkpointing, compiled vs eager",
    ),
    "S2g": (
        _S2G_JOB
        + [
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
        ],
        "SDXL LoRA b4 no checkpointing, compiled + CUDA graphs vs eager",
    ),
    "S2g-cudnn": (
        _S2G_JOB
        + [
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
            "--set",
            "speed.attention=cudnn",
            "--set",
            "speed.channels_last=true",
            "--no-baseline",
        ],
        "S2g with cuDNN attention and channels-last convolutions",
    ),
    # S2g-cudnn's settings with FlashAttention-4 for the 4,096-token self-attention (speed.attention fa4; the
    # shorter and cross attention stay on SDPA) against S2g-cudnn itself, in one process
    "S2g-fa4": (
        _S2G_FA4
        + ["--baseline-set", "speed.compile=true", "--baseline-set", "speed.cuda_graphs=true"]
        + ["--baseline-set", "speed.channels_last=true", "--baseline-set", "speed.attention=cudnn"],
        "S2g-cudnn with FlashAttention-4 against S2g-cudnn, both compiled with CUDA graphs",
    ),
    # S2g-fa4's config compiled in larger regions (each Transformer2DModel whole: its norm, projections and
    # reshapes too, and the resamplers) against S2g-fa4's block regions, in one process
    "S2g-regions": (
        _S2G_FA4
        + ["--set", "speed.compile_regions=[Transformer2DModel,ResnetBlock2D,Downsample2D,Upsample2D]"]
        + _S2G_FA4_BASELINE
        + ["--baseline-set", "speed.geglu=auto"],
        "S2g-fa4 compiled by Transformer2DModel (and resampler) regions against S2g-fa4's blocks",
    ),
    # S2g-fa4's config with difftrain's Triton backward for SDXL's GEGLU gates (speed.geglu auto takes it on CUDA)
    # against the same config with diffusers' ops, in one process
    "S2g-geglu": (
        _S2G_FA4 + ["--set", "speed.geglu=triton"] + _S2G_FA4_BASELINE + ["--baseline-set", "speed.geglu=torch"],
        "S2g-fa4 with the Triton GEGLU backward against diffusers' GEGLU ops",
    ),
    # the MFU case with the speed section as shipped until 2026-11-26's sixth session (speed auto deciding for a
    # 2,000-step run: compile, CUDA graphs, FA4 where installed, the Triton GEGLU backward) against the same with
    # channels-last convolutions on top, in one process; both runs keep peft's LoRA Linear, as then (the fused one,
    # auto's choice without checkpointing since, is S2g-shipped's)
    "S2g-auto": (
        _S2G_JOB
        + ["--planned-steps", "2000", "--set", "speed.channels_last=true", "--set", "speed.lora_kernel=peft"]
        + _SHIPPED_BASELINE,
        "SDXL LoRA b4 as shipped (speed auto, a 2,000-step run) with channels-last against without",
    ),
    # the MFU case as shipped since 2026-11-26's seventh session (speed auto now also turns on channels-last for a
    # compiled SDXL LoRA and difftrain's fused LoRA Linear on CUDA) against the speed section as shipped before
    # (both off: the eager baseline's values of those two), in one process
    "S2g-shipped": (
        _S2G_JOB + ["--planned-steps", "2000"] + _SHIPPED_BASELINE,
        "SDXL LoRA b4 as shipped (speed auto, a 2,000-step run) against the shipped defaults before channels-last "
        "auto and the fused LoRA kernel",
    ),
    # channels-last where the tier cards measured it slower (sdxl-lora-8gb 0.164 against 0.140 s/step in 4 steps,
    # 2026-11-26): the recipe as shipped on a long run, ten timed steps, with and without; and batch 1 without
    # checkpointing, to tell checkpointing's part from the batch's (both with peft's LoRA Linear, as measured; the
    # recipe as shipped now is S1-8gb-cl's channels-last run: auto turns it on and keeps peft under checkpointing)
    "S1-8gb-cl": (
        ["--recipe", "sdxl-lora-8gb", "--planned-steps", "2000", "--set", "speed.channels_last=true"]
        + _SHIPPED_BASELINE,
        "sdxl-lora-8gb as shipped (speed auto, a 2,000-step run) with channels-last against without",
    ),
    "S1n-cl": (
        ["--recipe", "sdxl-lora-8gb", "--set", "memory.activations.kind=none", "--planned-steps", "2000"]
        + ["--set", "speed.channels_last=true", "--set", "speed.lora_kernel=peft"]
        + _SHIPPED_BASELINE,
        "SDXL LoRA b1 without checkpointing (speed auto, a 2,000-step run) with channels-last against without",
    ),
    # S2g-regions with the UNet's down, mid and up blocks as the regions (all but the embeddings, conv_in and
    # conv_out compiled), alone: its compile does not leave time for a baseline in one call
    "S2g-unet-blocks": (
        _S2G_FA4
        + ["--no-baseline"]
        + [
            "--set",
            "speed.compile_regions=[CrossAttnDownBlock2D,DownBlock2D,UNetMidBlock2DCrossAttn,"
            "CrossAttnUpBlock2D,UpBlock2D]",
        ],
        "S2g-fa4 compiled by the UNet's down, mid and up blocks",
    ),
    "S2g-ma": (
        _S2G_JOB
        + [
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
            "--set",
            "speed.compile_mode=max-autotune",
            "--no-baseline",
        ],
        "S2g with inductor's autotuned Triton matmul/convolution templates",
    ),
    "S3": (
        ["--recipe", "sd3-lora-16gb", "--set", "memory.activations.kind=none", "--set", "speed.compile=true"],
        "SD3-medium LoRA b1 no checkpointing, compiled vs eager",
    ),
    "S4": (_S4 + _S4_RUN, "CogVideoX-2b LoRA r64 49x480x720 no checkpointing, compiled vs eager"),
    "S4-cudnn": (_S4 + ["--set", "speed.attention=cudnn"] + _S4_RUN, "S4 with cuDNN attention, compiled vs eager"),
    # FlashAttention-4 (speed.attention fa4, flash-attn-4 installed: benchmarks/fa4_stage.sh) against cuDNN's
    # attention, both compiled, in one process
    "S4-fa4": (
        _S4
        + ["--set", "speed.attention=fa4", "--baseline-set", "speed.compile=true"]
        + ["--baseline-set", "speed.attention=cudnn"]
        + _S4_RUN,
        "S4 with FlashAttention-4 against cuDNN attention, both compiled",
    ),
    "S4-ma": (
        [
            "--recipe",
            "cogvideox-2b-lora-24gb",
            "--set",
            "memory.activations.kind=none",
            "--set",
            "lora.rank=64",
            "--set",
            "lora.alpha=64",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.compile_mode=max-autotune",
            "--size",
            "480x720",
            "--steps",
            "6",
            "--warmup",
            "2",
            "--no-baseline",
        ],
        "S4 with inductor's autotuned Triton matmul templates",
    ),
    "S4-ckpt": (
        [
            "--recipe",
            "cogvideox-2b-lora-24gb",
            "--set",
            "memory.activations.kind=checkpoint",
            "--set",
            "lora.rank=64",
            "--set",
            "lora.alpha=64",
            "--set",
            "speed.compile=true",
            "--size",
            "480x720",
            "--steps",
            "6",
            "--warmup",
            "2",
        ],
        "CogVideoX-2b LoRA r64 49x480x720 checkpointed, compiled vs eager",
    ),
    "S5-cudagraphs": (
        [
            "--recipe",
            "sdxl-lora-8gb",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
            "--set",
            "memory.activations.kind=none",
            "--no-baseline",
        ],
        "SDXL LoRA b1, compiled + CUDA graphs",
    ),
    # torchao float8 training against the same config in bf16, both compiled (the baseline keeps speed.compile),
    # at batch 4 without checkpointing so the GPU, not the host, sets the pace (where fp8 matmuls can show)
    "S6-full-fp8": (
        [
            "--recipe",
            "sdxl-full",
            "--set",
            "memory.activations.kind=none",
            "--set",
            "train.batch_size=4",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.float8=true",
            "--baseline-set",
            "speed.compile=true",
        ],
        "SDXL full fine-tune b4, 8-bit Adam, compiled: torchao float8 vs bf16",
    ),
    "S7-sd3-full-fp8": (
        [
            "--recipe",
            "sd3-lora-16gb",
            "--set",
            "train.method=full",
            "--set",
            "memory.optimizer.kind=adamw8bit",
            "--set",
            "train.batch_size=4",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.float8=true",
            "--baseline-set",
            "speed.compile=true",
        ],
        "SD3-medium full fine-tune b4, 8-bit Adam, compiled: torchao float8 vs bf16",
    ),
    "S7g-sd3-full-fp8": (
        [
            "--recipe",
            "sd3-lora-16gb",
            "--set",
            "train.method=full",
            "--set",
            "memory.optimizer.kind=adamw8bit",
            "--set",
            "train.batch_size=4",
            "--set",
            "speed.compile=true",
            "--set",
            "speed.cuda_graphs=true",
            "--set",
            "speed.float8=true",
            "--baseline-set",
            "speed.compile=true",
            "--baseline-set",
            "speed.cuda_graphs=true",
        ],
        "S7 with CUDA graphs in both runs (the host's launches out of the way)",
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-speed"))
    ap.add_argument("--cases", default="S1,S2,S1-nockpt")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--extra", default="", help="more bench speed arguments for every case, e.g. --profile")
    ap.add_argument("--cache", type=Path, default=None, help="torch inductor cache folder (default: fresh per case)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for name in a.cases.split(","):
        args, what = CASES[name.split("@")[0]]
        work = a.work / name.split("@")[0]
        cache = a.cache or (a.work / f"inductor-{name.split('@')[0]}")  # S3@warm: S3's compiled kernels again
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        cmd = [
            sys.executable,
            "-m",
            "difftrain.cli.app",
            "bench",
            "speed",
            *args,
            *a.extra.split(),
            "--work",
            str(work),
        ]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            rc, log = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        (a.out / f"{name}.log").write_text(" ".join(cmd) + "\n" + log)
        res = json.loads((work / "bench_speed.json").read_text()) if rc == 0 else None
        for f in work.glob("profile-*.txt"):  # --profile's top kernels per run
            (a.out / f"{name}-{f.name}").write_text(f.read_text())
        if res:
            (a.out / f"{name}.json").write_text(json.dumps({"case": name, "what": what, "args": args, **res}, indent=1))
        summary.append((name, rc, round(time.time() - t0), res))
        print(f"{name}: rc={rc} wall={time.time() - t0:.0f}s", flush=True)
    print("\ncase | run | s/step | samples/s | TFLOP/s | MFU | step1 s | warm-up s | peak GiB | speed-up")
    for name, rc, wall, res in summary:
        if not res:
            print(f"{name} | failed ({rc}, {wall}s)")
            continue
        for r in res["rows"]:
            print(
                f"{name} | {r['name']} | {r['s_per_step']} | {r['samples_per_s']} | {r['tflops']} | {r['mfu']} | "
                f"{r['first_step_s']} | {r['warmup_overhead_s']} | {r['peak_alloc_gib']} | {res.get('speedup', '')}"
            )
    profiled = [(name, r) for name, _, _, res in summary if res for r in res["rows"] if r.get("profile")]
    if profiled:  # --profile: where the GPU time of the last step went
        from difftrain.flows.bench import kinds_line

        print("\ncase | run | kernels (graphs) | GPU ms / profiled step ms | GPU time by kind")
        for name, r in profiled:
            p = r["profile"]
            print(
                f"{name} | {r['name']} | {p['kernel_launches']} ({p.get('graph_launches', 0)}) | "
                f"{p['gpu_ms']} / {p.get('step_ms')} | {kinds_line(p.get('by_kind', {}))}"
            )


if __name__ == "__main__":
    main()
