"""Data preparation at scale (issue 9): bucket planning time, precompute throughput, host RAM as the dataset grows.

Cases (each prints a line; a table is printed last; JSON under --out):

* ``plan N``: N images (sizes spread over 20 photo shapes from 640x480 to 2048x1365, each a real PNG; the
  files of one shape share their bytes) with a tag file each; the time of ``difftrain precompute --plan-only``
  (scan, headers, buckets), in-process.
* ``rss N``: N small images (128x128 PNG, distinct pixels and captions) precomputed with the tiny SDXL on the
  CPU, in a fresh process: wall time and peak RSS of the main process and of the largest decode worker.
  Entries wait in RAM until their shard is written, so the main process may hold up to one shard
  (``--shard-mb``, default 512) on top of a flat base.
* ``throughput``: the same batches of photo-sized JPEGs (decoded, resized and cropped to their buckets) through
  the VAE two ways: end to end (``precompute()``: decode workers, host-to-device copy, encode, cache writes;
  its latent phase's wall time) and encoder alone (every batch decoded beforehand and already on the device,
  only ``encode_images`` timed). Images/s of each and their ratio.
* ``card``: a GPU recipe's whole precompute (latents, then the text encoders) of photo-sized JPEGs at SDXL's
  buckets, 1024x1024 among them, on random weights of the real architecture, in a fresh process whose allocator
  is capped as the recipe's card would leave it (the CUDA context and libraries measured in that process and the
  display margin taken off, as ``bench memory --card``; through ``train.gpu_memory_limit_gib``, which precompute
  honours): fits or not, and the peak allocated and reserved.

    python benchmarks/data_pipeline.py --work /tmp/dp --out $OUT plan 100000
    python benchmarks/data_pipeline.py --work /tmp/dp rss 1000 20000
    python benchmarks/data_pipeline.py --work /tmp/dp throughput --model sdxl --images 256 --device cuda --workers 8
    python benchmarks/data_pipeline.py --work /tmp/dp --out $OUT card --recipes sdxl-lora-3gb,sdxl-lora-4gb
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [
    (640, 480),
    (480, 640),
    (800, 600),
    (1024, 768),
    (768, 1024),
    (1024, 1024),
    (1280, 720),
    (720, 1280),
    (1200, 900),
    (1536, 1024),
    (1024, 1536),
    (1600, 1200),
    (1920, 1080),
    (1080, 1920),
    (2048, 1365),
    (1365, 2048),
    (900, 1200),
    (1280, 960),
    (1500, 1000),
    (832, 1216),
]
TAGS = [
    "1girl",
    "solo",
    "smile",
    "outdoors",
    "sky",
    "tree",
    "red hair",
    "hat",
    "looking at viewer",
    "dress",
    "flower",
    "long hair",
    "short hair",
    "blue eyes",
    "standing",
    "sitting",
    "building",
    "night",
    "cloud",
    "water",
]


def _photo(w: int, h: int, seed: int):
    """A smooth gradient with noise and shapes: JPEG sizes and decode times like a photograph's."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([(x / w) * 200, (y / h) * 200, ((x + y) / (w + h)) * 255], -1)
    base += rng.normal(0, 12, base.shape)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    r = random.Random(seed)
    for _ in range(8):
        cx, cy, s = r.randrange(w), r.randrange(h), r.randrange(20, max(21, min(w, h) // 3))
        d.ellipse((cx - s, cy - s, cx + s, cy + s), fill=(r.randrange(256), r.randrange(256), r.randrange(256)))
    return img


def make_plan_set(folder: Path, n: int) -> Path:
    from PIL import Image

    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    blobs = []
    for w, h in SHAPES:
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (120, 130, 140)).save(buf, "PNG", optimize=True)
        blobs.append(buf.getvalue())
    rng = random.Random(0)
    for i in range(n):
        sub = folder / f"{i // 1000:03d}"  # a thousand files per folder, as large datasets are kept
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i:06d}.png").write_bytes(blobs[rng.randrange(len(blobs))])
        (sub / f"{i:06d}.txt").write_text(", ".join(rng.sample(TAGS, 6)), encoding="utf-8")
    (folder / "done").write_text(str(n))
    return folder


