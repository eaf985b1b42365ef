"""Memory and step time of difftrain configs of any family, through `difftrain bench memory`'s code path,
beside an eager plain-PyTorch baseline measured in the same run.

Random weights of the full-size bundled architecture, a synthetic cache of the real shapes, 6 steps a
case, each case in a fresh subprocess (clean CUDA state). Prints a table last; JSON under --out.

    python benchmarks/family_memory.py --work /tmp/fam --out $OUT [--cases E-sd3,S1,S4]
    python benchmarks/family_memory.py --work /tmp/fam --out $OUT --cases E-wan,W1,W2,W3,W4   # Wan (issue 51)
    DIFFTRAIN_BENCH_TINY=1 python benchmarks/family_memory.py --work /tmp/fam   # CPU smoke run, tiny models
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import sdxl_full as sf

TINY = os.environ.get("DIFFTRAIN_BENCH_TINY") == "1"
SD3 = ["train.device=cuda", "train.batch_size=1", "data.resolution=1024", "lora.rank=16", "train.mixed_precision=bf16"]
COG = [
    "train.device=cuda",
    "train.batch_size=1",
    "data.resolution=592",
    "data.bucket_step=16",
    "data.frames=49",
    "lora.rank=64",
    "lora.alpha=64",
    "train.mixed_precision=bf16",
    "memory.weights.kind=bf16",
    "memory.activations.kind=checkpoint",
    "train.learning_rate=1e-4",
    "train.checkpoint_every=100000",
]
#: Wan (issue 51): 81 frames of 480x832 (data.resolution 640: the planner's square of about that area), LoRA r32 on
#: every Linear of the blocks (musubi-tuner's and diffusion-pipe's targets), bf16
WAN = [
    "family=wan",
    "train.device=cuda",
    "train.batch_size=1",
    "data.resolution=640",
    "data.min_side=256",
    "data.max_side=1280",
    "data.frames=81",
    "lora.rank=32",
    "lora.alpha=32",
    "lora.targets=[to_q, to_k, to_v, to_out.0, ffn.net.0.proj, ffn.net.2]",
    "train.mixed_precision=bf16",
    "memory.weights.kind=bf16",
    "memory.activations.kind=checkpoint",
    "train.learning_rate=1e-4",
    "train.checkpoint_every=100000",
]
SIZE = {
    "C": (480, 720),
    "W": (480, 832),
}  # CogVideoX: 49x480x720 clips (the planner assumes 592^2, +1.4 %); Wan 81x480x832
CASES = {
    "S1": ("SD3-medium LoRA r16, bf16, checkpointing (sd3-lora-8gb)", "sd3-lora-8gb", SD3),
    "S2": ("SD3-medium LoRA r16, bf16, no checkpointing", "sd3-lora-8gb", SD3 + ["memory.activations.kind=none"]),
    "S3": ("SD3-medium LoRA r16, fp8 weights, checkpointing", "sd3-lora-8gb", SD3 + ["memory.weights={kind: fp8}"]),
    "S4": ("SD3-medium LoRA r16, bf16, checkpointing, block swap 24 of 24 (sd3-lora-4gb)", "sd3-lora-4gb", SD3),
    "S5": (
        "SD3-medium full, bf16, CPU-offload AdamW, checkpointing, block swap 24",
        "sd3-lora-8gb",
        SD3
        + [
            "train.method=full",
            "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
            "train.max_grad_norm=null",
            "memory.offload={kind: block_swap, blocks_to_swap: 24}",
        ],
    ),
    "C1": ("CogVideoX-2b LoRA r64, bf16, checkpointing", None, COG + ["family=cogvideox", "model.config=cogvideox-2b"]),
    "C2": ("CogVideoX-5b LoRA r64, bf16, checkpointing", None, COG + ["family=cogvideox", "model.config=cogvideox-5b"]),
    "C3": (
        "CogVideoX-2b LoRA r64, bf16, checkpointing, block swap 30 of 30",
        None,
        COG
        + ["family=cogvideox", "model.config=cogvideox-2b", "memory.offload={kind: block_swap, blocks_to_swap: 30}"],
    ),
    "C4": (
        "CogVideoX-5b LoRA r64, bf16, checkpointing, block swap 42 of 42",
        None,
        COG
        + ["family=cogvideox", "model.config=cogvideox-5b", "memory.offload={kind: block_swap, blocks_to_swap: 42}"],
    ),
    "C5": (
        "CogVideoX-5b full, bf16, CPU-offload AdamW, checkpointing, block swap 42",
        None,
        COG
        + [
            "family=cogvideox",
            "model.config=cogvideox-5b",
            "train.method=full",
            "train.learning_rate=1e-5",
            "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
            "train.max_grad_norm=null",
            "memory.offload={kind: block_swap, blocks_to_swap: 42}",
        ],
    ),
    "C6": (
        "CogVideoX-5b-I2V LoRA r64, bf16, checkpointing",
        None,
        COG + ["family=cogvideox-i2v", "model.config=cogvideox-5b-i2v"],
    ),
    "W1": ("Wan2.1-1.3B LoRA r32, bf16, checkpointing", "tiny-wan-lora", WAN + ["model.config=wan2.1-t2v-1.3b"]),
    "W2": (
        "Wan2.1-1.3B LoRA r32, bf16, split checkpoints",
        "tiny-wan-lora",
        WAN + ["model.config=wan2.1-t2v-1.3b", "memory.activations={kind: checkpoint, split: true}"],
    ),
    "W3": (
        "Wan2.1-1.3B LoRA r32, fp8, split checkpoints offloaded",
        "tiny-wan-lora",
        WAN
        + [
            "model.config=wan2.1-t2v-1.3b",
            "memory.weights={kind: fp8}",
            "memory.activations={kind: checkpoint, split: true, offload: true}",
        ],
    ),
    "W4": (
        "Wan2.1-14B LoRA r32, fp8, split checkpoints offloaded",
        "tiny-wan-lora",
        WAN
        + [
            "model.config=wan2.1-t2v-14b",
            "memory.weights={kind: fp8}",
            "memory.activations={kind: checkpoint, split: true, offload: true}",
        ],
    ),
}


def _tiny(recipe: str | None, sets: list[str]) -> tuple[str, list[str]]:
    if "family=wan" in sets:
        drop = ("model.config", "resolution=", "frames=", "min_side", "max_side", "family=", "fp8")
        sets = [s.replace("=cuda", "=cpu").replace("mixed_precision=bf16", "mixed_precision=no")
                .replace("weights.kind=bf16", "weights.kind=fp32") for s in sets if not any(d in s for d in drop)]  # fmt: skip
        return "tiny-wan-lora", sets
    video = any("cogvideox" in s for s in sets)
    drop = ("cpu_offload", "max_grad_norm", "model.config", "resolution=", "frames=", "family=", "block_swap")
    sets = [
        s.replace("=cuda", "=cpu")
        .replace("mixed_precision=bf16", "mixed_precision=no")
        .replace("weights.kind=bf16", "weights.kind=fp32")
        for s in sets
        if not any(d in s for d in drop)
    ]
    return ("tiny-cogvideox-lora" if video else "tiny-sd3-lora"), sets


def run_case(name: str, work: Path, steps: int) -> dict:
    import torch

    from difftrain.config.load import resolve
    from difftrain.flows.bench import bench_memory

    what, recipe, sets = CASES[name]
    if TINY:
        recipe, sets = _tiny(recipe, sets)
    cfg = resolve(recipe=recipe, sets=sets).config
    size = None if TINY else SIZE.get(name[0])
    r = bench_memory(cfg, work / cfg.family, steps, size=size)
    return {
        "case": name,
        "what": what,
        "alloc": r.peak_train_alloc_gib,
        "reserved": r.peak_train_reserved_gib,
        "after_load": r.peak_after_load_gib,
        "planned_alloc": r.planned_alloc_gib,
        "planned_reserved": r.planned_reserved_gib,
        "s_per_step": r.s_per_step,
        "rss_train": r.stats.get("peak_rss_gib_train"),
        "versions": {
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
    }


def eager(
    case: str,
    what: str,
    model_class,
    config: str,
    rank: int,
    inputs,
    timestep: float,
    steps: int,
    targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0"),
) -> dict:
    """Plain diffusers/peft/torch loop, no difftrain code: a bundled ``config``'s transformer in bf16, LoRA of ``rank``
    (alpha = rank) on ``targets`` (to_q/to_k/to_v/to_out.0) in fp32, checkpointing, torch AdamW, on the random tensors
    ``inputs(cfg, device)`` gives (keyword arguments of the model) at ``timestep``."""
    import torch
    from peft import LoraConfig

    root = Path(__file__).resolve().parents[1] / "src/difftrain/families/configs"
    cfg = json.loads((root / config / "transformer/config.json").read_text())
    dev = "cpu" if TINY else "cuda"
    torch.manual_seed(0)
    with torch.device(dev):
        model = model_class.from_config(cfg).to(torch.bfloat16)
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4)
    kwargs = inputs(cfg, dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.time()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            out = model(**kwargs, timestep=torch.tensor([timestep], device=dev), return_dict=False)[0]
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.time() - t)
    gib = lambda b: round(b / 2**30, 3)
    return {
        "case": case,
        "what": what,
        "alloc": gib(torch.cuda.max_memory_allocated()) if dev == "cuda" else None,
        "reserved": gib(torch.cuda.max_memory_reserved()) if dev == "cuda" else None,
        "s_per_step": round(statistics.median(times[2:]), 3),
    }


def eager_sd3(work: Path, steps: int) -> dict:
    """The eager loop on the SD3-medium transformer, LoRA r16 on the attention projections, random inputs of the
    cached shapes (as shared/reference)."""
    from diffusers import SD3Transformer2DModel

    def inputs(cfg: dict, dev: str) -> dict:
        import torch

        side = 16 if TINY else 128
        return {
            "hidden_states": torch.randn(1, 16, side, side, device=dev, dtype=torch.bfloat16),
            "encoder_hidden_states": torch.randn(1, 333, cfg["joint_attention_dim"], device=dev, dtype=torch.bfloat16),
            "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], device=dev, dtype=torch.bfloat16),
        }

    return eager(
        "E-sd3",
        "eager: SD3-medium LoRA r16, bf16, checkpointing (no difftrain code)",
        SD3Transformer2DModel,
        "sd3-tiny" if TINY else "sd3-medium",
        16,
        inputs,
        500.0,
        steps,
    )


def eager_cogvideox(work: Path, steps: int) -> dict:
    """The eager loop on the CogVideoX-2b transformer, LoRA r64, random 49x480x720 latents (1x13x16x60x90) and
    226x4096 text, as shared/reference measured it (no rotary embeddings in 2b)."""
    from diffusers import CogVideoXTransformer3DModel

    def inputs(cfg: dict, dev: str) -> dict:
        import torch

        f, h, w = (3, 8, 8) if TINY else (13, 60, 90)
        return {
            "hidden_states": torch.randn(1, f, cfg["in_channels"], h, w, device=dev, dtype=torch.bfloat16),
            "encoder_hidden_states": torch.randn(1, 226, cfg["text_embed_dim"], device=dev, dtype=torch.bfloat16),
        }

    return eager(
        "E-cog",
        "eager: CogVideoX-2b LoRA r64, bf16, checkpointing (no difftrain code)",
        CogVideoXTransformer3DModel,
        "cogvideox-tiny" if TINY else "cogvideox-2b",
        64,
        inputs,
        500,
        steps,
    )


def eager_wan(work: Path, steps: int) -> dict:
    """The eager loop on the Wan2.1-1.3B transformer, LoRA r32 on every Linear of the blocks, random 81x480x832
    latents (1x16x21x60x104) and 512x4096 text: what the diffusers/peft way of training it costs (issue 51)."""
    from diffusers import WanTransformer3DModel

    def inputs(cfg: dict, dev: str) -> dict:
        import torch

        f, h, w = (3, 8, 8) if TINY else (21, 60, 104)
        return {
            "hidden_states": torch.randn(1, cfg["in_channels"], f, h, w, device=dev, dtype=torch.bfloat16),
            "encoder_hidden_states": torch.randn(1, 512, cfg["text_dim"], device=dev, dtype=torch.bfloat16),
        }

    return eager(
        "E-wan",
        "eager: Wan2.1-1.3B LoRA r32, bf16, checkpointing (no difftrain code)",
        WanTransformer3DModel,
        "wan-tiny" if TINY else "wan2.1-t2v-1.3b",
        32,
        inputs,
        500.0,
        steps,
        targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
    )


EAGER = {"E-sd3": eager_sd3, "E-cog": eager_cogvideox, "E-wan": eager_wan}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-family-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default=",".join([*EAGER, *CASES]))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        r = EAGER[a.case](a.work, a.steps) if a.case in EAGER else run_case(a.case, a.work, a.steps)
        print("RESULT " + json.dumps(r), flush=True)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    results = sf.run_cases(__file__, a.cases.split(","), a.work, a.steps)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "family_memory.json").write_text(json.dumps(results, indent=1))
    print("\n| case | alloc GiB | reserved GiB | planned alloc | planned reserved | s/step | host RSS GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | failed | | | | | |")
            continue
        print(
            f"| {r['case']} {r['what']} | {r.get('alloc')} | {r.get('reserved')} | {r.get('planned_alloc', '')} | "
            f"{r.get('planned_reserved', '')} | {r['s_per_step']} | {r.get('rss_train', '')} |"
        )


if __name__ == "__main__":
    main()
