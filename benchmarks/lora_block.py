"""What LoRA costs inside one SDXL transformer block (issue 24, the SDXL batch-4 MFU target).

One diffusers BasicTransformerBlock of SDXL's UNet (self-attention, cross-attention to 77 tokens of 2048 channels,
GEGLU feed-forward with difftrain's Triton backward), frozen bf16 weights, batch 4, compiled as speed auto compiles
it (the block is the region, CUDA graphs), under bf16 autocast, forward and backward, at SDXL's two shapes:

- ``frozen``: no LoRA, only the input needs a gradient: what the block costs without any adapter;
- ``lora``: peft's LoRA at rank 16 on to_q, to_k, to_v, to_out.0 (sdxl-lora-8gb's targets), fp32 adapter weights,
  as difftrain adds it;
- ``fused-linear``: the same adapters, each LoRA Linear with difftrain's fused forward and backward
  (difftrain.speed.lora_kernel) but diffusers' own attention processor: q, k and v one by one (a session before's kernel);
- ``fused-qkv``: also the self-attention's q, k and v as one fused call (one read of ``x``, one low-rank gradient
  matmul per factor), the cross-attention's one by one;
- ``fused``: speed.lora_kernel fused as shipped: also the cross-attention's k and v (both read the text) as one;
- ``fused-addmm``: ``fused`` with the backward's input gradient as ``addmm(gm a, g, w)`` instead of one matmul over
  ``[g, gm]`` (which copies the output gradient into the concatenation; addmm copies an input-sized tensor).

The difference to ``frozen``, times SDXL's 60 + 10 blocks, is what the adapters cost a step. The input's gradient
of ``fused`` is compared with ``lora``'s (relative norm of the difference).

    python3 benchmarks/lora_block.py --out $OUT [--profile]

``--profile``: the GPU kernels of one step of each kind at the 1280-channel shape (torch.profiler), top ones
printed and all in OUT/kernels.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch._dynamo

from difftrain.speed import lora_kernel as fused

#: the backward as shipped, before any kind below swaps another in
SHIPPED = fused._LoraLinear.backward

# name: (tokens per sample, channels, heads); SDXL has 60 blocks at 1280 channels, 10 at 640
KINDS = ("frozen", "lora", "fused-linear", "fused-qkv", "fused", "fused-addmm")
SHAPES = {"1280ch-32x32": (1024, 1280, 20, 60), "640ch-64x64": (4096, 640, 10, 10)}


def build(kind: str, dim: int, heads: int):
    from diffusers.models.attention import BasicTransformerBlock

    from difftrain.config.schema import LoraConfig
    from difftrain.lora.adapters import add_lora
    from difftrain.speed import geglu

    torch._dynamo.reset()  # a fresh compile for each kind: a cached graph of another kind would pass the guards
    torch.manual_seed(0)
    block = BasicTransformerBlock(
        dim, heads, dim // heads, cross_attention_dim=2048, activation_fn="geglu", attention_bias=False
    )
    block = block.cuda().to(torch.bfloat16).requires_grad_(False)
    geglu.use_fused(block)
    if kind != "frozen":
        # add_lora is diffusers' PeftAdapterMixin's add_adapter: give the bare block the mixin's method
        from diffusers.loaders.peft import PeftAdapterMixin

        block.__class__ = type("LoraBlock", (type(block), PeftAdapterMixin), {})
        add_lora(block, LoraConfig(rank=16, alpha=16), ["to_q", "to_k", "to_v", "to_out.0"])
        with torch.no_grad():  # peft starts B at zero; a trained adapter's B is not
            for n, p in block.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        if kind.startswith("fused"):
            from diffusers.models.attention_processor import AttnProcessor2_0

            fused.use_fused(block)
            for attn in (block.attn1, block.attn2)[{"fused-linear": 0, "fused-qkv": 1}.get(kind, 2) :]:
                attn.set_processor(AttnProcessor2_0())
            # each kind compiles afresh (dynamo reset above), with the backward it names
            fused._LoraLinear.backward = staticmethod(BACKWARDS.get(kind, SHIPPED))
    block.compile(mode="reduce-overhead")
    return block


def _addmm_backward(ctx, grad):
    """The shipped backward with x's gradient as ``addmm(gm a, g, w)`` (the shipped one is the ``[g, gm]`` form)."""
    x2, mid, weight, a, b = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])
    gm = g2 @ (b * ctx.scale)
    gx = torch.addmm(gm @ a, g2, weight)
    return gx.view(ctx.shape), None, None, gm.t() @ x2, (g2.t() @ mid) * ctx.scale, None


