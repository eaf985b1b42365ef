"""Fast by default (issue 24): recipes as shipped (speed auto, no speed flags) on a synthetic cache of SDXL's
real aspect buckets drawn in random order, beside a plain diffusers+peft eager checkpointed loop over the same
buckets, each case in its own process (a fresh torch.compile state), within one call's time budget.

    python benchmarks/fast_default.py --out $OUT [--cases plain-sdxl,sdxl-lora-8gb,...] [--budget 540]

Each difftrain case is `difftrain bench speed --recipe R --no-baseline --buckets SIX --planned-steps 2000`:
speed auto decides as for a 2,000-step run. The warm-up is two epochs (24 steps): torch's CUDA graph trees run a
shape's first call to warm up and record on its second, so one epoch of warm-up left six recordings inside the
timed steps (measured: 0.999 s/step for compile + graphs on 2026-11-25, first pass); the timed steps are the next
two epochs. Every step's seconds are kept (bench speed --step-times: a sync per step, as the plain loop's .item()).
--steady times difftrain's cases as training runs them: read back after the warm-up and after the last step only
(the trainer reads its losses every speed.sync_seconds), so the host queues a step while the GPU runs the last one.
plain-sd3, plain-cogvideox and plain-flux are the same plain loops for sd3-lora-8gb (six buckets),
cogvideox-2b-lora-24gb (49x480x720) and flux-lora-24gb (1024x1024; bf16 weights, as the diffusers Flux LoRA script);
plain-zimage and plain-krea2 for zimage-lora-12gb and krea2-lora-24gb (1024x1024, bf16 weights, LoRA r32 on the
recipes' targets, a 128-token caption as bench speed's cache has); plain-qwen the same for Qwen-Image (its 20 B in bf16,
41 GB: an 80 GB card); plain-wan and plain-wan14 for the Wan 1.3B and 14B cases (wan-14b-lora-bf16: the 14B
uncapped, its MFU; 81 frames of 480x832, bf16 weights, diffusers' checkpointing, LoRA r32 on every Linear of a block,
UMT5's 512 text tokens; issue 51); plain-flux2 and plain-flux2-4b for FLUX.2 [klein] 9B and 4B (1024x1024, bf16
weights, the recipes' targets, Qwen3's 512 tokens; issue 53); plain-qwenedit (Qwen-Image-Edit-2509 with one reference
at the target's size), plain-qwen21 (Qwen-Image 2.1's 64-channel latents at 1/16) and plain-flux2dev (FLUX.2 [dev],
guidance 1.0, Mistral's 512 rows of 15 360) the same (issue 53). --plain-as-h100 caps the plain loops' allocator as
an H100 80GB leaves it: whether each fits the card the issue's speed is judged on.
Writes $OUT/fast_default.json (every case's figures) and $OUT/failures.log; prints a short table last.

--profile: after each case's timed steps, one more step under torch.profiler (the plain loops here, difftrain's
through `bench speed --profile`), the same summary for both (bench._profile_summary: kernel launches, GPU-busy
ms, GPU time by kernel kind) and the operator table in $OUT/profile-CASE.txt: where an eager step spends more
than the plain loop's (issue 24's SD3 gap: --cases plain-sd3,sd3-lora-8gb-off --profile).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIX = [(1024, 1024), (896, 1152), (1152, 896), (832, 1216), (1216, 832), (768, 1344)]
BUCKETS = ",".join(f"{h}x{w}" for h, w in SIX)

#: a Wan recipe with bf16 weights, whole blocks checkpointed on the GPU and AdamW (the fast way where the card holds it)
WAN_BF16_ON_GPU = [
    a
    for s in ("memory.weights.kind=bf16", "memory.activations.offload=false", "memory.activations.split=false",
              "memory.optimizer.kind=adamw")
    for a in ("--set", s)
]  # fmt: skip
FP8MM, NOCK = "speed.fp8_matmul=true", "memory.activations.kind=none"
WHOLE = "speed.compile_regions=[Flux2Transformer2DModel]"


def _at_1024(recipe: str, *sets: str) -> list[str]:
    """bench speed's arguments for a single-stream image recipe at 1024x1024 with ``sets``."""
    return ["--recipe", recipe, "--size", "1024x1024", *(a for s in sets for a in ("--set", s))]