def case_plan(work: Path, n: int) -> dict:
    from difftrain.config.load import resolve
    from difftrain.precompute.run import precompute

    t = time.perf_counter()
    data = make_plan_set(work / f"plan{n}", n)
    made = time.perf_counter() - t
    cfg = resolve(
        recipe="sdxl-lora-8gb", sets=[f"data.dir={data}", f"data.cache_dir={work / 'plan-cache'}", "model.path=unused"]
    ).config
    t = time.perf_counter()
    r = precompute(cfg, plan_only=True)
    secs = time.perf_counter() - t
    return {
        "case": f"plan {n}",
        "images": r.items,
        "skipped": len(r.skipped),
        "buckets": len(r.buckets),
        "seconds": round(secs, 2),
        "images_per_s": round(n / secs),
        "dataset_build_s": round(made, 1),
    }


def make_small_set(folder: Path, n: int) -> Path:
    import numpy as np
    from PIL import Image

    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        sub = folder / f"{i // 1000:03d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)).save(
            sub / f"{i:06d}.png", compress_level=1
        )
        (sub / f"{i:06d}.txt").write_text(f"image {i}, " + ", ".join(TAGS[j] for j in rng.choice(20, 5, replace=False)))
    (folder / "done").write_text(str(n))
    return folder


def random_sdxl(work: Path) -> Path:
    """Where the throughput and card cases keep SDXL base's random single file (6.9 GB: built once per --work)."""
    return work / "sdxl-random.safetensors"


def tiny_model(work: Path) -> Path:
    from difftrain.families.sdxl import SDXL

    folder = work / "tiny-sdxl"
    if not (folder / "model_index.json").exists():
        SDXL().build_tiny(folder, seed=0)
    return folder


