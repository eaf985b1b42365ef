"""Caption precompute of the language-model text encoders on a GPU: the peak memory of each stage at its precision
beside the planner's estimate (planning/estimate.py llm_precompute_gib, calibrated on T5-XXL: benchmarks/
t5_precompute.py), to check that estimate and to tell which card precomputes which encoder (issue 53: FLUX.2
[dev]'s 24 B Mistral 3; the 6 GB recipes' Qwen3-4B in int8, estimated over what a 6 GB card leaves torch).

For each family: random weights of its bundled real text encoder (bf16, saved once as the text_encoder/ of a
diffusers folder with the tiny model's byte-level tokenizer: token ids only matter through their count), then each
precision in a fresh process loads it as `difftrain precompute` does (the family's load with the stage precision)
and encodes 4 captions. Each family's folder is removed after its cases (Mistral 3 is 48 GB in bf16). Prints a
table last; $OUT/llm_precompute.json holds every case, written as each ends.

flux2-dev-file: [dev]'s Mistral 3 from one file in ComfyUI's names (mistral_3_small_flux2_bf16.safetensors: the
causal LM's model.layers.N beside vision_tower / multi_modal_projector, and tekken_model), written from the random
folder and loaded through families/flux2/mistral_file.py's rewritten folder next to it: the host RSS peak of the
load (its promise: never the 38 GB of bf16 weights in host memory) and the disk the rewritten folder takes at most.

    python benchmarks/llm_precompute.py --work /tmp/llm --out $OUT [--cases zimage:int8,zimage:nf4,flux2-dev:nf4]
    DIFFTRAIN_BENCH_TINY=1 python benchmarks/llm_precompute.py --work /tmp/llm   # the tiny configs in bf16 on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

TINY = os.environ.get("DIFFTRAIN_BENCH_TINY") == "1"
# case name -> (family, bundled config, tiny config)
MODELS = {
    "zimage": ("zimage", "z-image", "z-image-tiny"),
    "krea2": ("krea2", "krea2", "krea2-tiny"),
    "qwen-image": ("qwen-image", "qwen-image", "qwen-image-tiny"),
    "flux2-klein-4b": ("flux2", "flux2-klein-4b", "flux2-tiny"),
    "flux2-dev": ("flux2", "flux2-dev", "flux2-tiny-dev"),
    "flux2-dev-file": ("flux2", "flux2-dev", "flux2-tiny-dev"),
}
COMFY_FILE = "mistral_3_small_flux2_bf16.safetensors"
#: transformers 5's names -> ComfyUI's file's (the inverse of mistral_file._RENAMES for the names it writes)
COMFY_NAMES = (
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
DEFAULT = "zimage:int8,zimage:nf4,qwen-image:int8,qwen-image:nf4,krea2:int8,flux2-dev:nf4"
CAPTIONS = ["a photo of a cat sitting on a red chair by the window, evening light"] * 4


def _config(name: str, prec: str):
    """The config precompute would run with: the family's tiny recipe on the bundled architecture, bf16 besides."""
    from difftrain.config.load import resolve

    family, config, tiny = MODELS[name]
    recipe = {"qwen-image": "tiny-qwen-image-lora", "flux2": "tiny-flux2-lora"}.get(family, f"tiny-{family}-lora")
    sets = [f"model.config={tiny if TINY else config}", f"text_encoders.llm.precision={prec}", "data.dir=."]
    sets.append(f"precompute.text_encoder_dtype={'fp32' if TINY else 'bf16'}")
    return resolve(recipe=recipe, sets=sets).config