# name: (bench speed arguments after --recipe R, what it checks)
CASES: dict[str, tuple[list[str], str]] = {
    "sdxl-lora-8gb": (["--recipe", "sdxl-lora-8gb"], "SDXL LoRA r16 b1 as shipped (speed auto), six buckets"),
    "sdxl-lora-4gb": (["--recipe", "sdxl-lora-4gb"], "SDXL LoRA r16 b1, block swap 60, as shipped, six buckets"),
    "sdxl-lora-8gb-graphs": (
        ["--recipe", "sdxl-lora-8gb", "--set", "speed.cuda_graphs=true"],
        "sdxl-lora-8gb with CUDA graphs named (auto keeps them for one bucket shape only), six buckets",
    ),
    "sdxl-lora-4gb-graphs": (
        ["--recipe", "sdxl-lora-4gb", "--set", "speed.cuda_graphs=true"],
        "sdxl-lora-4gb with CUDA graphs named (auto records them too since 2026-11-26): block swap into fixed GPU "
        "slots, six buckets",
    ),
    "sdxl-lora-8gb-off": (
        ["--recipe", "sdxl-lora-8gb", "--set", "speed.compile=false"],
        "sdxl-lora-8gb with speed off (eager), six buckets",
    ),
    "sd3-lora-8gb": (["--recipe", "sd3-lora-8gb"], "SD3-medium LoRA as shipped, six buckets, vs its eager run"),
    "sd3-lora-8gb-off": (
        ["--recipe", "sd3-lora-8gb", "--set", "speed.compile=false"],
        "sd3-lora-8gb with speed off (eager), six buckets: against plain-sd3",
    ),
    "cogvideox-2b-lora-24gb": (
        ["--recipe", "cogvideox-2b-lora-24gb", "--size", "480x720"],
        "CogVideoX-2b LoRA as shipped, 49x480x720, vs its eager run",
    ),
    "flux-lora-24gb": (
        ["--recipe", "flux-lora-24gb", "--size", "1024x1024"],
        "FLUX.1 [dev] LoRA r16 as shipped (fp8 base), 1024x1024, vs its eager run",
    ),
    # the other image recipes as shipped, six buckets, no eager run beside them (issue 50, 2026-11-27: the
    # shipped long-run s/step that `recipes list` shows)
    "sdxl-lora-3gb": (["--recipe", "sdxl-lora-3gb"], "SDXL LoRA r16 b1, block swap of all 87 units, as shipped"),
    "sdxl-full-8gb": (["--recipe", "sdxl-full-8gb"], "SDXL full, Adafactor fused, block swap 43, as shipped"),
    "sdxl-full-12gb": (["--recipe", "sdxl-full-12gb"], "SDXL full, Adafactor fused, checkpointing, as shipped"),
    "sdxl-full": (["--recipe", "sdxl-full"], "SDXL full fine-tune (24 GB), as shipped"),
    "sdxl-full-te-24gb": (["--recipe", "sdxl-full-te-24gb"], "SDXL full with the text encoders, as shipped"),
    "sd3-lora-4gb": (["--recipe", "sd3-lora-4gb"], "SD3-medium LoRA r16, block swap of the 24 blocks, as shipped"),
    "sd3-lora-16gb": (["--recipe", "sd3-lora-16gb"], "SD3-medium LoRA r16, no checkpointing, as shipped"),
    # issue 52: the fast recipe of each new single-stream family against its plain loop, 1024x1024
    "zimage-lora-12gb": (_at_1024("zimage-lora-12gb"), "Z-Image LoRA r32 as shipped"),
    "krea2-lora-24gb": (_at_1024("krea2-lora-24gb"), "Krea 2 LoRA r32 as shipped"),
    # speed.fp8_matmul (opt-in): the fast single-stream recipes with their fp8 base's matmuls in fp8 (issue 52's 1.5x)
    "krea2-lora-24gb-fp8mm": (_at_1024("krea2-lora-24gb", FP8MM), "krea2-lora-24gb with speed.fp8_matmul"),
    "zimage-lora-12gb-fp8mm": (_at_1024("zimage-lora-12gb", FP8MM), "zimage-lora-12gb with speed.fp8_matmul"),
    # a fast Z-Image for a 24 GB card: bf16 weights (no dequantization; speed auto may record CUDA graphs)
    "zimage-lora-bf16": (
        _at_1024("zimage-lora-12gb", "memory.weights.kind=bf16"),
        "zimage-lora-12gb with bf16 weights (planned 16.4 GiB on the card)",
    ),
    "zimage-lora-bf16-ck2": (
        _at_1024("zimage-lora-12gb", "memory.weights.kind=bf16", "memory.activations.every=2"),
        "zimage-lora-12gb with bf16 weights, every second block checkpointed (planned 21.7 GiB)",
    ),
    # no recompute at all (the plain loops checkpoint every block): fp8 weights with the activations kept, Z-Image
    # planned at 22.4 GiB on the card (a 24 GB card), Krea 2 at 42.2 (a 48 GB card); with and without fp8 matmuls
    "zimage-lora-fp8-nock": (
        _at_1024("zimage-lora-12gb", NOCK),
        "zimage-lora-12gb without checkpointing (planned 22.4 GiB on the card)",
    ),
    "zimage-lora-fp8mm-nock": (
        _at_1024("zimage-lora-12gb", NOCK, FP8MM),
        "zimage-lora-12gb without checkpointing, fp8 matmuls",
    ),
    "zimage-lora-fp8-ck2": (
        _at_1024("zimage-lora-12gb", "memory.activations.every=2"),
        "zimage-lora-12gb with every second block checkpointed (planned 16.5 GiB on the card: a 24 GB card)",
    ),
    "krea2-lora-fp8-nock": (
        _at_1024("krea2-lora-24gb", NOCK),
        "krea2-lora-24gb without checkpointing (planned 42.2 GiB on the card)",
    ),
    "krea2-lora-fp8mm-nock": (
        _at_1024("krea2-lora-24gb", NOCK, FP8MM),
        "krea2-lora-24gb without checkpointing, fp8 matmuls",
    ),
    # issue 51: the fast Wan recipes as shipped (bf16, checkpoints on the GPU with the self-attentions' outputs kept)
    "wan-1.3b-lora-24gb": (["--recipe", "wan-1.3b-lora-24gb", "--size", "480x832"], "Wan2.1 1.3B LoRA r32 as shipped"),
    "wan-14b-lora-80gb": (["--recipe", "wan-14b-lora-80gb", "--size", "480x832"], "Wan2.1 14B LoRA r32 as shipped"),
    # issue 52: the fast Z-Image and Krea 2 recipes as shipped (their 1.5x was measured as the -fp8-ck2 and
    # -fp8mm-nock cases on H200s; these read the shipped files, for an H100)
    "zimage-lora-24gb": (_at_1024("zimage-lora-24gb"), "Z-Image LoRA r32 as shipped for a 24 GB card"),
    "krea2-lora-48gb": (_at_1024("krea2-lora-48gb"), "Krea 2 LoRA r32 as shipped for a 48 GB card"),
    # issue 53: Qwen-Image's fast recipe as shipped (int4, no swap) against plain-qwen (bf16 weights, 80 GB card)
    "qwen-image-lora-24gb": (_at_1024("qwen-image-lora-24gb"), "Qwen-Image LoRA r32 as shipped for a 24 GB card"),
    # a fast Qwen-Image for a 48 GB card, as krea2-lora-48gb: fp8 weights, nothing checkpointed (planned 39.6 GiB
    # reserved), with and without fp8 matmuls; bf16 weights with every block checkpointed (planned 44.3)
    "qwen-image-lora-fp8-nock": (
        _at_1024("qwen-image-lora-24gb", "memory.weights.kind=fp8", NOCK),
        "qwen-image-lora-24gb with fp8 weights, nothing checkpointed",
    ),
    "qwen-image-lora-fp8mm-nock": (
        _at_1024("qwen-image-lora-24gb", "memory.weights.kind=fp8", NOCK, FP8MM),
        "qwen-image-lora-24gb with fp8 weights and matmuls, nothing checkpointed",
    ),
    # the fast Qwen-Image recipe as shipped: fp8 weights, every second block checkpointed
    "qwen-image-lora-48gb": (_at_1024("qwen-image-lora-48gb"), "Qwen-Image LoRA r32 as shipped for a 48 GB card"),
    "qwen-image-lora-bf16": (
        _at_1024("qwen-image-lora-24gb", "memory.weights.kind=bf16"),
        "qwen-image-lora-24gb with bf16 weights (every block checkpointed)",
    ),
    # issue 53: FLUX.2 [klein] 9B as shipped and the faster settings a 24 GB card may take, against plain-flux2
    "flux2-klein-9b-lora-16gb": (
        _at_1024("flux2-klein-9b-lora-16gb"),
        "FLUX.2 [klein] 9B LoRA r32 as shipped for a 16 GB card (fp8, checkpointing)",
    ),
    "flux2-klein-9b-lora-fp8-nock": (
        _at_1024("flux2-klein-9b-lora-16gb", "memory.activations.kind=none"),
        "flux2-klein-9b-lora-16gb with nothing checkpointed",
    ),
    "flux2-klein-9b-lora-bf16": (
        _at_1024("flux2-klein-9b-lora-16gb", "memory.weights.kind=bf16"),
        "flux2-klein-9b-lora-16gb with bf16 weights (every block checkpointed)",
    ),
    "flux2-klein-9b-lora-bf16-nock": (
        _at_1024("flux2-klein-9b-lora-16gb", "memory.weights.kind=bf16", "memory.activations.kind=none"),
        "flux2-klein-9b-lora-16gb with bf16 weights and nothing checkpointed",
    ),
    # the faster klein 9B settings a 24-48 GB card may take (the fp8 and bf16 runs of 2026-11-28 reached 1.24x and
    # 1.16x with every block checkpointed or fp8 upcast): fp8 matmuls, every second block checkpointed
    "flux2-klein-9b-lora-fp8mm-nock": (
        _at_1024("flux2-klein-9b-lora-16gb", NOCK, FP8MM),
        "flux2-klein-9b-lora-16gb with fp8 matmuls and nothing checkpointed",
    ),
    "flux2-klein-9b-lora-fp8-ck2": (
        _at_1024("flux2-klein-9b-lora-16gb", "memory.activations.every=2"),
        "flux2-klein-9b-lora-16gb with every second block checkpointed",
    ),
    "flux2-klein-9b-lora-bf16-ck2": (
        _at_1024("flux2-klein-9b-lora-16gb", "memory.weights.kind=bf16", "memory.activations.every=2"),
        "flux2-klein-9b-lora-16gb with bf16 weights, every second block checkpointed",
    ),
    # the klein 9B recipes these cases became (as shipped: an H100's runs read the shipped files)
    "flux2-klein-9b-lora-24gb": (_at_1024("flux2-klein-9b-lora-24gb"), "FLUX.2 [klein] 9B LoRA as shipped for 24 GB"),
    "flux2-klein-9b-lora-48gb": (_at_1024("flux2-klein-9b-lora-48gb"), "FLUX.2 [klein] 9B LoRA as shipped for 48 GB"),
    # FLUX.2 [klein] 4B against plain-flux2-4b: the 8 GB recipe as shipped, and with bf16 weights and nothing
    # checkpointed (a 24 GB card's settings)
    "flux2-klein-4b-lora-8gb": (_at_1024("flux2-klein-4b-lora-8gb"), "FLUX.2 [klein] 4B LoRA r32 as shipped for 8 GB"),
    "flux2-klein-4b-lora-24gb": (
        _at_1024("flux2-klein-4b-lora-24gb"),
        "FLUX.2 [klein] 4B LoRA r32 as shipped for 24 GB",
    ),
    "flux2-klein-4b-lora-bf16-nock": (
        _at_1024("flux2-klein-4b-lora-8gb", "memory.weights.kind=bf16", NOCK),
        "flux2-klein-4b-lora-8gb with bf16 weights and nothing checkpointed",
    ),
    "flux2-klein-4b-lora-fp8mm-nock": (
        _at_1024("flux2-klein-4b-lora-8gb", NOCK, FP8MM),
        "flux2-klein-4b-lora-8gb with fp8 matmuls and nothing checkpointed",
    ),
    # the 4B's bf16 step computes 195 ms of its 300 (2026-11-28 profile): the host between the 25 compiled blocks; the
    # whole transformer as one compiled region (one CUDA graph forward, one backward)
    "flux2-klein-4b-lora-bf16-whole": (
        _at_1024("flux2-klein-4b-lora-8gb", "memory.weights.kind=bf16", NOCK, WHOLE),
        "flux2-klein-4b-lora-8gb with bf16 weights, nothing checkpointed, the whole transformer compiled as one",
    ),
    # issue 53's speed for the models not yet read against a plain loop (2026-12-02): Qwen-Image-Edit (one reference
    # at the target's size: 8 192 image tokens), Qwen-Image 2.1 and FLUX.2 [dev], each as shipped and with the
    # settings of a faster tier (planned on the card: edit fp8-ck 28.6 GiB, fp8-ck2 56.0; 2.1 bf16-ck2 27.5, bf16-nock
    # 38.5; dev fp8-ck 43.3, fp8-ck2 65.5), against plain-qwenedit, plain-qwen21 and plain-flux2dev
    "qwen-image-edit-lora-24gb": (_at_1024("qwen-image-edit-lora-24gb"), "Qwen-Image-Edit-2509 LoRA r32 as shipped"),
    "qwen-image-edit-lora-fp8-ck": (
        _at_1024("qwen-image-edit-lora-24gb", "memory.weights.kind=fp8"),
        "qwen-image-edit-lora-24gb with fp8 weights (a 32 GB card's settings)",
    ),
    "qwen-image-edit-lora-fp8-ck2": (
        _at_1024("qwen-image-edit-lora-24gb", "memory.weights.kind=fp8", "memory.activations.every=2"),
        "qwen-image-edit-lora-24gb with fp8 weights, every second block checkpointed (qwen-image-lora-48gb's settings)",
    ),
    # fp8 weights with every second block checkpointed ran 1.42x plain-qwenedit (2026-12-02, MFU 37.5 %: the weights
    # dequantized on each use, and no CUDA graphs with fp8 storage); bf16 weights and the same checkpoints, shipped as
    # an 80 GB card's recipe after they ran 1.69x capped as the card (card_fit's qe80-bf16-ck2, the same settings)
    "qwen-image-edit-lora-80gb": (
        _at_1024("qwen-image-edit-lora-80gb"),
        "Qwen-Image-Edit-2509 LoRA r32 as shipped for an 80 GB card (bf16, every second block checkpointed)",
    ),
    "qwen-image-2.1-lora-24gb": (_at_1024("qwen-image-2.1-lora-24gb"), "Qwen-Image 2.1 LoRA r32 as shipped"),
    "qwen-image-2.1-lora-bf16-ck2": (
        _at_1024("qwen-image-2.1-lora-24gb", "memory.activations.every=2"),
        "qwen-image-2.1-lora-24gb with every second block checkpointed (a 32 GB card's settings)",
    ),
    "qwen-image-2.1-lora-bf16-nock": (
        _at_1024("qwen-image-2.1-lora-24gb", NOCK),
        "qwen-image-2.1-lora-24gb with nothing checkpointed (a 48 GB card's settings)",
    ),
    "flux2-dev-lora-24gb": (_at_1024("flux2-dev-lora-24gb"), "FLUX.2 [dev] LoRA r32 as shipped (int4, 20 swapped)"),
    "flux2-dev-lora-fp8-ck": (
        _at_1024("flux2-dev-lora-24gb", "memory.weights.kind=fp8", "memory.offload.kind=none"),
        "flux2-dev-lora-24gb with fp8 weights, nothing swapped (a 48 GB card's settings)",
    ),
    "flux2-dev-lora-fp8-ck2": (
        _at_1024(
            "flux2-dev-lora-24gb", "memory.weights.kind=fp8", "memory.offload.kind=none", "memory.activations.every=2"
        ),
        "flux2-dev-lora-24gb with fp8 weights, nothing swapped, every second block checkpointed (an 80 GB card's)",
    ),
    # fp8 weights cost FLUX.2 [klein] more than bf16 ones (their dequantization; 2026-11-28): [dev] in bf16 with every
    # block checkpointed (planned 73.0 GiB on the card: an 80 GB card), in fp8 with fp8 matmuls, and uncapped in bf16
    # with nothing checkpointed (planned 118 GiB: no card of a tier; what the architecture's step can do on an H200)
    "flux2-dev-lora-fp8mm-ck2": (
        _at_1024(
            "flux2-dev-lora-24gb",
            "memory.weights.kind=fp8",
            "memory.offload.kind=none",
            "memory.activations.every=2",
            FP8MM,
        ),
        "flux2-dev-lora-fp8-ck2 with fp8 matmuls",
    ),
    "flux2-dev-lora-bf16-ck": (
        _at_1024("flux2-dev-lora-24gb", "memory.weights.kind=bf16", "memory.offload.kind=none"),
        "flux2-dev-lora-24gb with bf16 weights, nothing swapped, every block checkpointed (an 80 GB card's settings)",
    ),
    "flux2-dev-lora-bf16-nock": (
        _at_1024("flux2-dev-lora-24gb", "memory.weights.kind=bf16", "memory.offload.kind=none", NOCK),
        "flux2-dev-lora-24gb with bf16 weights, nothing swapped or checkpointed (uncapped: 118 GiB planned)",
    ),
    # bf16 with every block checkpointed ran 1.32x plain-flux2dev, fp8 with every second 1.21x (2026-12-02): every second
    # block checkpointed in bf16, shipped as a 96 GB card's recipe (the RTX PRO 6000) after it ran 1.52x capped as the
    # card (card_fit's fdev-96-bf16-ck2, the same settings)
    "flux2-dev-lora-96gb": (
        _at_1024("flux2-dev-lora-96gb"),
        "FLUX.2 [dev] LoRA r32 as shipped for a 96 GB card (bf16, nothing swapped, every second block checkpointed)",
    ),
    # issue 51: Wan's 1.3B and 14B LoRA as shipped against their plain loops, 81 frames of 480x832
    "wan-1.3b-lora-8gb": (["--recipe", "wan-1.3b-lora-8gb", "--size", "480x832"], "Wan2.1 1.3B LoRA r32 as shipped"),
    "wan-14b-lora-24gb": (["--recipe", "wan-14b-lora-24gb", "--size", "480x832"], "Wan2.1 14B LoRA r32 as shipped"),
    # which of the 1.3B's settings cost its step (4.72 s against 3.53 before the attentions' token chunks and the host
    # arena), and the fast 1.3B a plain loop is read against: bf16 weights, whole blocks checkpointed on the GPU
    "wan-1.3b-lora-8gb-nosplit": (
        ["--recipe", "wan-1.3b-lora-8gb", "--size", "480x832", "--set", "memory.activations.split=false"],
        "wan-1.3b-lora-8gb, blocks recomputed whole (no segments, no token chunks)",
    ),
    "wan-1.3b-lora-8gb-onhost": (
        ["--recipe", "wan-1.3b-lora-8gb", "--size", "480x832", "--set", "memory.activations.offload=false"],
        "wan-1.3b-lora-8gb, checkpoints kept on the GPU (no host arena)",
    ),
    "wan-1.3b-lora-bf16": (
        ["--recipe", "wan-1.3b-lora-8gb", "--size", "480x832", *WAN_BF16_ON_GPU],
        "Wan2.1 1.3B LoRA r32, bf16 weights, whole blocks checkpointed on the GPU, AdamW, compiled",
    ),
    "wan-14b-lora-bf16": (
        ["--recipe", "wan-14b-lora-24gb", "--size", "480x832", *WAN_BF16_ON_GPU],
        "Wan2.1 14B LoRA r32, bf16 weights (28 GB: an 80 GB card), whole blocks checkpointed on the GPU: its MFU",
    ),
    # memory.activations.save_attention: the self-attentions' outputs kept, the rest of each block recomputed (the
    # attention is ~70 % of the 1.3B's FLOPs at 32 760 tokens): issue 51's 1.3x
    "wan-1.3b-lora-bf16-sa": (
        [
            "--recipe",
            "wan-1.3b-lora-8gb",
            "--size",
            "480x832",
            *WAN_BF16_ON_GPU,
            "--set",
            "memory.activations.save_attention=true",
        ],
        "wan-1.3b-lora-bf16 with the self-attentions' outputs kept (planned +3 GiB)",
    ),
    "wan-14b-lora-bf16-sa": (
        [
            "--recipe",
            "wan-14b-lora-24gb",
            "--size",
            "480x832",
            *WAN_BF16_ON_GPU,
            "--set",
            "memory.activations.save_attention=true",
        ],
        "wan-14b-lora-bf16 with the self-attentions' outputs kept (planned +13 GiB)",
    ),
}
#: issue 53's cases read against plain-qwenedit, plain-qwen21 and plain-flux2dev (1024x1024, 8 timed after 6)
EDIT_CASES = (
    "qwen-image-edit-lora-24gb",
    "qwen-image-edit-lora-fp8-ck",
    "qwen-image-edit-lora-fp8-ck2",
    "qwen-image-edit-lora-80gb",
)
Q21_CASES = ("qwen-image-2.1-lora-24gb", "qwen-image-2.1-lora-bf16-ck2", "qwen-image-2.1-lora-bf16-nock")
DEV_CASES = (
    "flux2-dev-lora-24gb",
    "flux2-dev-lora-fp8-ck",
    "flux2-dev-lora-fp8-ck2",
    "flux2-dev-lora-fp8mm-ck2",
    "flux2-dev-lora-bf16-ck",
    "flux2-dev-lora-96gb",
    "flux2-dev-lora-bf16-nock",
)
#: the plain loop each case is read against where its name does not say (the part before the first "-")
PLAIN_OF = {
    "wan-14b-lora-24gb": "plain-wan14",
    "wan-14b-lora-bf16": "plain-wan14",
    "wan-14b-lora-bf16-sa": "plain-wan14",
    "wan-14b-lora-80gb": "plain-wan14",
    **dict.fromkeys(EDIT_CASES, "plain-qwenedit"),
    **dict.fromkeys(Q21_CASES, "plain-qwen21"),
    **dict.fromkeys(DEV_CASES, "plain-flux2dev"),
}
#: cases at their own --size without difftrain's eager run beside them: name -> (steps, warm-up)
OWN_SIZE = {
    "wan-1.3b-lora-8gb-nosplit": (4, 3),
    "qwen-image-lora-24gb": (8, 6),
    "zimage-lora-24gb": (10, 6),
    "krea2-lora-48gb": (8, 6),
    "qwen-image-lora-fp8-nock": (8, 6),
    "qwen-image-lora-fp8mm-nock": (8, 6),
    "qwen-image-lora-bf16": (8, 6),
    "qwen-image-lora-48gb": (8, 6),
    "wan-1.3b-lora-24gb": (4, 3),
    "wan-14b-lora-80gb": (3, 2),
    "wan-1.3b-lora-8gb-onhost": (4, 3),
    "wan-1.3b-lora-bf16": (4, 3),
    "wan-14b-lora-bf16": (3, 2),
    "wan-1.3b-lora-bf16-sa": (4, 3),
    "wan-14b-lora-bf16-sa": (3, 2),
    "wan-14b-lora-24gb": (3, 2),  # its eager run beside it took ~5 minutes of a 10-minute call (2026-11-28)
    "zimage-lora-bf16": (10, 6),
    "zimage-lora-bf16-ck2": (10, 6),
    "zimage-lora-12gb-fp8mm": (10, 6),
    "krea2-lora-24gb-fp8mm": (8, 6),
    "zimage-lora-fp8-nock": (10, 6),
    "zimage-lora-fp8-ck2": (10, 6),
    "zimage-lora-fp8mm-nock": (10, 6),
    "krea2-lora-fp8-nock": (8, 6),
    "krea2-lora-fp8mm-nock": (8, 6),
    "flux2-klein-9b-lora-16gb": (8, 6),
    "flux2-klein-9b-lora-fp8-nock": (8, 6),
    "flux2-klein-9b-lora-bf16": (8, 6),
    "flux2-klein-9b-lora-bf16-nock": (8, 6),
    "flux2-klein-9b-lora-fp8mm-nock": (8, 6),
    "flux2-klein-9b-lora-fp8-ck2": (8, 6),
    "flux2-klein-9b-lora-bf16-ck2": (8, 6),
    "flux2-klein-4b-lora-8gb": (8, 6),
    "flux2-klein-9b-lora-24gb": (8, 6),
    "flux2-klein-9b-lora-48gb": (8, 6),
    "flux2-klein-4b-lora-bf16-nock": (8, 6),
    "flux2-klein-4b-lora-24gb": (8, 6),
    "flux2-klein-4b-lora-fp8mm-nock": (8, 6),
    "flux2-klein-4b-lora-bf16-whole": (8, 6),
    **dict.fromkeys(EDIT_CASES + Q21_CASES + DEV_CASES, (8, 6)),
}
#: cases timed beside difftrain's own eager run of the same recipe (no plain loop of these families here), and
#: CogVideoX's one frame bucket with fewer steps (~1 s each eager): name -> (buckets, steps, warm-up) overrides
WITH_BASELINE = {
    "sd3-lora-8gb": (BUCKETS, None, None),
    "cogvideox-2b-lora-24gb": (None, 6, 4),
    "flux-lora-24gb": (None, 8, 6),
    "zimage-lora-12gb": (None, 10, 6),
    "krea2-lora-24gb": (None, 8, 6),
    "wan-1.3b-lora-8gb": (None, 4, 3),
}
#: --steady: difftrain's steps timed without a read-back after each (training's own rhythm: speed.sync_seconds)
STEADY = False
#: torch's total capacity of an H100 80GB HBM3 (what its out-of-memory messages give, GiB): --plain-as-h100 leaves a
#: plain loop this less the H100's stored CUDA context and libraries (memory/card_overhead.json), no display margin
H100_GIB = 79.11
#: --profile: the folder the profiled step's operator tables go to (None: no profiling)
PROFILE: Path | None = None
#: the plain loops of the transformer families: name -> (steps, warm-up) overrides (None: the command line's)
PLAIN_DIT = {
    "plain-sd3": (None, None),
    "plain-cogvideox": (6, 4),
    "plain-flux": (8, 3),
    "plain-zimage": (10, 3),
    "plain-krea2": (8, 3),
    "plain-qwen": (8, 3),
    "plain-flux2": (8, 3),
    "plain-flux2-4b": (8, 3),
    "plain-qwenedit": (8, 3),
    "plain-qwen21": (8, 3),
    "plain-flux2dev": (8, 3),
    "plain-wan": (4, 3),
    "plain-wan14": (3, 2),
}


