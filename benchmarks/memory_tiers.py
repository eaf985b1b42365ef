"""SDXL memory tiers on a GPU: difftrain's techniques against an eager diffusers baseline, with the planner's error.

Full-size SDXL with random weights (single file, bundled configs), cached
latents and embeddings of the real shapes, 6 steps a case, each case in a fresh
subprocess (see sdxl_full.py for the set-up). For each case it records the
measured peaks next to the planner's prediction made before loading. The eager
baseline is a plain loop (diffusers UNet, peft add_adapter, torch AdamW or
bitsandbytes AdamW8bit, bf16, random inputs) written without difftrain, as in
shared/reference.

    python benchmarks/memory_tiers.py --work /tmp/bench --out $OUT [--cases L1,L2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import sdxl_full as sf

LORA = [
    "family=sdxl",
    "model.config=sdxl-base-1.0",
    "train.method=lora",
    "lora.rank=16",
    "train.batch_size=1",
    "train.mixed_precision=bf16",
    "train.device=cuda",
    "data.resolution=1024",
    "train.learning_rate=1e-4",
    "train.lr_scheduler=constant",
    "train.checkpoint_every=100000",
]
FULL = sf.COMMON + ["memory.weights.kind=bf16"]
CASES = {
    "L1": (
        "LoRA r16, bf16, checkpointing (sdxl-lora-8gb)",
        LORA + ["memory.weights.kind=bf16", "memory.activations.kind=checkpoint"],
    ),
    "L2": ("LoRA r16, bf16, no checkpointing", LORA + ["memory.weights.kind=bf16", "memory.activations.kind=none"]),
    "L3": (
        "LoRA r16, fp8 weights, checkpointing",
        LORA + ["memory.weights={kind: fp8}", "memory.activations.kind=checkpoint"],
    ),
    "L4": (
        "LoRA r16, fp8 weights, checkpoint every 2nd block",
        LORA + ["memory.weights={kind: fp8}", "memory.activations={kind: checkpoint, every: 2}"],
    ),
    "L5": (
        "LoRA r16, bf16, no checkpointing, batch 2",
        LORA + ["memory.weights.kind=bf16", "memory.activations.kind=none", "train.batch_size=2"],
    ),
    "L6": (
        "LoRA r16, nf4 weights (bnb), checkpointing",
        LORA + ["memory.weights={kind: nf4}", "memory.activations.kind=checkpoint"],
    ),
    "L7": (
        "LoRA r16, int8 weights (bnb), checkpointing",
        LORA + ["memory.weights={kind: int8}", "memory.activations.kind=checkpoint"],
    ),
    "L8": (
        "LoRA r16, int8 weights (bnb, outlier threshold 6), checkpointing",
        LORA + ["memory.weights={kind: int8, outlier_threshold: 6.0}", "memory.activations.kind=checkpoint"],
    ),
    "L9": (
        "LoRA r16, bf16, checkpointing, block swap (all 87 blocks)",
        LORA
        + [
            "memory.weights.kind=bf16",
            "memory.activations.kind=checkpoint",
            "memory.offload={kind: block_swap, blocks_to_swap: 87}",
        ],
    ),
    "L10": (
        "LoRA r16, fp8 weights, checkpointing, block swap (all 87 blocks)",
        LORA
        + [
            "memory.weights={kind: fp8}",
            "memory.activations.kind=checkpoint",
            "memory.offload={kind: block_swap, blocks_to_swap: 87}",
        ],
    ),
    "L11": (
        "LoRA r16, bf16, checkpoint every 2nd block, block swap (all 87 blocks)",
        LORA
        + [
            "memory.weights.kind=bf16",
            "memory.activations={kind: checkpoint, every: 2}",
            "memory.offload={kind: block_swap, blocks_to_swap: 87}",
        ],
    ),
    "F1": ("full UNet, bf16, 8-bit AdamW, checkpointing (sdxl-full)", FULL + ["memory.optimizer.kind=adamw8bit"]),
    "F2": (
        "full UNet, bf16, 8-bit AdamW, checkpointing, fused backward",
        FULL + ["memory.optimizer.kind=adamw8bit", "memory.fused_backward=true", "train.max_grad_norm=null"],
    ),
    "F3": (
        "full UNet, bf16, CPU-offload AdamW (gradients offloaded), checkpointing",
        FULL + ["memory.optimizer={kind: cpu_offload, offload_gradients: true}", "train.max_grad_norm=null"],
    ),
    "F5": (
        "full UNet, bf16, CPU-offload AdamW, checkpointing, block swap (all 87 blocks)",
        FULL
        + [
            "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
            "train.max_grad_norm=null",
            "memory.offload={kind: block_swap, blocks_to_swap: 87}",
        ],
    ),
    "F6": (
        "full UNet, bf16, DeepSpeed ZeRO-2, optimizer offloaded to the CPU, checkpointing",
        FULL
        + ["memory.optimizer.kind=adamw", "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: cpu}"],
    ),
    "F6n": (
        "F6 with overlap_comm off (one process: nothing to overlap)",
        FULL
        + [
            "memory.optimizer.kind=adamw",
            "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: cpu, "
            f"config_file: {Path(__file__).resolve().parent / 'ds_no_overlap.json'}}}",
        ],
    ),
    "F7": (
        "full UNet, bf16, DeepSpeed ZeRO-3, optimizer and parameters offloaded to the CPU, checkpointing",
        FULL
        + [
            "memory.optimizer.kind=adamw",
            "memory.engine={kind: deepspeed, stage: 3, offload_optimizer_device: cpu, offload_param_device: cpu}",
        ],
    ),
    "F6x": (
        "F6 with expandable segments",
        FULL
        + [
            "memory.optimizer.kind=adamw",
            "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: cpu}",
            "memory.expandable_segments=true",
        ],
    ),
    "F7x": (
        "F7 with expandable segments",
        FULL
        + [
            "memory.optimizer.kind=adamw",
            "memory.engine={kind: deepspeed, stage: 3, offload_optimizer_device: cpu, offload_param_device: cpu}",
            "memory.expandable_segments=true",
        ],
    ),
    "L12": (
        "LoRA r16, bf16, DeepSpeed ZeRO-2 (optimizer on the GPU), checkpointing",
        LORA
        + [
            "memory.weights.kind=bf16",
            "memory.activations.kind=checkpoint",
            "memory.engine={kind: deepspeed, stage: 2, offload_optimizer_device: none}",
        ],
    ),
    "F4": (
        "full UNet + both TEs, bf16, 8-bit AdamW, checkpointing",
        FULL + ["memory.optimizer.kind=adamw8bit", *sf.TE],
    ),
}


def eager(kind: str, work: Path, steps: int) -> dict:
    """Plain diffusers/peft/torch loop (no difftrain code in the step), as the reference measured it."""
    import torch
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    cfg = json.loads(
        (
            Path(__file__).resolve().parents[1] / "src/difftrain/families/configs/sdxl-base-1.0/unet/config.json"
        ).read_text()
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        unet = UNet2DConditionModel.from_config(cfg).to(torch.bfloat16)
    unet.requires_grad_(kind == "full")
    unet.enable_gradient_checkpointing()
    if kind == "lora":
        unet.add_adapter(
            LoraConfig(
                r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]
            )
        )
        params = [p for p in unet.parameters() if p.requires_grad]
        for p in params:
            p.data = p.data.float()
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        import bitsandbytes as bnb

        params = list(unet.parameters())
        opt = bnb.optim.AdamW8bit(params, lr=1e-5)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _i in range(steps):
        t = time.time()
        x = torch.randn(1, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
        enc = torch.randn(1, 77, 2048, device="cuda", dtype=torch.bfloat16)
        added = {
            "text_embeds": torch.randn(1, 1280, device="cuda", dtype=torch.bfloat16),
            "time_ids": torch.tensor([[1024, 1024, 0, 0, 1024, 1024]], device="cuda", dtype=torch.bfloat16),
        }
        ts = torch.randint(0, 1000, (1,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = unet(x, ts, encoder_hidden_states=enc, added_cond_kwargs=added).sample
        loss = torch.nn.functional.mse_loss(pred.float(), x.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        torch.cuda.synchronize()
        times.append(time.time() - t)
    return {
        "case": f"E-{kind}",
        "what": f"eager baseline: {kind}, bf16, checkpointing"
        + (" LoRA r16 AdamW" if kind == "lora" else " bnb AdamW8bit"),
        "stats": {
            "gpu_peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        },
        "s_per_step_median": round(statistics.median(times[2:]), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default=",".join(["E-lora", *CASES, "E-full"]))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        r = (
            eager(a.case[2:], a.work, a.steps)
            if a.case.startswith("E-")
            else sf.run_sets(a.case, CASES[a.case][0], CASES[a.case][1], a.work, a.steps)
        )
        print("RESULT " + json.dumps(r), flush=True)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    sf.build_model(a.work)
    sf.build_cache(a.work)
    what = {k: v[0] for k, v in CASES.items()}
    results = sf.run_cases(__file__, a.cases.split(","), a.work, a.steps, what)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "memory_tiers.json").write_text(json.dumps(results, indent=1))
    print("\n| case | alloc GiB | reserved GiB | planned alloc | planned reserved | s/step |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | failed | | | | |")
            continue
        s, p = r["stats"], r.get("plan", {})
        print(
            f"| {r['case']} {r.get('what', '')} | {s.get('gpu_peak_alloc_gib')} | {s.get('gpu_peak_reserved_gib')} | "
            f"{round(p['gpu_total'], 2) if p else ''} | {round(p['gpu_reserved'], 2) if p else ''} | {r['s_per_step_median']} |"
        )


if __name__ == "__main__":
    main()
