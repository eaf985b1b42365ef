"""Memory one SDXL block (real size, LoRA r16 on the attention projections, fp8 or bf16 frozen weights, bf16
autocast) keeps for backward under each way of running it:

    eager            no checkpointing
    eager-ckpt       diffusers' checkpointing: the parent calls the block through torch.utils.checkpoint
    compiled         speed.compile (Module.compile on the block)
    compiled-ckpt    speed.compile + checkpointing: the checkpoint call inside the compiled block

    python benchmarks/compile_checkpoint_memory.py --out DIR [--modes ...] [--weights fp8,bf16] [--tag=-NAME]
        [--functorch NAME=JSON ...]   # a torch._functorch.config setting, to try partitioner options

Per case: MiB allocated between the end of forward and the start of backward beyond the output ("kept"), the
peak above the start during forward+backward, and the largest tensors autograd saved. A table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from difftrain.config.schema import SpeedConfig
from difftrain.memory import fp8 as F8
from difftrain.speed import regional_compile


def _blocks():
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    # SDXL's innermost level: 1280 channels at 32x32 latents (1024x1024 images), 77 CLIP tokens of 2048 features
    res = ResnetBlock2D(in_channels=1280, out_channels=1280, temb_channels=1280, groups=32)
    attn = BasicTransformerBlock(1280, 20, 64, cross_attention_dim=2048)
    return {
        "ResnetBlock2D": (
            res,
            lambda d: ((torch.randn(1, 1280, 32, 32, device=d), torch.randn(1, 1280, device=d)), {}),
        ),
        "BasicTransformerBlock": (
            attn,
            lambda d: (
                (torch.randn(1, 1024, 1280, device=d),),
                {"encoder_hidden_states": torch.randn(1, 77, 2048, device=d)},
            ),
        ),
    }


def _prepare(block, weights: str, device):
    from peft import LoraConfig, inject_adapter_in_model

    b = copy.deepcopy(block)
    b.requires_grad_(False)
    if device.type == "cuda":  # the trainer loads the model in bf16 (CPU autocast's group norm wants fp32)
        b.to(torch.bfloat16)
    targets = [n for n in ("to_q", "to_k", "to_v", "to_out.0") if any(k.endswith(n) for k, _ in b.named_modules())]
    if targets:
        inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=targets), b)
    if weights == "fp8":
        F8.convert(b, device)
    return b.to(device)


def measure(name, block, make_inputs, weights, mode, device) -> dict:
    import torch._dynamo
    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    b = _prepare(block, weights, device)
    if mode.startswith("compiled"):
        regional_compile.compile_blocks(
            torch.nn.Sequential(b),
            (name,),
            SpeedConfig(compile=True),
            checkpoint_every=1 if mode == "compiled-ckpt" else 0,
        )
    if mode == "eager-ckpt":

        def f(*a, **k):
            return checkpoint(b, *a, use_reentrant=False, **k)
    else:
        f = b
    args, kwargs = make_inputs(device)
    x = args[0].requires_grad_(True)
    t0 = time.time()
    for _ in range(2):  # compile and warm up
        with torch.autocast(device.type, torch.bfloat16):
            f(x, *args[1:], **kwargs).float().mean().backward()
    compile_s = time.time() - t0
    x.grad = None
    for p in b.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    m0 = torch.cuda.memory_allocated()
    params = {p.untyped_storage().data_ptr() for p in b.parameters()} | {
        t.untyped_storage().data_ptr() for t in b.buffers()
    }
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != x.untyped_storage().data_ptr():
            saved[ptr] = (
                round(t.untyped_storage().nbytes() / 2**20, 2),
                list(t.shape),
                str(t.dtype).removeprefix("torch."),
            )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(device.type, torch.bfloat16):
        out = f(x, *args[1:], **kwargs)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - m0 - out.untyped_storage().nbytes()
    out.float().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - m0
    top = sorted(saved.values(), key=lambda v: -v[0])[:12]
    return {
        "block": name,
        "weights": weights,
        "mode": mode,
        "kept_mib": round(kept / 2**20, 1),
        "peak_mib": round(peak / 2**20, 1),
        "saved_mib": round(sum(v[0] for v in saved.values()), 1),
        "n_saved": len(saved),
        "largest_saved": top,
        "compile_s": round(compile_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="eager,eager-ckpt,compiled,compiled-ckpt")
    ap.add_argument("--weights", default="fp8")
    ap.add_argument("--blocks", default="ResnetBlock2D,BasicTransformerBlock")
    ap.add_argument("--functorch", action="append", default=[], help="NAME=VALUE of torch._functorch.config")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    import torch._functorch.config as fc

    for kv in a.functorch:
        k, v = kv.split("=")
        setattr(fc, k, json.loads(v))
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    blocks = _blocks()
    rows = []
    for name in a.blocks.split(","):
        block, make = blocks[name]
        for weights in a.weights.split(","):
            for mode in a.modes.split(","):
                try:
                    r = measure(name, block, make, weights, mode, device)
                except Exception as e:  # noqa: BLE001 - a failing case is reported, the others still run
                    r = {
                        "block": name,
                        "weights": weights,
                        "mode": mode,
                        "error": f"{type(e).__name__}: {str(e)[:300]}",
                    }
                rows.append(r)
                (a.out / f"compile_checkpoint_memory{a.tag}.json").write_text(json.dumps(rows, indent=1))
                print(json.dumps(r), flush=True)
    print("\nblock | weights | mode | kept MiB | peak MiB | saved MiB (n) | compile s")
    for r in rows:
        if "error" in r:
            print(f"{r['block']} | {r['weights']} | {r['mode']} | {r['error'][:120]}")
        else:
            print(
                f"{r['block']} | {r['weights']} | {r['mode']} | {r['kept_mib']} | {r['peak_mib']} | "
                f"{r['saved_mib']} ({r['n_saved']}) | {r['compile_s']}"
            )


if __name__ == "__main__":
    main()