BACKWARDS = {"fused-addmm": _addmm_backward}


def time_it(block, x, ctx, g, n=40) -> tuple[float, torch.Tensor]:
    params = [p for p in block.parameters() if p.requires_grad]

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # as the trainer does before each step
        x.grad = None
        for p in params:  # as zero_grad(set_to_none=True): a graph's output is not accumulated into
            p.grad = None
        with torch.autocast("cuda", torch.bfloat16):
            out = block(x, encoder_hidden_states=ctx)
        out.backward(g)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        step()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n, x.grad.clone()


def kernels(block, x, ctx, g, steps=5) -> list[tuple[str, float, int]]:
    """(kernel, GPU microseconds a step, calls a step), largest first."""
    from torch.profiler import ProfilerActivity, profile

    params = [p for p in block.parameters() if p.requires_grad]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            x.grad = None
            for p in params:
                p.grad = None
            with torch.autocast("cuda", torch.bfloat16):
                out = block(x, encoder_hidden_states=ctx)
            out.backward(g)
        torch.cuda.synchronize()
    rows = [
        (e.key[:110], e.device_time_total / steps, e.count // steps)
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.device_type.name == "CUDA"
    ]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # each kind and shape compiles the block class again: past dynamo's default of 8 versions the rest would run
    # eagerly (difftrain's own limit, speed.configure_compile)
    torch._dynamo.config.recompile_limit = 64
    rows = []
    if args.profile:
        tokens, dim, heads, _ = SHAPES["1280ch-32x32"]
        x = torch.randn(args.batch, tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ctx = torch.randn(args.batch, 77, 2048, device="cuda", dtype=torch.bfloat16)
        g = torch.randn_like(x)
        found = {}
        for kind in KINDS:
            block = build(kind, dim, heads)
            time_it(block, x, ctx, g, n=5)
            found[kind] = kernels(block, x, ctx, g)
            total = sum(r[1] for r in found[kind])
            print(f"\n{kind}: {total:.0f} us of kernels a step")
            for k, us, calls in found[kind][:22]:
                print(f"  {us:8.1f} us  {calls:3d}x  {k}")
        (args.out / "kernels.json").write_text(json.dumps(found, indent=1))
        return
    for name, (tokens, dim, heads, count) in SHAPES.items():
        x = torch.randn(args.batch, tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ctx = torch.randn(args.batch, 77, 2048, device="cuda", dtype=torch.bfloat16)
        g = torch.randn_like(x)
        ms, grads = {}, {}
        for kind in KINDS:
            ms[kind], grads[kind] = time_it(build(kind, dim, heads), x, ctx, g)
        rows.append({"shape": name, "blocks": count, **{f"{k}_ms": round(v, 4) for k, v in ms.items()}})
        for kind in KINDS[2:]:
            diff = ((grads[kind].float() - grads["lora"].float()).norm() / grads["lora"].float().norm()).item()
            rows[-1][f"{kind}_grad_rel_diff"] = float(f"{diff:.3g}")
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "lora_block.json").write_text(json.dumps(rows, indent=1))
    print("\n| shape | blocks | " + " | ".join(f"{k} ms" for k in KINDS) + " | grad diff to peft's |")
    print("|---|---|" + "---|" * len(KINDS) + "---|")
    tot = dict.fromkeys(KINDS[1:], 0.0)
    for r in rows:
        for k in tot:
            tot[k] += (r[f"{k}_ms"] - r["frozen_ms"]) * r["blocks"]
        diffs = ", ".join(str(r[f"{k}_grad_rel_diff"]) for k in KINDS[2:])
        print(f"| {r['shape']} | {r['blocks']} | " + " | ".join(f"{r[f'{k}_ms']:.4f}" for k in KINDS) + f" | {diffs} |")
    print("LoRA over SDXL's 70 blocks a step (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in tot.items()))


if __name__ == "__main__":
    main()