def _plain_loop(name, model, targets, rank, shapes, loss_of, steps: int, warmup: int, seed: int = 0) -> dict:
    """The plain loops' shared part: ``model`` (bf16 on the GPU) frozen with diffusers' checkpointing, fp32 LoRA
    (peft) of ``rank`` on ``targets``, fp32 AdamW; each step draws a shape of ``shapes`` (each twice an epoch, in
    random order) and trains on ``loss_of(model, *shape)``, with a ``.item()`` and a sync, timed one by one."""
    import torch
    from peft import LoraConfig

    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4)
    order = [b for b in shapes for _ in range(2)]
    rng = random.Random(seed)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []

    def one(i: int) -> float:
        if i % len(order) == 0:
            rng.shuffle(order)
        shape = order[i % len(order)]
        t = time.time()
        loss = loss_of(model, *shape)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        torch.cuda.synchronize()
        return time.time() - t

    for i in range(warmup + steps):
        times.append(one(i))
    timed = times[warmup:]
    profiled = None
    if PROFILE is not None:  # two more steps: the profiler's warm-up, then the profiled one (as bench speed does)
        from torch.profiler import ProfilerActivity, profile, schedule

        from difftrain.flows.bench import _profile_summary

        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        # repeat=1: with wait=0 a second cycle would start recording at once, and the table read after the block
        # would be that empty cycle's (the plain loops' profiles held only a synchronize so, 2026-11-26)
        with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
            for i in range(warmup + steps, warmup + steps + 2):
                dt = one(i)
                prof.step()
        profiled = {**_profile_summary(prof, PROFILE / f"profile-{name}.txt"), "step_ms": round(dt * 1e3, 1)}
    return {
        "profile": profiled,
        "case": name,
        "s_per_step": round(sum(timed) / len(timed), 4),
        "s_per_step_median": round(statistics.median(timed), 4),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        "first_step_s": round(times[0], 2),
        "step_s": [round(t, 4) for t in times],
        "warmup": warmup,
    }