def write_comfy_file(text_encoder: Path, f: Path) -> None:
    """The folder's Mistral 3 as one safetensors file in ComfyUI's names, written a tensor at a time (the header
    first, then each tensor's bytes: safetensors' save_file would hold all 48 GB in host memory)."""
    import struct

    import torch
    from safetensors import safe_open

    index = text_encoder / "model.safetensors.index.json"
    shards = (
        sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.exists() else ["model.safetensors"]
    )
    names: dict[str, tuple[str, str]] = {}  # file name -> (shard, transformers name)
    header: dict = {"__metadata__": {"format": "pt"}}
    codes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8"}
    off = 0
    for shard in shards:
        with safe_open(str(text_encoder / shard), "pt") as r:
            for k in r.keys():  # noqa: SIM118 (safe_open is not iterable)
                new = next((n + k[len(o) :] for o, n in COMFY_NAMES if k.startswith(o)), k)
                t = r.get_slice(k)
                shape, dtype = t.get_shape(), t.get_dtype()
                size = int(torch.tensor(shape).prod()) * {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}[dtype]
                names[new] = (shard, k)
                header[new] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
                off += size
    tekken = torch.arange(256, dtype=torch.uint8).repeat(64)  # the tokenizer as bytes, as the real file has it
    header["tekken_model"] = {"dtype": "U8", "shape": [tekken.numel()], "data_offsets": [off, off + tekken.numel()]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.parent.mkdir(parents=True, exist_ok=True)
    part = f.with_suffix(".part")
    with open(part, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for shard in shards:
            with safe_open(str(text_encoder / shard), "pt") as r:
                for new, (s, k) in names.items():
                    if s == shard:
                        t = r.get_tensor(k)
                        assert codes[t.dtype] == header[new]["dtype"]
                        out.write(t.contiguous().view(torch.uint8).numpy().tobytes())
        out.write(tekken.numpy().tobytes())
    part.replace(f)


def build_file(work: Path) -> Path:
    """flux2-dev-file's folder: the [dev] folder's config and tokenizer, its text encoder's weights as one file in
    ComfyUI's names under models/ (the random folder's weights removed after: 48 GB)."""
    folder = work / "flux2-dev-file"
    if (folder / "models" / COMFY_FILE).exists():
        return folder
    src = build("flux2-dev", work)
    weights = shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json")
    shutil.copytree(src, folder, ignore=weights, dirs_exist_ok=True)
    write_comfy_file(src / "text_encoder", folder / "models" / COMFY_FILE)
    if not TINY:
        shutil.rmtree(src, ignore_errors=True)
    return folder


def build(name: str, work: Path) -> Path:
    """The random text encoder's folder (and the tiny model's tokenizer beside it)."""
    import torch

    from difftrain.families.registry import get_family

    if name == "flux2-dev-file":
        return build_file(work)
    family, config, tiny = MODELS[name]
    fam = get_family(family)
    folder = work / name
    if (folder / "text_encoder" / "config.json").exists():
        return folder
    small = work / f"tiny-{name}"
    if not small.exists():
        build_tiny = fam.build_tiny
        if family == "flux2":  # its [dev]-like tiny model is built from its own config
            small = build_tiny(small, config=tiny)  # type: ignore[call-arg]
        else:
            small = build_tiny(small)
    if TINY:
        return small
    fam.build_random(config, folder, device="cuda" if torch.cuda.is_available() else "cpu", parts=["text_encoder"])
    for tok in small.glob("tokenizer*"):
        shutil.copytree(tok, folder / tok.name, dirs_exist_ok=True)
    # the loaders know a diffusers folder by its denoiser's subfolder (2026-11-28: "not a diffusers Z-Image folder");
    # the text stage never reads it, so an empty one and the tiny model's model_index.json stand in
    (folder / "transformer").mkdir(exist_ok=True)
    if (small / "model_index.json").exists():
        shutil.copy(small / "model_index.json", folder / "model_index.json")
    return folder


class DiskPeak(threading.Thread):
    """The most bytes under ``folder`` (``skip`` left out) seen, and this process's largest private (RssAnon) and
    file-backed (RssFile: mapped safetensors pages, which the kernel takes back under pressure) resident memory,
    sampled every half second. ru_maxrss counts both: 45.9 GiB for [dev]'s file on 2026-11-28, most of it the
    mapped pages of the 48 GB file and the rewritten shards as they were read."""

    def __init__(self, folder: Path, skip: Path):
        super().__init__(daemon=True)
        self.folder, self.skip, self.peak, self.stop = folder, skip, 0, False
        self.anon, self.file = 0, 0

    def run(self) -> None:
        while not self.stop:
            n = 0
            for p in self.folder.rglob("*"):
                with contextlib.suppress(OSError):  # removed while counted
                    n += p.stat().st_size if p.is_file() and p != self.skip else 0
            self.peak = max(self.peak, n)
            status = dict(ln.split(":", 1) for ln in Path("/proc/self/status").read_text().splitlines() if ":" in ln)
            self.anon = max(self.anon, int(status.get("RssAnon", "0 kB").split()[0]) * 1024)
            self.file = max(self.file, int(status.get("RssFile", "0 kB").split()[0]) * 1024)
            time.sleep(0.5)


def run_case(name: str, prec: str, folder: Path) -> dict:
    import torch

    from difftrain.families.registry import get_family
    from difftrain.planning.estimate import llm_precompute_gib
    from difftrain.utils import to_dtype

    cfg = _config(name, prec)
    cfg.model.path = folder
    disk = None
    if name == "flux2-dev-file":
        cfg.model.text_encoder = folder / "models" / COMFY_FILE
        disk = DiskPeak(folder / "models", skip=cfg.model.text_encoder)
        disk.start()
    fam = get_family(cfg.family)
    stage = fam.enabled_stages(cfg.text_encoders)[0]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.time()
    comps = fam.load(
        cfg.model,
        list(fam.text_stages[stage]),
        dtype=to_dtype(cfg.precompute.text_encoder_dtype),
        device=device,
        precision=fam.stage_precision(stage, cfg.text_encoders),
    )
    out: dict = {"case": f"{name}:{prec}", "load_s": round(time.time() - t, 1)}
    out["host_rss_peak_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    if disk is not None:
        disk.stop = True
        disk.join()
        out["rewritten_peak_gib"] = round(disk.peak / 2**30, 2)
        out["host_anon_peak_gib"], out["host_file_peak_gib"] = round(disk.anon / 2**30, 2), round(disk.file / 2**30, 2)
        out["left_beside_file"] = sorted(p.name for p in disk.folder.iterdir() if p != disk.skip)
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["after_load_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    with torch.no_grad():
        emb = fam.encode_prompts(comps, CAPTIONS, stage, cfg.text_encoders)
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        out["gpu"] = torch.cuda.get_device_name()
    est = llm_precompute_gib(cfg)
    out["encoder"], out["billions"], out["estimate_gib"] = (
        (est[0], round(est[1], 2), round(est[2], 2)) if est else (None,) * 3
    )
    out["rows"] = [list(t.shape) for t in next(iter(emb.values()))][:1]
    out["torch"] = torch.__version__
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-llm"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default="zimage:bf16,flux2-dev:bf16" if TINY else DEFAULT)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        name, prec = a.case.split(":")
        print("RESULT " + json.dumps(run_case(name, prec, build(name, a.work))), flush=True)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    cases = [c.split(":") for c in a.cases.split(",")]
    results: list[dict] = []
    for i, (name, prec) in enumerate(cases):
        t = time.time()
        build(name, a.work)
        p = subprocess.run(
            [sys.executable, __file__, "--case", f"{name}:{prec}", "--work", str(a.work)],
            capture_output=True,
            text=True,
            env=dict(os.environ, DIFFTRAIN_PROGRESS="0"),
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        row = (
            json.loads(line[0][7:])
            if line and not p.returncode
            else {"case": f"{name}:{prec}", "error": p.stderr[-3000:]}
        )
        row["wall_s"] = round(time.time() - t, 1)
        results.append(row)
        print(json.dumps(row)[:600], flush=True)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "llm_precompute.json").write_text(json.dumps(results, indent=1) + "\n")
        if not TINY and all(n != name for n, _ in cases[i + 1 :]):  # the family's last case: its folder goes
            shutil.rmtree(a.work / name, ignore_errors=True)
    print(
        "\n| encoder | precision | after load GiB | peak allocated | peak reserved | planner's estimate | load s "
        "| host RSS peak GiB | rewritten folder peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.get('encoder') or r['case']} | {r['case'].split(':')[1]} | {r.get('after_load_gib')} | "
            f"{r.get('peak_alloc_gib')} | {r.get('peak_reserved_gib')} | {r.get('estimate_gib')} | {r.get('load_s')} | "
            f"{r.get('host_rss_peak_gib')} ({r.get('host_anon_peak_gib', '-')} private) | {r.get('rewritten_peak_gib', '')} |"
            + (" error" if "error" in r else "")
        )


if __name__ == "__main__":
    main()
