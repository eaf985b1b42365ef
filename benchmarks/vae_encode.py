"""Precompute's VAE encode (issue 24, item 4): images per second of the SDXL (or another family's) VAE as precompute
runs it (`families.common.vae_latents`, the posterior mean), in the dtypes and memory formats precompute could use,
and each variant's latents against today's default (fp32, NCHW) on the same images.

Random weights of the bundled architecture (seeded), photo-like smooth images (low-frequency noise with some
detail) at two SDXL buckets, batch 8. Timed: encode of already-decoded batches on the GPU, latents copied to the
host (as precompute does), after two warm-up batches; the end-to-end pipeline around it (decode workers, shard
writes) was measured at 95-97 % of the encoder alone (docs/benchmarks.md, issue 9), so the encoder's rate is the
precompute rate to first order.

    python benchmarks/vae_encode.py --out $OUT [--family-config sdxl-base-1.0/vae] [--batches 6] [--compile]

Writes $OUT/vae_encode.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1] / "src/difftrain/families/configs"
SHAPES = [(1024, 1024), (832, 1216)]


def images(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = torch.nn.functional.interpolate(torch.rand(n, 3, h // 64, w // 64, generator=g), size=(h, w), mode="bicubic")
    mid = torch.nn.functional.interpolate(torch.rand(n, 3, h // 8, w // 8, generator=g), size=(h, w), mode="bilinear")
    return (0.8 * low + 0.2 * mid).clamp(0, 1) * 2 - 1


def main() -> None:
    from diffusers import AutoencoderKL

    from difftrain.families.common import vae_latents

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--family-config", default="sdxl-base-1.0/vae")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script on the tiny configs")
    ap.add_argument(
        "--peaks",
        action="store_true",
        help="also the peak memory of one encode at batch 1, 2 and 4 per dtype (what a small card must hold)",
    )
    ap.add_argument("--compile", action="store_true", help="also bf16 + channels-last compiled (torch.compile)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    ap_dev = a.device
    dev = torch.device(ap_dev)
    cuda = dev.type == "cuda"
    cfg = {k: v for k, v in json.loads((HERE / a.family_config / "config.json").read_text()).items() if k[0] != "_"}
    torch.manual_seed(0)
    base = AutoencoderKL.from_config(cfg).eval()
    batches = [(h, w, images(a.batch, h, w, seed=i)) for i in range(a.batches) for h, w in SHAPES]
    variants = [("fp32", torch.float32, False, False), ("fp32 channels-last", torch.float32, True, False),
                ("bf16", torch.bfloat16, False, False), ("bf16 channels-last", torch.bfloat16, True, False)]  # fmt: skip
    if a.compile:
        variants.append(("bf16 channels-last compiled", torch.bfloat16, True, True))
    if a.batches == 0:  # --peaks alone
        variants = []
    ref: list[torch.Tensor] = []
    rows = []
    for name, dtype, cl, comp in variants:
        vae = AutoencoderKL.from_config(cfg).eval()
        vae.load_state_dict(base.state_dict())
        vae = vae.to(dev, dtype)
        if cl:
            vae = vae.to(memory_format=torch.channels_last)
        if comp:
            vae.encoder = torch.compile(vae.encoder)
        fmt = torch.channels_last if cl else torch.contiguous_format
        out: list[torch.Tensor] = []
        with torch.inference_mode():
            for _h, _w, x in batches[: 2 * len(SHAPES)]:  # warm-up: cuDNN's algorithm search, compiling
                vae_latents(vae, x.to(dev).contiguous(memory_format=fmt)).cpu()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _h, _w, x in batches:
                out.append(vae_latents(vae, x.to(dev, non_blocking=True).contiguous(memory_format=fmt)).cpu())
            if cuda:
                torch.cuda.synchronize()
            secs = time.perf_counter() - t0
        n = sum(x.shape[0] for *_, x in batches)
        if not ref:
            ref = out
        num = sum(float((o - r).pow(2).sum()) for o, r in zip(out, ref))
        den = sum(float(r.pow(2).sum()) for r in ref)
        std = float(torch.cat([r.flatten() for r in ref]).std())
        worst = max(float((o - r).abs().max()) for o, r in zip(out, ref))
        rows.append({"variant": name, "images_per_s": n / secs, "images": n,
                     "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                     "rel_rms_err": (num / den) ** 0.5, "max_abs_err_over_std": worst / std,
                     "finite": all(bool(torch.isfinite(o).all()) for o in out)})  # fmt: skip
        del vae
        if cuda:
            torch.cuda.empty_cache()
    peaks = []
    if a.peaks:
        for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            vae = AutoencoderKL.from_config(cfg).eval()
            vae.load_state_dict(base.state_dict())
            vae = vae.to(dev, dtype)
            for h, w in SHAPES:
                for bs in (1, 2, 4):
                    x = images(bs, h, w, seed=99).to(dev)
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    base_alloc = torch.cuda.memory_allocated() if cuda else 0
                    with torch.inference_mode():
                        vae_latents(vae, x).cpu()
                    peak = (torch.cuda.max_memory_allocated() - base_alloc) / 2**30 if cuda else 0.0
                    res = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
                    peaks.append({"dtype": dname, "h": h, "w": w, "batch": bs, "peak_over_weights_gib": peak,
                                  "reserved_gib": res})  # fmt: skip
            del vae
            if cuda:
                torch.cuda.empty_cache()
    env = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    (a.out / "vae_encode.json").write_text(json.dumps({"env": env, "rows": rows, "peaks": peaks}, indent=1))
    print(env)
    print("| variant | images/s | vs fp32 | peak alloc GiB | rel. RMS error vs fp32 | max abs error / latent std |")
    print("|---|---|---|---|---|---|")
    for pk in peaks:
        print(
            f"peak {pk['dtype']} {pk['h']}x{pk['w']} batch {pk['batch']}: {pk['peak_over_weights_gib']:.2f} GiB over "
            f"the weights and input, {pk['reserved_gib']:.2f} reserved"
        )
    for r in rows:
        print(f"| {r['variant']} | {r['images_per_s']:.1f} | {r['images_per_s'] / rows[0]['images_per_s']:.2f}x "
              f"| {r['peak_alloc_gib']:.2f} | {r['rel_rms_err']:.2e} | {r['max_abs_err_over_std']:.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
