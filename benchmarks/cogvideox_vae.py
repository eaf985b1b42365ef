"""CogVideoX's 3D VAE on a GPU: peak memory and time to encode one 49x480x720 clip, with and without tiling.

Random weights from the bundled cogvideox-5b VAE config (the 2b VAE has the same architecture), bf16,
the way `difftrain precompute` encodes (the family's encode_images: posterior mean, scaled). Each case in
a fresh process. Prints a table last; JSON under --out.

    python benchmarks/cogvideox_vae.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = {"tiled": (True, True), "sliced, not tiled": (True, False)}


def run_case(name: str) -> dict:
    import torch
    from diffusers import AutoencoderKLCogVideoX

    from difftrain.families.cogvideox.family import CogVideoX, bundled_config_dir

    slicing, tiling = CASES[name]
    cfg = json.loads((bundled_config_dir("cogvideox-5b") / "vae" / "config.json").read_text())
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = AutoencoderKLCogVideoX.from_config(cfg).to(torch.bfloat16).eval()
    if slicing:
        vae.enable_slicing()
    if tiling:
        vae.enable_tiling()
    else:
        vae.disable_tiling()
    pixels = torch.rand(1, 3, 49, 480, 720, device="cuda") * 2 - 1
    weights = torch.cuda.memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    t = time.time()
    out = {"case": name}
    try:
        with torch.no_grad():
            lat = CogVideoX().encode_images({"vae": vae}, pixels)
        torch.cuda.synchronize()
        out.update(shape=list(lat.shape), seconds=round(time.time() - t, 2))
    except torch.OutOfMemoryError:
        out.update(error="out of memory")
    out.update(
        weights_and_input_gib=round(weights, 3),
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_case(a.case)), flush=True)
        return
    results = []
    for name in CASES:
        p = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"case {name} failed:\n{p.stderr[-2000:]}", flush=True)
            continue
        results.append(json.loads(line[0][7:]))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "cogvideox_vae.json").write_text(json.dumps(results, indent=1))
    print("\n| CogVideoX VAE, one 49x480x720 clip, bf16 | peak alloc GiB | peak reserved GiB | seconds | latents |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['case']} | {r['peak_alloc_gib']} | {r['peak_reserved_gib']} | {r.get('seconds', r.get('error'))} | {r.get('shape')} |"
        )


if __name__ == "__main__":
    main()