def _bundled(name: str, cls, device: str = "cuda"):
    """A random model of a bundled architecture config, bf16 on the GPU (seeded). Made in bf16, as a checkpoint loads
    in bf16: made in float32 first, a 20 B model took 76 GiB for a moment, past what --plain-as-h100 leaves."""
    import torch

    here = Path(__file__).resolve().parents[1] / "src/difftrain/families/configs"
    cfg = {k: v for k, v in json.loads((here / name / "config.json").read_text()).items() if not k.startswith("_")}
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = cls.from_config(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.to(torch.bfloat16)


def plain_sdxl(steps: int, warmup: int, seed: int = 0) -> dict:
    """Plain diffusers/peft/torch SDXL LoRA loop (no difftrain code in the step), bf16 UNet, checkpointing,
    LoRA r16 on the attention projections, fp32 AdamW: memory_tiers.py's E-lora over the six buckets."""
    import torch
    from diffusers import UNet2DConditionModel

    bf = {"device": "cuda", "dtype": torch.bfloat16}

    def loss_of(unet, h: int, w: int):
        x = torch.randn(1, 4, h // 8, w // 8, **bf)
        enc = torch.randn(1, 77, 2048, **bf)
        added = {"text_embeds": torch.randn(1, 1280, **bf), "time_ids": torch.tensor([[h, w, 0, 0, h, w]], **bf)}
        ts = torch.randint(0, 1000, (1,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = unet(x, ts, encoder_hidden_states=enc, added_cond_kwargs=added).sample
        return torch.nn.functional.mse_loss(pred.float(), x.float())

    unet = _bundled("sdxl-base-1.0/unet", UNet2DConditionModel)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    return _plain_loop("plain-sdxl", unet, targets, 16, SIX, loss_of, steps, warmup, seed)


def plain_dit(name: str, steps: int, warmup: int, seed: int = 0) -> dict:
    """Plain diffusers/peft/torch LoRA loop of a transformer family, no difftrain code in the step: the recipe's
    set-up (bf16 transformer, diffusers' checkpointing, fp32 LoRA on its targets, fp32 AdamW, a ``.item()`` each
    step), random inputs of the cache's shapes. plain-sd3: sd3-lora-8gb over the six buckets (r16, the joint
    attention's both streams); plain-cogvideox: cogvideox-2b-lora-24gb at 49x480x720 (r64)."""
    import torch

    bf = {"device": "cuda", "dtype": torch.bfloat16}

    def sd3_loss(model, c: int, h: int, w: int):
        x0, noise = torch.randn(1, c, h, w, **bf), torch.randn(1, c, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = ((1 - sig) * x0 + sig * noise).to(torch.bfloat16)
        enc, pooled = torch.randn(1, 333, 4096, **bf), torch.randn(1, 2048, **bf)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(
                hidden_states=xt, encoder_hidden_states=enc, pooled_projections=pooled, timestep=sig * 1000
            ).sample
        return torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())

    def cog_loss(model, c: int, h: int, w: int):
        x0 = torch.randn(1, 13, c, h, w, **bf)
        enc, ts = torch.randn(1, 226, 4096, **bf), torch.randint(0, 1000, (1,)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(hidden_states=x0, encoder_hidden_states=enc, timestep=ts).sample
        return torch.nn.functional.mse_loss(pred.float(), x0.float())

    def flux_loss(model, c: int, h: int, w: int):
        from diffusers import FluxPipeline

        x0, noise = torch.randn(1, c, h, w, **bf), torch.randn(1, c, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = FluxPipeline._pack_latents(((1 - sig) * x0 + sig * noise).to(torch.bfloat16), 1, c, h, w)
        enc, pooled = torch.randn(1, 512, 4096, **bf), torch.randn(1, 768, **bf)
        img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cuda", torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(hidden_states=xt, encoder_hidden_states=enc, pooled_projections=pooled, timestep=sig,
                         img_ids=img_ids, txt_ids=torch.zeros(512, 3, **bf), guidance=torch.ones(1, device="cuda"),
                         ).sample  # fmt: skip
        return torch.nn.functional.mse_loss(pred.float(), FluxPipeline._pack_latents((noise - x0), 1, c, h, w).float())

    def zimage_loss(model, c: int, h: int, w: int):
        # ZImagePipeline's call: lists of [16, 1, h, w] latents and of caption states, the reversed timestep 1 - sigma;
        # the model predicts x0 - noise (the pipeline negates it)
        x0, noise = torch.randn(1, c, h, w, **bf), torch.randn(1, c, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = ((1 - sig) * x0 + sig * noise).to(torch.bfloat16)
        cap = torch.randn(128, 2560, **bf)  # a caption of 128 Qwen3 tokens (bench speed's cache shape)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(list(xt.unsqueeze(2).unbind(0)), 1 - sig, [cap], return_dict=False)[0]
        return torch.nn.functional.mse_loss(-torch.stack(out).squeeze(2).float(), (noise - x0).float())

    def krea2_loss(model, c: int, h: int, w: int):
        from diffusers import FluxPipeline, Krea2Pipeline

        def pack(x):  # the 2x2 patches Krea2Pipeline._pack_latents makes (Flux's static one, the same packing)
            return FluxPipeline._pack_latents(x, 1, c, h, w)

        x0, noise = torch.randn(1, c, h, w, **bf), torch.randn(1, c, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = ((1 - sig) * x0 + sig * noise).to(torch.bfloat16)
        text = torch.randn(1, 128, 12, 2560, **bf)  # 12 Qwen3-VL layers of a 128-token caption, no padding
        ids = Krea2Pipeline.prepare_position_ids(128, h // 2, w // 2, "cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(hidden_states=pack(xt), encoder_hidden_states=text, timestep=sig.to(torch.bfloat16),
                         position_ids=ids, return_dict=False)[0]  # fmt: skip
        return torch.nn.functional.mse_loss(pred.float(), pack(noise - x0).float())

    def flux2_loss(model, c: int, h: int, w: int):
        # Flux2KleinPipeline's call: the 32-channel latents' 2x2 patches ([B, 128, h, w] at 1/16), one token a patch
        # with the pipeline's 4-axis ids, sigma as the timestep, Qwen3's three layers of 512 tokens; no guidance
        from diffusers import Flux2Pipeline

        x0, noise = torch.randn(1, c, h, w, **bf), torch.randn(1, c, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = ((1 - sig) * x0 + sig * noise).to(torch.bfloat16)
        text = torch.randn(1, 512, model.config.joint_attention_dim, **bf)
        # [dev] is guidance-distilled: Flux2Pipeline passes its guidance value (the recipes' flow.guidance_scale 1.0)
        guidance = torch.ones(1, device="cuda") if model.config.guidance_embeds else None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(hidden_states=Flux2Pipeline._pack_latents(xt), timestep=sig.to(torch.bfloat16),
                         encoder_hidden_states=text, txt_ids=Flux2Pipeline._prepare_text_ids(text).to("cuda"),
                         img_ids=Flux2Pipeline._prepare_latent_ids(xt).to("cuda"), guidance=guidance,
                         return_dict=False)[0]  # fmt: skip
        return torch.nn.functional.mse_loss(pred.float(), Flux2Pipeline._pack_latents(noise - x0).float())

    def qwen_loss(model, c: int, h: int, w: int, refs: int = 0):
        # QwenImagePipeline's call: packed 2x2 patches, the grid as img_shapes, sigma as the timestep, the text mask.
        # With ``refs`` (plain-qwenedit), QwenImageEditPlusPipeline's: each reference's patches after the noisy
        # target's (at the target's size, as training fits them to the bucket), img_shapes every grid, the loss on the
        # target's tokens of the output
        from diffusers import QwenImagePipeline

        def pack(x):
            return QwenImagePipeline._pack_latents(x, 1, c, h, w)

        x0, noise = torch.randn(1, c, h, w, **bf), torch.randn(1, c, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = ((1 - sig) * x0 + sig * noise).to(torch.bfloat16)
        # Qwen2.5-VL's last hidden state of a 128-token caption (or instruction: bench speed's cache)
        text = torch.randn(1, 128, model.config.joint_attention_dim, **bf)
        mask = torch.ones(1, 128, dtype=torch.long, device="cuda")
        tokens = torch.cat([pack(xt)] + [pack(torch.randn(1, c, h, w, **bf)) for _ in range(refs)], dim=1)
        grid = (1, h // 2, w // 2)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(hidden_states=tokens, timestep=sig.to(torch.bfloat16), encoder_hidden_states=text,
                         encoder_hidden_states_mask=mask, img_shapes=[[grid] * (1 + refs)], return_dict=False)[0]  # fmt: skip
        return torch.nn.functional.mse_loss(pred[:, : grid[1] * grid[2]].float(), pack(noise - x0).float())

    def qwen21_loss(model, c: int, h: int, w: int):
        # QwenImage21Pipeline's call for a prompt: the 64-channel latents unpatched (one token a latent pixel),
        # img_mask False over the caption's rows and one True slot per 2x2 target tokens after (append_target_slots),
        # the latent grid as img_shapes, sigma as the timestep; the target's tokens are the output's last ones
        from diffusers import QwenImage21Pipeline

        def pack(x):
            return QwenImage21Pipeline._pack_latents(x, 1, c, h, w)

        x0, noise = torch.randn(1, c, h, w, **bf), torch.randn(1, c, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = ((1 - sig) * x0 + sig * noise).to(torch.bfloat16)
        text = torch.randn(1, 128, model.config.context_in_dim, **bf)  # Qwen3-VL's states of a 128-token caption
        img_mask = torch.cat([torch.zeros(1, 128, dtype=torch.bool), torch.ones(1, h * w // 4, dtype=torch.bool)], 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(hidden_states=pack(xt), timestep=sig.to(torch.bfloat16), encoder_hidden_states=text,
                         img_shapes=[[(1, h, w)]], img_mask=img_mask.cuda(), return_dict=False)[0]  # fmt: skip
        return torch.nn.functional.mse_loss(pred[:, -h * w :].float(), pack(noise - x0).float())

    def wan_loss(model, c: int, f: int, h: int, w: int):
        # WanPipeline's call: the latent video [B, 16, F, H, W], sigma * 1000 as the timestep, UMT5's 512 tokens;
        # the model predicts noise - x0
        x0, noise = torch.randn(1, c, f, h, w, **bf), torch.randn(1, c, f, h, w, **bf)
        sig = torch.rand(1, device="cuda")
        xt = ((1 - sig) * x0 + sig * noise).to(torch.bfloat16)
        text = torch.randn(1, 512, 4096, **bf)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(hidden_states=xt, timestep=sig * 1000, encoder_hidden_states=text, return_dict=False)[0]
        return torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())

    if name in ("plain-wan", "plain-wan14"):
        from diffusers import WanTransformer3DModel

        from difftrain.families.wan import Wan  # the recipe's targets (a list of names, not step code)

        arch = "wan2.1-t2v-14b" if name == "plain-wan14" else "wan2.1-t2v-1.3b"
        model = _bundled(f"{arch}/transformer", WanTransformer3DModel)
        shape = (16, 21, 60, 104)  # 81 frames of 480x832 through Wan2.1's VAE (4x temporal, 8x spatial)
        return _plain_loop(name, model, list(Wan.default_lora_targets), 32, [shape], wan_loss, steps, warmup)
    if name in ("plain-qwen", "plain-qwenedit"):
        from diffusers import QwenImageTransformer2DModel

        from difftrain.families.qwenimage import QwenImage  # the recipe's targets (a list of names, not step code)

        arch, refs = ("qwen-image", 0) if name == "plain-qwen" else ("qwen-image-edit-2509", 1)
        model = _bundled(f"{arch}/transformer", QwenImageTransformer2DModel)
        return _plain_loop(
            name, model, list(QwenImage.default_lora_targets), 32, [(16, 128, 128, refs)], qwen_loss, steps, warmup
        )
    if name == "plain-qwen21":
        from diffusers import QwenImage21Transformer2DModel

        from difftrain.config.load import resolve  # the recipe's targets (a list of names, not step code)

        model = _bundled("qwen-image-2.1/transformer", QwenImage21Transformer2DModel)
        targets = list(resolve("qwen-image-2.1-lora-24gb", None, []).config.lora.targets)
        return _plain_loop(name, model, targets, 32, [(64, 64, 64)], qwen21_loss, steps, warmup)
    if name in ("plain-flux2", "plain-flux2-4b", "plain-flux2dev"):
        from diffusers import Flux2Transformer2DModel

        from difftrain.config.load import resolve  # the recipe's targets (a list of names, not step code)

        arch, recipe = {
            "plain-flux2-4b": ("flux2-klein-4b", "flux2-klein-4b-lora-8gb"),
            "plain-flux2": ("flux2-klein-9b", "flux2-klein-9b-lora-16gb"),
            "plain-flux2dev": ("flux2-dev", "flux2-dev-lora-24gb"),
        }[name]
        model = _bundled(f"{arch}/transformer", Flux2Transformer2DModel)
        targets = list(resolve(recipe, None, []).config.lora.targets)
        return _plain_loop(name, model, targets, 32, [(128, 64, 64)], flux2_loss, steps, warmup)
    if name == "plain-zimage":
        from diffusers import ZImageTransformer2DModel

        model = _bundled("z-image/transformer", ZImageTransformer2DModel)
        from difftrain.families.zimage import ZImage  # the recipe's targets (a list of names, not step code)

        return _plain_loop(
            name, model, list(ZImage.default_lora_targets), 32, [(16, 128, 128)], zimage_loss, steps, warmup
        )
    if name == "plain-krea2":
        from diffusers import Krea2Transformer2DModel

        model = _bundled("krea2/transformer", Krea2Transformer2DModel)
        from difftrain.families.krea2 import Krea2  # the recipe's targets (a list of names, not step code)

        return _plain_loop(
            name, model, list(Krea2.default_lora_targets), 32, [(16, 128, 128)], krea2_loss, steps, warmup
        )
    if name == "plain-flux":
        from diffusers import FluxTransformer2DModel

        # the diffusers Flux LoRA script's way: bf16 transformer on the GPU, checkpointing; our recipe's targets.
        # cuDNN's attention off: with torch's default choice this loop's backward hit an illegal memory access at
        # 4 608 tokens (H100, torch 2.11 + CUDA 13, 2026-11-25), the failure the Flux family avoids (avoid_cudnn)
        torch.backends.cuda.enable_cudnn_sdp(False)
        model = _bundled("flux-dev/transformer", FluxTransformer2DModel)
        targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                   "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                   *[f"single_transformer_blocks.{i}.proj_out" for i in range(38)]]  # fmt: skip
        return _plain_loop(name, model, targets, 16, [(16, 128, 128)], flux_loss, steps, warmup)
    if name == "plain-sd3":
        from diffusers import SD3Transformer2DModel

        model = _bundled("sd3-medium/transformer", SD3Transformer2DModel)
        targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
        return _plain_loop(name, model, targets, 16, [(16, h // 8, w // 8) for h, w in SIX], sd3_loss, steps, warmup)
    from diffusers import CogVideoXTransformer3DModel

    model = _bundled("cogvideox-2b/transformer", CogVideoXTransformer3DModel)
    return _plain_loop(name, model, ["to_q", "to_k", "to_v", "to_out.0"], 64, [(16, 60, 90)], cog_loss, steps, warmup)


def run_case(name: str, args: list[str], work: Path, steps: int, warmup: int, timeout: float) -> dict:
    folder = work / (name if name.startswith("wan") else name.split("-lora")[0])  # one random model a family
    buckets: str | None = BUCKETS
    cmd = [sys.executable, "-m", "difftrain", "bench", "speed", *args, "--planned-steps", "2000"]
    cmd += ["--step-times"] if not STEADY else []
    if name in WITH_BASELINE:
        buckets, steps_, warmup_ = WITH_BASELINE[name]
        steps, warmup = steps_ or steps, warmup_ or warmup
    elif name in OWN_SIZE:
        buckets, (steps, warmup) = None, OWN_SIZE[name]
        cmd.append("--no-baseline")
    else:
        cmd.append("--no-baseline")
    if "--size" in args:  # a case at its own size takes no buckets (bench speed refuses both: exit code 2)
        buckets = None
    if buckets:
        cmd += ["--buckets", buckets]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--work", str(folder)]
    if PROFILE is not None:
        cmd.append("--profile")
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    res = json.loads((folder / "bench_speed.json").read_text()) if p.returncode == 0 else {}
    row = res.get("rows", [{}])[-1]
    if PROFILE is not None:  # bench speed's operator tables (one per run), under this case's name
        for f in sorted(folder.glob("profile-*.txt")):
            (PROFILE / f"profile-{name}-{f.stem.removeprefix('profile-')}.txt").write_text(f.read_text())
            f.unlink()
    return {
        "case": name,
        "rc": p.returncode,
        "wall_s": round(time.time() - t, 1),
        **{k: row.get(k) for k in ("s_per_step", "first_step_s", "warmup_overhead_s", "peak_alloc_gib", "speed")},
        "peak_reserved_gib": row.get("peak_reserved_gib"),
        "compile": row.get("compile"),
        "mfu": row.get("mfu"),
        "step_s": row.get("step_s"),
        "sync_each_step": not STEADY,
        "warmup": warmup,
        "eager_s_per_step": res["rows"][0]["s_per_step"] if len(res.get("rows", [])) == 2 else None,
        "profile": row.get("profile"),
        "log_tail": (p.stdout + p.stderr)[-3000:] if p.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default="plain-sdxl,sdxl-lora-8gb,sdxl-lora-4gb,sdxl-lora-8gb-off")
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-fast"))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="one more step of each case under torch.profiler")
    ap.add_argument(
        "--steady",
        action="store_true",
        help="difftrain's cases read back only after the warm-up and the last step (as training reads every "
        "speed.sync_seconds), not after every step: no median then",
    )
    ap.add_argument(
        "--plain-as-h100",
        action="store_true",
        help="the plain loops with torch's allocator capped as an H100 80GB leaves it (issue 53's speed is against "
        "a plain loop where that loop fits an H100): an out-of-memory error there says it does not",
    )
    a = ap.parse_args()
    global PROFILE, STEADY
    STEADY = a.steady
    PROFILE = a.out if a.profile else None
    if PROFILE is not None:
        PROFILE.mkdir(parents=True, exist_ok=True)
    if a.case == "plain-sdxl":
        print("RESULT " + json.dumps(plain_sdxl(a.steps, a.warmup)), flush=True)
        return
    if a.case in PLAIN_DIT:
        if a.plain_as_h100:  # before the model is built: an out-of-memory error is the answer "does not fit"
            import torch

            from difftrain.memory.card import allocator_budget, stored_overhead
            from difftrain.utils import cap_gpu_memory

            cap_gpu_memory(torch.device("cuda"), allocator_budget(H100_GIB, stored_overhead("H100"), display=False))
        steps, warmup = PLAIN_DIT[a.case]
        print("RESULT " + json.dumps(plain_dit(a.case, steps or a.steps, warmup or a.warmup)), flush=True)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    t0, rows, failures = time.time(), [], []
    for name in a.cases.split(","):
        left = a.budget - (time.time() - t0)
        if left < 45:
            rows.append({"case": name, "rc": "not run (time)"})
            continue
        try:
            if name == "plain-sdxl" or name in PLAIN_DIT:
                cmd = [sys.executable, __file__, "--out", str(a.out), "--case", name] + ["--profile"] * a.profile
                cmd += ["--plain-as-h100"] * a.plain_as_h100
                p = subprocess.run(
                    cmd + ["--steps", str(a.steps), "--warmup", str(a.warmup)],
                    capture_output=True,
                    text=True,
                    timeout=left,
                )
                got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                row = (
                    json.loads(got[-1][7:]) if got else {"case": name, "rc": p.returncode, "log_tail": p.stderr[-3000:]}
                )
            else:
                row = run_case(name, CASES[name][0], a.work, a.steps, a.warmup, left)
        except subprocess.TimeoutExpired:
            row = {"case": name, "rc": "timeout"}
        if row.get("log_tail"):
            failures.append(f"===== {name}\n{row.pop('log_tail')}\n")
        rows.append(row)
        print(json.dumps(row), flush=True)
        (a.out / "fast_default.json").write_text(json.dumps(rows, indent=1) + "\n")
        (a.out / "failures.log").write_text("".join(failures))
    plains = {r["case"].split("-")[1]: r.get("s_per_step") for r in rows if r["case"].startswith("plain-")}
    print(
        "\n| case | s/step | timed median | vs plain | step 1 s | warm-up extra s | peak alloc / reserved GiB | speed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r.get("s_per_step")
        key = PLAIN_OF.get(r["case"], r["case"]).removeprefix("plain-").split("-")[0]
        plain = None if r["case"].startswith("plain-") else plains.get(key)
        vs = f"{plain / s:.2f}x the plain loop" if s and plain else ""
        if s and r.get("eager_s_per_step"):
            vs += f"; {r['eager_s_per_step'] / s:.2f}x its eager run ({r['eager_s_per_step']})"
        med = round(statistics.median(r["step_s"][r.get("warmup", a.warmup) :]), 4) if r.get("step_s") else ""
        print(
            f"| {r['case']} | {s if s else r.get('rc')} | {med} | {vs} | {r.get('first_step_s', '')} | "
            f"{r.get('warmup_overhead_s', '')} | {r.get('peak_alloc_gib', '')} / {r.get('peak_reserved_gib', '')} | "
            f"{(r.get('speed') or '')[:150]} |"
        )
    print_profiles(rows)


def print_profiles(rows: list[dict]) -> None:
    """The profiled step of each case that has one: wall, GPU-busy, launches and the largest kernel kinds."""
    prof = [r for r in rows if r.get("profile")]
    if not prof:
        return
    print("\n| case | profiled step ms | GPU busy ms | kernel launches | graph launches | GPU time by kind |")
    print("|---|---|---|---|---|---|")
    for r in prof:
        p = r["profile"]
        kinds = ", ".join(f"{k} {v['ms']:.1f}" for k, v in list(p.get("by_kind", {}).items())[:4])
        print(
            f"| {r['case']} | {p.get('step_ms')} | {p.get('gpu_ms')} | {p.get('kernel_launches')} | "
            f"{p.get('graph_launches')} | {kinds} |"
        )


if __name__ == "__main__":
    main()
