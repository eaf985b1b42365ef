"""Host RAM of loading a diffusers folder's denoiser on the host, as the fp8 and block-swap recipes do (issue 27).

The Flux LoRA recipes load the transformer on the host, quantize it to fp8 layer by layer, and (block swap) copy the
swapped blocks into pinned memory. This measures the peak RSS of those three steps on the CPU for FLUX.1 [dev]'s
blocks at their real widths (fewer of them, so it runs on a small machine; every term scales with the block count),
two ways, each in a fresh process:

- ``mapped``: diffusers' from_pretrained (safetensors' mapping; what difftrain did before
  ``families.common.read_diffusers_model``, and still does under ZeRO-3's partitioned build);
- ``difftrain``: ``common.load_diffusers_parts`` with difftrain's SafetensorsReader (private reads), the load
  between issue 27 and issue 50: the model whole in private memory, then converted;
- ``streamed``: the same reads under the trainer's placement (issue 50, ``memory.placement``): each tensor stored in
  fp8 in block swap's host store as it is read.

Block swap here copies to pageable host memory (pinned memory needs CUDA); on a GPU the copies are pinned slabs of
the same size. Peak RSS is the kernel's VmHWM; file pages are RssFile after the step.

    python benchmarks/host_load.py --out OUT [--double 4 --single 8] [--work /tmp/difftrain-host-load]

Writes OUT/host_load.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GIB = 2**30


def _status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = round(int(val.split()[0]) * 1024 / GIB, 3)
    return out


def build(folder: Path, double: int, single: int) -> None:
    import torch
    from diffusers import FluxTransformer2DModel

    from difftrain.families.common import bundled_dir, read_json, write_part
    from difftrain.families.flux.family import known_configs

    cfg = read_json(bundled_dir("flux-dev", "Flux", known_configs) / "transformer" / "config.json")
    cfg.update(num_layers=double, num_single_layers=single)
    kwargs = {k: v for k, v in cfg.items() if not k.startswith("_")}
    torch.manual_seed(0)
    m = FluxTransformer2DModel(**kwargs).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    write_part(folder, "transformer", m.state_dict(), dict(m.config), torch.bfloat16, "FluxTransformer2DModel")


def case(mode: str, folder: Path) -> dict:
    import contextlib

    import torch
    from diffusers import FluxTransformer2DModel

    from difftrain.families import common
    from difftrain.families.registry import get_family
    from difftrain.memory.block_swap import BlockSwap
    from difftrain.memory.fp8 import convert
    from difftrain.utils import fix_malloc_mmap_threshold

    fix_malloc_mmap_threshold()  # as the trainer sets it before loading (trainers/setup.py prepare_process)
    rows = {"start": _status()}
    fam = get_family("flux")
    place = None
    if mode == "streamed":  # issue 50: fp8 and block swap's host copies made as each tensor is read
        from difftrain.config.load import resolve
        from difftrain.families import streaming
        from difftrain.memory.placement import WeightPlacement

        sets = ["memory.weights={kind: fp8}", "memory.activations={kind: checkpoint}",
                "memory.offload={kind: block_swap, blocks_to_swap: 1000}"]  # fmt: skip
        mem = resolve(recipe="tiny-flux-lora", sets=sets).config.memory
        place = WeightPlacement(mem, torch.device("cpu"), torch.bfloat16, ["transformer"], "transformer",
                                keep=fam.high_precision_modules, units=fam.swap_blocks)  # fmt: skip
        ctx = streaming.placing(place)
    else:
        ctx = common.mapped_reads() if mode == "mapped" else contextlib.nullcontext()
    with ctx:
        comps = common.load_diffusers_parts(
            folder, ["transformer"], {"transformer": FluxTransformer2DModel}, {"transformer": torch.bfloat16}, "cpu",
            lambda _: "",
        )  # fmt: skip
    m = comps["transformer"].requires_grad_(False)
    params = sum(p.numel() for p in m.parameters())
    rows["loaded"] = _status()
    if place is None:
        convert(m, torch.device("cpu"))
    rows["fp8"] = _status()
    units = fam.swap_blocks(m)
    BlockSwap(m, units, len(units), torch.device("cpu"), swapped=place.swapped if place else None)
    rows["swapped"] = _status()
    return {"mode": mode, "params": params, "steps": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-host-load"))
    ap.add_argument("--double", type=int, default=4)
    ap.add_argument("--single", type=int, default=8)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one measurement in this process
    a = ap.parse_args()
    folder = a.work / f"flux-dev-{a.double}d-{a.single}s"
    if a.case:
        print(json.dumps(case(a.case, folder)))
        return
    if not (folder / "transformer").is_dir():
        build(folder, a.double, a.single)
    results = []
    for mode in ("mapped", "difftrain", "streamed"):
        cmd = [sys.executable, __file__, "--out", str(a.out), "--work", str(a.work), "--case", mode,
               "--double", str(a.double), "--single", str(a.single)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "host_load.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    n = results[0]["params"]
    print(f"FLUX.1 [dev] widths, {a.double} double + {a.single} single blocks: {n / 1e9:.2f} B parameters, "
          f"{n * 2 / GIB:.2f} GiB in bf16, {n / GIB:.2f} GiB in fp8")  # fmt: skip
    print("| read | after load: RSS (file pages) | after fp8: RSS (file pages) | after block swap: RSS (file pages) "
          "| peak RSS over the start |")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in results:
        s = r["steps"]
        cells = [f"{s[k]['VmRSS']:.2f} ({s[k]['RssFile']:.2f})" for k in ("loaded", "fp8", "swapped")]
        print(f"| {r['mode']} | {' | '.join(cells)} | {s['swapped']['VmHWM'] - s['start']['VmRSS']:.2f} |")


if __name__ == "__main__":
    main()
