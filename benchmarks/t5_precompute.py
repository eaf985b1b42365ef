"""SD3's caption precompute on a GPU: peak memory of T5-XXL in int8 / nf4 (bitsandbytes) against bf16.

A random-weight T5-XXL encoder (sd3-medium's bundled text_encoder_3 config, 4.76 B parameters) is saved
once as the text_encoder_3/ of a diffusers-layout folder, then each case, in a fresh process, loads it
through the SD3 family exactly as `difftrain precompute` does (SD3.load with the stage precision) and
encodes a batch of 4 captions at 77 and at 256 tokens. Prints a table last; JSON under --out.

    python benchmarks/t5_precompute.py --work /tmp/t5 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CASES = ["int8", "nf4", "bf16"]


def build(work: Path) -> Path:
    import torch
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    from difftrain.families.sd3.family import bundled_config_dir
    from difftrain.families.tokenizers import tiny_t5_tokenizer

    folder = work / "sd3"
    if (folder / "text_encoder_3" / "config.json").exists():
        return folder
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    cfg = json.loads((bundled_config_dir("sd3-medium") / "text_encoder_3" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = T5EncoderModel(T5Config(**cfg)).to(torch.bfloat16)
    model.save_pretrained(folder / "text_encoder_3", safe_serialization=True)
    # token ids only matter through their count (padded to max_length): a stand-in vocabulary does
    T5TokenizerFast.from_pretrained(tiny_t5_tokenizer(work / "tok")).save_pretrained(folder / "tokenizer_3")
    return folder


def run_case(prec: str, work: Path) -> dict:
    import torch

    from difftrain.config.schema import ModelConfig, TextEncodersConfig
    from difftrain.families.sd3 import SD3

    fam = SD3()
    torch.cuda.reset_peak_memory_stats()
    t = time.time()
    comps = fam.load(
        ModelConfig(path=work / "sd3", config="sd3-medium"),
        ["text_encoder_3"],
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
        precision={"text_encoder_3": prec},
    )
    torch.cuda.synchronize()
    out = {
        "case": prec,
        "load_s": round(time.time() - t, 1),
        "after_load_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
    }
    for n in (77, 256):
        opts = TextEncodersConfig(t5={"precision": prec, "max_length": n})
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            e = fam.encode_prompts(comps, ["a photo of a cat sitting on a red chair"] * 4, "t5", opts)
        torch.cuda.synchronize()
        out[f"peak_alloc_{n}"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out[f"peak_reserved_{n}"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        out[f"shape_{n}"] = list(e["t5_embeds"].shape)
    out["versions"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-t5"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(run_case(a.case, a.work)), flush=True)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    t = time.time()
    build(a.work)
    print(f"built random T5-XXL in {time.time() - t:.0f}s", flush=True)
    results = []
    for prec in CASES:
        p = subprocess.run(
            [sys.executable, __file__, "--case", prec, "--work", str(a.work)],
            capture_output=True,
            text=True,
            env=dict(os.environ, DIFFTRAIN_PROGRESS="0"),
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"case {prec} failed:\n{p.stderr[-3000:]}", flush=True)
            continue
        results.append(json.loads(line[0][7:]))
        print(json.dumps(results[-1]), flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "t5_precompute.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| T5-XXL precision | after load GiB | peak alloc 77 tok (batch 4) | peak reserved 77 | peak alloc 256 | peak reserved 256 | load s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['case']} | {r['after_load_gib']} | {r['peak_alloc_77']} | {r['peak_reserved_77']} | {r['peak_alloc_256']} | "
            f"{r['peak_reserved_256']} | {r['load_s']} |"
        )


if __name__ == "__main__":
    main()
