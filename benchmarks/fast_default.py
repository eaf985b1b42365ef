"""Fast by default (issue 24): recipes as shipped (speed auto, no speed flags) on a synthetic cache of SDXL's
real aspect buckets drawn in random order, beside a plain diffusers+peft eager checkpointed loop over the same
buckets, each case in its own process (a fresh torch.compile state), within one call's time budget.

    python benchmarks/fast_default.py --out $OUT [--cases plain-sdxl,sdxl-lora-8gb,...] [--budget 540]

Each difftrain case is `difftrain bench speed --recipe R --no-baseline --buckets SIX --planned-steps 2000`:
speed auto decides as for a 2,000-step run; the warm-up steps (one epoch: every bucket shape once) hold the
compiling and the CUDA graph recording, the timed steps are the next epoch. Writes $OUT/fast_default.json (every
case's figures) and $OUT/failures.log; prints a short table last.
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

# name: (bench speed arguments after --recipe R, what it checks)
CASES: dict[str, tuple[list[str], str]] = {
    "sdxl-lora-8gb": (["--recipe", "sdxl-lora-8gb"], "SDXL LoRA r16 b1 as shipped (speed auto), six buckets"),
    "sdxl-lora-4gb": (["--recipe", "sdxl-lora-4gb"], "SDXL LoRA r16 b1, block swap 60, as shipped, six buckets"),
    "sdxl-lora-8gb-off": (
        ["--recipe", "sdxl-lora-8gb", "--set", "speed.compile=false"],
        "sdxl-lora-8gb with speed off (eager), six buckets",
    ),
    "sd3-lora-8gb": (["--recipe", "sd3-lora-8gb"], "SD3-medium LoRA as shipped, six buckets"),
}


def plain_sdxl(steps: int, warmup: int, seed: int = 0) -> dict:
    """Plain diffusers/peft/torch SDXL LoRA loop (no difftrain code in the step), bf16 UNet, checkpointing,
    LoRA r16 on the attention projections, fp32 AdamW: memory_tiers.py's E-lora over the six buckets."""
    import torch
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    here = Path(__file__).resolve().parents[1]
    cfg = json.loads((here / "src/difftrain/families/configs/sdxl-base-1.0/unet/config.json").read_text())
    torch.manual_seed(0)
    with torch.device("cuda"):
        unet = UNet2DConditionModel.from_config(cfg).to(torch.bfloat16)
    unet.requires_grad_(False)
    unet.enable_gradient_checkpointing()
    unet.add_adapter(
        LoraConfig(
            r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]
        )
    )
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4)
    order = [b for b in SIX for _ in range(2)]
    rng = random.Random(seed)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        if i % len(order) == 0:
            rng.shuffle(order)
        h, w = order[i % len(order)]
        t = time.time()
        x = torch.randn(1, 4, h // 8, w // 8, device="cuda", dtype=torch.bfloat16)
        enc = torch.randn(1, 77, 2048, device="cuda", dtype=torch.bfloat16)
        added = {
            "text_embeds": torch.randn(1, 1280, device="cuda", dtype=torch.bfloat16),
            "time_ids": torch.tensor([[h, w, 0, 0, h, w]], device="cuda", dtype=torch.bfloat16),
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
    timed = times[warmup:]
    return {
        "case": "plain-sdxl",
        "s_per_step": round(sum(timed) / len(timed), 4),
        "s_per_step_median": round(statistics.median(timed), 4),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        "first_step_s": round(times[0], 2),
    }


def run_case(name: str, args: list[str], work: Path, steps: int, warmup: int, timeout: float) -> dict:
    folder = work / name.split("-")[0]  # one random model and cache per family
    cmd = [sys.executable, "-m", "difftrain", "bench", "speed", *args, "--no-baseline", "--planned-steps", "2000"]
    cmd += ["--buckets", BUCKETS, "--steps", str(steps), "--warmup", str(warmup), "--work", str(folder)]
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    res = json.loads((folder / "bench_speed.json").read_text()) if p.returncode == 0 else {}
    row = res.get("rows", [{}])[-1]
    return {
        "case": name,
        "rc": p.returncode,
        "wall_s": round(time.time() - t, 1),
        **{k: row.get(k) for k in ("s_per_step", "first_step_s", "warmup_overhead_s", "peak_alloc_gib", "speed")},
        "peak_reserved_gib": row.get("peak_reserved_gib"),
        "compile": row.get("compile"),
        "mfu": row.get("mfu"),
        "log_tail": (p.stdout + p.stderr)[-3000:] if p.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default="plain-sdxl,sdxl-lora-8gb,sdxl-lora-4gb,sdxl-lora-8gb-off")
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-fast"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case == "plain-sdxl":
        print("RESULT " + json.dumps(plain_sdxl(a.steps, a.warmup)), flush=True)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    t0, rows, failures = time.time(), [], []
    for name in a.cases.split(","):
        left = a.budget - (time.time() - t0)
        if left < 45:
            rows.append({"case": name, "rc": "not run (time)"})
            continue
        try:
            if name == "plain-sdxl":
                cmd = [sys.executable, __file__, "--out", str(a.out), "--case", name]
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
    plain = next((r.get("s_per_step") for r in rows if r["case"] == "plain-sdxl"), None)
    print("\n| case | s/step | vs plain | step 1 s | warm-up extra s | peak alloc / reserved GiB | speed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r.get("s_per_step")
        vs = f"{plain / s:.2f}x" if s and plain and r["case"].startswith("sdxl") else ""
        print(
            f"| {r['case']} | {s if s else r.get('rc')} | {vs} | {r.get('first_step_s', '')} | "
            f"{r.get('warmup_overhead_s', '')} | {r.get('peak_alloc_gib', '')} / {r.get('peak_reserved_gib', '')} | "
            f"{(r.get('speed') or '')[:150]} |"
        )


if __name__ == "__main__":
    main()
