"""Caption precompute of the language-model text encoders on a GPU: the peak memory of each stage at its precision
beside the planner's estimate (planning/estimate.py llm_precompute_gib, calibrated on T5-XXL: benchmarks/
t5_precompute.py), to check that estimate and to tell which card precomputes which encoder (issue 53: FLUX.2
[dev]'s 24 B Mistral 3; the 6 GB recipes' Qwen3-4B in int8, estimated over what a 6 GB card leaves torch).

For each family: random weights of its bundled real text encoder (bf16, saved once as the text_encoder/ of a
diffusers folder with the tiny model's byte-level tokenizer: token ids only matter through their count), then each
precision in a fresh process loads it as `difftrain precompute` does (the family's load with the stage precision)
and encodes 4 captions. Each family's folder is removed after its cases (Mistral 3 is 48 GB in bf16). Prints a
table last; $OUT/llm_precompute.json holds every case, written as each ends.

    python benchmarks/llm_precompute.py --work /tmp/llm --out $OUT [--cases zimage:int8,zimage:nf4,flux2-dev:nf4]
    DIFFTRAIN_BENCH_TINY=1 python benchmarks/llm_precompute.py --work /tmp/llm   # the tiny configs in bf16 on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
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
}
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


def build(name: str, work: Path) -> Path:
    """The random text encoder's folder (and the tiny model's tokenizer beside it)."""
    import torch

    from difftrain.families.registry import get_family

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


def run_case(name: str, prec: str, folder: Path) -> dict:
    import torch

    from difftrain.families.registry import get_family
    from difftrain.planning.estimate import llm_precompute_gib
    from difftrain.utils import to_dtype

    cfg = _config(name, prec)
    cfg.model.path = folder
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
    print("\n| encoder | precision | after load GiB | peak allocated | peak reserved | planner's estimate | load s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.get('encoder') or r['case']} | {r['case'].split(':')[1]} | {r.get('after_load_gib')} | "
            f"{r.get('peak_alloc_gib')} | {r.get('peak_reserved_gib')} | {r.get('estimate_gib')} | {r.get('load_s')} |"
            + (" error" if "error" in r else "")
        )


if __name__ == "__main__":
    main()