RSS_CHILD = """
import json, resource, sys, time
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
cfg = resolve(recipe="tiny-sdxl-lora", sets=sys.argv[1:]).config
t = time.perf_counter()
r = precompute(cfg)
print(json.dumps({"seconds": time.perf_counter() - t, "items": r.items, "phases": r.seconds,
                  "self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "workers_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def case_rss(work: Path, n: int, workers: int | None, shard_mb: float | None = None) -> dict:
    t = time.perf_counter()
    data = make_small_set(work / f"small{n}", n)
    made = time.perf_counter() - t
    cache = work / f"small{n}-cache"
    shutil.rmtree(cache, ignore_errors=True)
    sets = (
        [
            f"model.path={tiny_model(work)}",
            f"data.dir={data}",
            f"data.cache_dir={cache}",
            "precompute.device=cpu",
            "precompute.batch_size=16",
        ]
        + ([f"precompute.num_workers={workers}"] if workers is not None else [])
        + ([f"precompute.shard_max_mb={shard_mb}"] if shard_mb else [])
    )
    out = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, *sets],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DIFFTRAIN_PROGRESS": "0"},
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "case": f"rss {n}" + (f" shards {shard_mb:g} MB" if shard_mb else ""),
        "images": res["items"],
        "seconds": round(res["seconds"], 1),
        "images_per_s": round(res["items"] / res["seconds"], 1),
        "latent_phase_s": round(res["phases"].get("latents", 0), 1),
        "peak_rss_main_mib": round(res["self_kib"] / 1024),
        "peak_rss_worker_mib": round(res["workers_kib"] / 1024),
        "dataset_build_s": round(made, 1),
    }


def make_photo_set(folder: Path, n: int) -> Path:
    if (folder / "done").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    big = [(1600, 1100), (1100, 1600), (1400, 1400), (1800, 1000)]  # larger than the buckets: resized, as photos are
    for i in range(n):
        w, h = big[i % len(big)]
        _photo(w, h, i).save(folder / f"{i:05d}.jpg", quality=92)
        (folder / f"{i:05d}.txt").write_text(", ".join(random.Random(i).sample(TAGS, 6)))
    (folder / "done").write_text(str(n))
    return folder


def case_throughput(
    work: Path, model: str, n: int, device: str, workers: int, batch: int, resolution: int, vae_dtype: str
) -> dict:
    import torch

    from difftrain.config.load import resolve
    from difftrain.data.buckets import choose_bucket, make_buckets
    from difftrain.data.sources import scan_dataset
    from difftrain.families.registry import get_family
    from difftrain.precompute.pipeline import decoded_batches, to_unit_range
    from difftrain.precompute.run import precompute
    from difftrain.utils import to_dtype

    data = make_photo_set(work / f"photos{n}", n)
    if model == "tiny":
        path, recipe = tiny_model(work), "tiny-sdxl-lora"
    else:
        from difftrain.families.sdxl import SDXL

        path, recipe = random_sdxl(work), "sdxl-lora-8gb"
        if not path.exists():  # a whole single file (the loader checks it is one), random weights made on the device
            SDXL().build_random("sdxl-base-1.0", path, device=device)
    cache = work / "tp-cache"
    shutil.rmtree(cache, ignore_errors=True)
    # a single file has no tokenizer: the tiny model's (token ids below its small vocabulary) stand in
    sets = [f"model.tokenizer_path={tiny_model(work)}"] if model != "tiny" else []
    sets += [
        f"model.path={path}",
        f"data.dir={data}",
        f"data.cache_dir={cache}",
        f"precompute.device={device}",
        f"precompute.batch_size={batch}",
        f"precompute.num_workers={workers}",
        f"precompute.vae_dtype={vae_dtype}",
        f"data.resolution={resolution}",
        f"data.min_side={min(resolution, 512)}",
        f"data.max_side={2 * resolution}",
        "data.max_upscale=null",
    ]
    cfg = resolve(recipe=recipe, sets=sets).config
    fam, dev, d = get_family(cfg.family), torch.device(device), cfg.data

    # encoder alone: the same batches (same buckets, same order), decoded beforehand, already on the device
    records, _ = scan_dataset(data)
    buckets = make_buckets(d.resolution, d.bucket_step, d.min_side, d.max_side)
    jobs = sorted(
        (
            (
                r.key,
                r,
                choose_bucket(r.width, r.height, buckets, resolution=d.resolution, step=d.bucket_step),
                None,
                r.key,
            )
            for r in records
        ),
        key=lambda j: j[2],
    )
    pre = [
        to_unit_range(b["pixels"].to(dev))
        for b in decoded_batches(
            jobs, [j[2] for j in jobs], batch, video=False, random_crop=False, workers=workers, pin=False
        )
    ]
    comps = fam.load(cfg.model, [fam.image_encoder], dtype=to_dtype(vae_dtype), device=dev)
    with torch.no_grad():
        fam.encode_images(comps, pre[0])  # warm-up: kernels chosen, memory pooled
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for pix in pre:
            fam.encode_images(comps, pix).cpu()  # the latents come back to the host, as precompute's do
        if dev.type == "cuda":
            torch.cuda.synchronize()
        enc_s = time.perf_counter() - t
    del comps, pre
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    r = precompute(cfg)
    e2e_s = r.seconds["latents"]
    return {
        "case": f"throughput {model} {device} w{workers}",
        "images": r.latents_encoded,
        "batch": batch,
        "resolution": resolution,
        "vae_dtype": vae_dtype,
        "encoder_only_img_s": round(n / enc_s, 2),
        "end_to_end_img_s": round(r.latents_encoded / e2e_s, 2),
        "ratio": round(enc_s / e2e_s * n / r.latents_encoded, 3),
        "buckets": r.buckets,
    }


CARD_CHILD = """
import json, sys, time
import torch
from difftrain.config.load import resolve
from difftrain.memory.card import allocator_budget, measure_overhead
from difftrain.precompute.run import precompute
card, recipe = float(sys.argv[1]), sys.argv[2]
dev = torch.device("cuda", 0)
over = measure_overhead(dev)  # first, before torch holds anything: this process's context and libraries
budget = allocator_budget(card, over)
cfg = resolve(recipe=recipe, sets=sys.argv[3:] + [f"train.gpu_memory_limit_gib={budget}"]).config
torch.cuda.reset_peak_memory_stats(dev)
row = {"card_gib": card, "context_libraries_gib": round(over.total_gib, 3), "left_to_torch_gib": round(budget, 3),
       "vae_dtype": cfg.precompute.vae_dtype, "batch": cfg.precompute.batch_size}
