"""One Wan block's training memory on a CUDA GPU at a video's token count (issue 51's tier planning): the peak
allocated by a forward and backward of one WanTransformerBlock of a bundled architecture (bf16 weights, LoRA-free:
the activations alone), and the size of its input (what checkpointing keeps per block).

    python benchmarks/wan_block_memory.py --config wan2.1-t2v-1.3b --tokens 32760 [--mode plain|checkpoint|split]

``--mode checkpoint`` runs the block under torch's checkpoint (what a checkpointed block peaks at while it is
recomputed in backward); ``--mode split`` runs it as memory.activations.split does (families/wan/segments.py:
checkpointed segments, their per-token work over token chunks).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="wan2.1-t2v-1.3b")
    ap.add_argument("--tokens", type=int, default=32760)  # 81 frames of 480x832: 21 x 30 x 52
    ap.add_argument("--mode", choices=["plain", "checkpoint", "split"], default="plain")
    ap.add_argument("--compile", action="store_true", help="the block compiled as speed.compile compiles it")
    ap.add_argument("--lora", action="store_true", help="LoRA r32 on every Linear, the base frozen (the recipes)")
    a = ap.parse_args()
    from diffusers import WanTransformer3DModel

    from difftrain.families.common import configs_root, read_json

    cfg = read_json(configs_root() / a.config / "transformer" / "config.json")
    cfg["num_layers"] = 1
    m = WanTransformer3DModel.from_config(cfg).to("cuda", torch.bfloat16)
    m.requires_grad_(False)
    block = m.blocks[0]
    if a.lora:
        from peft import LoraConfig

        from difftrain.families.wan import Wan

        m.add_adapter(LoraConfig(r=32, lora_alpha=32, target_modules=list(Wan.default_lora_targets)))
    else:
        for p in block.parameters():
            p.requires_grad_(True)  # gradients flow through every op, as LoRA's would
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    x = torch.randn(1, a.tokens, d, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, d, device="cuda", dtype=torch.bfloat16)
    temb = torch.randn(1, 6, d, device="cuda", dtype=torch.bfloat16)
    f, h, w = 21, 30, a.tokens // (21 * 30)
    rope = m.rope(torch.zeros(1, 16, f, 2 * h, 2 * w, device="cuda"))
    if a.mode == "split":
        from difftrain.families.wan.segments import split_blocks

        split_blocks([block])
    if a.compile:
        block.compile()
    if a.mode != "plain":
        x.requires_grad_(True)  # as a block input inside a network is

    def call():
        if a.mode == "plain":
            return block(x, text, temb, rope)
        if a.compile:  # compiled blocks checkpoint as the recipes run them: offloaded around the compiled block
            from difftrain.memory.activation_offload import offloaded_checkpoint

            return offloaded_checkpoint(block, x, text, temb, rope)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block, x, text, temb, rope, use_reentrant=False)

    for _ in range(2):  # the second step is measured (the first compiles when --compile)
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as training runs (mixed precision bf16)
            out = call()
        fwd = torch.cuda.max_memory_allocated() - base
        out.float().square().mean().backward()
        del out
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    r = {
        "config": a.config,
        "mode": a.mode,
        "compiled": a.compile,
        "lora": a.lora,
        "tokens": a.tokens,
        "input_gib": x.numel() * 2 / 2**30,
        "forward_peak_gib": fwd / 2**30,
        "fwd_bwd_peak_gib": peak / 2**30,
    }
    print(json.dumps(r))


if __name__ == "__main__":
    main()
