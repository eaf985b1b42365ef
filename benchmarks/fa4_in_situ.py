"""FlashAttention-4 inside CogVideoX-2b's real blocks (issue 24, item 5): how many attention calls reach FA4's
kernels, eagerly and with each block compiled as difftrain compiles it, and the blocks' forward + backward time
with speed.attention fa4 against torch's SDPA choice. Random weights, two of the 30 layers, 49x480x720 (17,776
tokens), bf16, batch 1. Needs flash-attn-4 (benchmarks/fa4_stage.sh).

    python benchmarks/fa4_in_situ.py [--layers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    from diffusers import CogVideoXTransformer3DModel

    from difftrain.speed import fa4

    calls = {"n": 0}
    real = fa4._interface

    def counted():
        calls["n"] += 1
        return real()

    fa4._interface = counted
    root = Path(__file__).parents[1] / "src/difftrain/families/configs/cogvideox-2b/transformer/config.json"
    cfg = {k: v for k, v in json.loads(root.read_text()).items() if not k.startswith("_")}
    cfg["num_layers"] = a.layers
    model = CogVideoXTransformer3DModel(**cfg).to("cuda", torch.bfloat16)
    x = torch.randn(1, 13, 16, 60, 90, device="cuda", dtype=torch.bfloat16)
    e = torch.randn(1, 226, cfg["text_embed_dim"], device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")

    def step():
        out = model(hidden_states=x, encoder_hidden_states=e, timestep=t, return_dict=False)[0]
        out.float().square().mean().backward()

    def timed(ctx, n=5):
        with ctx():
            step()
            step()
            torch.cuda.synchronize()
            calls["n"] = 0
            s, f = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                step()
            f.record()
            torch.cuda.synchronize()
        return round(s.elapsed_time(f) / n, 2), calls["n"] // n

    rows = []
    for compiled in (False, True):
        if compiled:
            for b in model.transformer_blocks:
                b.compile()
        for name, ctx in (("sdpa", contextlib.nullcontext), ("fa4", fa4.routed)):
            torch._dynamo.reset()
            ms, n = timed(ctx)
            rows.append({"compiled": compiled, "attention": name, "ms_fwd_bwd": ms, "fa4_op_calls_per_step": n})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\ncompiled | attention | ms (fwd+bwd, {a.layers} layers) | FA4 op calls per step")
    for r in rows:
        print(f"{r['compiled']} | {r['attention']} | {r['ms_fwd_bwd']} | {r['fa4_op_calls_per_step']}")


if __name__ == "__main__":
    main()