t = time.perf_counter()
try:
    r = precompute(cfg)
    row.update(fits=True, latents=r.latents_encoded, texts=r.texts_encoded, buckets=r.buckets)
except Exception as e:  # out of memory, raw or as precompute's own error
    row.update(fits=False, error=f"{type(e).__name__}: {e}"[:600])
row["seconds"] = round(time.perf_counter() - t, 1)
row["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(dev) / 2**30, 3)
print(json.dumps(row))
"""

BUILD_CHILD = """
import sys
from pathlib import Path
from difftrain.families.sdxl import SDXL
SDXL().build_random("sdxl-base-1.0", Path(sys.argv[1]), device="cuda")
"""


def case_card(work: Path, recipe: str, n: int, workers: int) -> dict:
    from difftrain.config.load import resolve
    from difftrain.memory.card import parse_card

    card = parse_card(recipe.rsplit("-", 1)[-1])
    cfg = resolve(recipe=recipe, sets=["model.path=unused"]).config
    if cfg.family != "sdxl" or (cfg.model.config or "sdxl-base-1.0") != "sdxl-base-1.0":
        # the tiny SDXL's tokenizers stand in for the single file's, SDXL base's random weights for its own
        raise SystemExit(f"card: SDXL base recipes only ({recipe} is {cfg.family}, {cfg.model.config})")
    path = random_sdxl(work)
    if not path.exists():  # in a process of its own: this one and the capped one start with no CUDA memory held
        subprocess.run([sys.executable, "-c", BUILD_CHILD, str(path)], check=True)
    data = make_photo_set(work / f"photos{n}", n)
    cache = work / f"card-cache-{recipe}"
    shutil.rmtree(cache, ignore_errors=True)
    sets = [
        f"model.path={path}",
        f"model.tokenizer_path={tiny_model(work)}",  # a single file has no tokenizer (ids below the tiny vocabulary)
        f"data.dir={data}",
        f"data.cache_dir={cache}",
        "precompute.device=cuda",
        f"precompute.num_workers={workers}",
    ]
    out = subprocess.run(
        [sys.executable, "-c", CARD_CHILD, str(card), recipe, *sets],
        capture_output=True,
        text=True,
        env={**os.environ, "DIFFTRAIN_PROGRESS": "0"},
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return {"case": f"card {recipe}", "fits": None, "error": (out.stderr or out.stdout)[-1500:]}
    return {"case": f"card {recipe}", **json.loads(lines[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-dp"))
    ap.add_argument("--out", type=Path, default=None)
    sub = ap.add_subparsers(dest="case", required=True)
    p = sub.add_parser("plan")
    p.add_argument("n", type=int, nargs="+")
    p = sub.add_parser("rss")
    p.add_argument("n", type=int, nargs="+")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--shard-mb", type=float, default=None, help="precompute.shard_max_mb (default: the config's, 512)")
    p = sub.add_parser("card")
    p.add_argument("--recipes", default="sdxl-lora-3gb", help="comma-separated GPU recipes named by their card")
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p = sub.add_parser("throughput")
    p.add_argument("--model", choices=["tiny", "sdxl"], default="tiny")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--vae-dtype", default="bf16")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DIFFTRAIN_PROGRESS", "0")
    rows = []
    if a.case == "plan":
        rows = [case_plan(a.work, n) for n in a.n]
    elif a.case == "rss":
        rows = [case_rss(a.work, n, a.workers, a.shard_mb) for n in a.n]
    elif a.case == "card":
        rows = [case_card(a.work, r, a.images, a.workers) for r in a.recipes.split(",")]
    else:
        rows = [
            case_throughput(a.work, a.model, a.images, a.device, w, a.batch, a.resolution, a.vae_dtype)
            for w in a.workers
        ]
    for row in rows:
        print(json.dumps(row), flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"data_pipeline_{a.case}.json").write_text(json.dumps(rows, indent=1))
    keys = [k for k in rows[0] if k != "buckets"]
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    print(
        f"\n(python {sys.version.split()[0]}, peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB)"
    )


if __name__ == "__main__":
    main()
