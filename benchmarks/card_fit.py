"""Every GPU tier recipe trained as its card would let it (issue 23): `difftrain bench memory --card`.

For each recipe whose name states a card (``sdxl-lora-4gb``: 4 GiB), one subprocess runs
``difftrain bench memory --recipe R --card N --steps S --json ...`` on random weights of the real
architecture: torch's allocator capped at N GiB less the CUDA context and libraries measured in that process
and the 0.3 GiB display margin. First, in a process of its own, the context and libraries are measured
(memory/card.py measure_overhead, and nvidia-smi's figure for the same process). This parent process never
touches CUDA: its context would count as the children's.

    python benchmarks/card_fit.py --out $OUT [--recipes sdxl-lora-4gb,...] [--variants F.json] [--eager]
        [--steps 4] [--warmup N]

``--variants`` adds runs of a recipe with overrides, e.g. benchmarks/card_fit_variants.json: a list of
{"label", "recipe", "card", "sets": [...], "env": {...}} (how the recipes that did not fit were chosen).
``--only a,b`` keeps the runs whose label contains one of the fragments. ``--eager`` adds the plain diffusers+peft SDXL LoRA loop (memory_tiers.py's E-lora: bf16 UNet on the GPU,
checkpointing, no cap) for scale. Writes three files (the device tool brings back a few only): $OUT/card_fit.json
(the overhead and each run's figures from bench memory), $OUT/failures.log (the end of the output of each run that
did not finish) and $OUT/card_fit.md (the table, also printed last).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ORDER = [
    "sdxl-lora-3gb",
    "sdxl-lora-4gb",
    "sdxl-lora-8gb",
    "sdxl-full-8gb",
    "sdxl-full-12gb",
    "sd3-lora-4gb",
    "sd3-lora-8gb",
    "sd3-lora-16gb",
    "cogvideox-2b-lora-6gb",
    "cogvideox-5b-lora-12gb",
    "cogvideox-5b-full-12gb",
    "sdxl-full",
    "sdxl-full-te-24gb",
    "cogvideox-2b-lora-24gb",
    "cogvideox-5b-lora-24gb",
    "cogvideox-5b-i2v-lora-24gb",
    "flux-lora-8gb",
    "flux-lora-16gb",
    "flux-lora-24gb",
    "flux-full-24gb",
    "wan-1.3b-lora-8gb",
    "wan-1.3b-full-24gb",
    "wan-14b-lora-24gb",
    "wan-5b-lora-16gb",
    "wan-14b-lora-16gb",
    "wan-14b-lora-720p-24gb",
    "wan-1.3b-lora-24gb",
    "wan-14b-lora-80gb",
    "zimage-lora-6gb",
    "zimage-lora-12gb",
    "krea2-lora-8gb",
    "krea2-lora-12gb",
    "krea2-lora-24gb",
    "krea2-full-24gb",
    "flux2-klein-4b-lora-6gb",
    "flux2-klein-4b-lora-8gb",
    "flux2-klein-9b-lora-8gb",
    "flux2-klein-9b-lora-16gb",
    "qwen-image-lora-16gb",
    "zimage-lora-24gb",
    "zimage-lora-32gb",
    "krea2-lora-48gb",
    "qwen-image-lora-12gb",
    "qwen-image-lora-24gb",
    "qwen-image-edit-lora-24gb",
    "qwen-image-edit-lora-16gb",
    "qwen-image-lora-48gb",
    "flux2-klein-4b-full-24gb",
    "flux2-dev-lora-24gb",
    "flux2-klein-9b-lora-24gb",
    "flux2-klein-9b-lora-48gb",
    "flux2-klein-4b-lora-24gb",
    "qwen-image-2.1-lora-12gb",
    "qwen-image-2.1-lora-24gb",
    "qwen-image-2.1-lora-16gb",
    "flux2-dev-lora-16gb",
    "qwen-image-edit-lora-80gb",
    "flux2-dev-lora-96gb",
]

OVERHEAD = """
import json, os, subprocess, torch
from difftrain.memory.card import measure_overhead
d = torch.device("cuda", 0)
o = measure_overhead(d)
smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                     capture_output=True, text=True).stdout
mine = [int(x.split(",")[1]) for x in smi.strip().splitlines() if x.split(",")[0].strip() == str(os.getpid())]
print(json.dumps({"device": torch.cuda.get_device_name(d), "context_gib": o.context_gib,
                  "libraries_gib": o.libraries_gib, "torch_reserved_gib": torch.cuda.memory_reserved(d) / 2**30,
                  "nvidia_smi_process_mib": mine[0] if mine else None,
                  "total_gib": torch.cuda.mem_get_info(d)[1] / 2**30}))
"""


# builds the random model file and cache of a run before it is measured, in a process of its own: the run's host
# RSS is then what training takes, not what making random weights took
PREBUILD = """
import sys
from pathlib import Path
from difftrain.flows.bench import _prepare
from difftrain.config.load import resolve
_prepare(resolve(recipe=sys.argv[1], sets=sys.argv[3:]).config, Path(sys.argv[2]), 4, None)
"""


def write(out: Path, overhead: dict, rows: list, failures: list) -> str:
    """The three files, rewritten after every run (a call that runs out of time still brings back what finished)."""
    lines = [
        "| recipe | card | fits | allocated / reserved peak GiB | context+libraries GiB | left to torch GiB | headroom GiB "
        "| planned reserved / on card GiB | planner error allocated / reserved | host RSS peak load / train GiB "
        "| planned host GiB | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, status, j in rows:
        c = j.get("card") or {}
        res = j.get("peak_train_reserved_gib")
        alloc = j.get("peak_train_alloc_gib")
        err = (
            f"{(j['planned_alloc_gib'] - alloc) / alloc * 100:+.0f} % / {(j['planned_reserved_gib'] - res) / res * 100:+.0f} %"
            if res and alloc and status == "fits"
            else ""
        )
        o = c.get("overhead") or {}
        ctx = (o.get("context_gib") or 0) + (o.get("libraries_gib") or 0) if o else None
        f = lambda v, d=2: "" if v is None else f"{v:.{d}f}"
        st = j.get("stats") or {}
        rss = f"{f(st.get('peak_rss_gib_load'))} / {f(st.get('peak_rss_gib_train'))}" if st else ""
        lines.append(
            f"| {name} | {c.get('card_gib', '')} | {status} | {f(j.get('peak_train_alloc_gib'))} / {f(res)} | {f(ctx)} | {f(c.get('budget_gib'))} "
            f"| {f(c.get('headroom_gib'))} | {f(j.get('planned_reserved_gib'))} / {f(c.get('planned_card_gib'))} "
            f"| {err} | {rss} | {f(j.get('planned_host_gib'))} | {f(j.get('s_per_step'), 3)} |"
        )
    table = "\n".join(lines)
    (out / "card_fit.md").write_text(table + "\n")
    (out / "failures.log").write_text("".join(failures) or "none\n")
    all_runs = {"overhead": overhead, "runs": {name: {"status": st, **j} for name, st, j in rows}}
    (out / "card_fit.json").write_text(json.dumps(all_runs, indent=1, default=str) + "\n")
    return table


def _tier(name: str) -> float:
    """The card a recipe promises: its header's Tier line (sdxl-full's name has no size in it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from difftrain.config.recipes import recipe_header

    found = re.search(r"^Tier: ([0-9.]+) GiB", recipe_header(name), re.M)
    if found is None:
        raise SystemExit(f"{name}: its header states no Tier")
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipes", default=",".join(ORDER))
    ap.add_argument("--steps", type=int, default=4)
    # bench memory's default warm-up is two steps: its s/step is then the third's on, often just after compiling;
    # --steps 14 --warmup 6 times a tier as fast_default.py does (8 after 6), capped as its card, in one model load
    ap.add_argument("--warmup", type=int, default=None, help="bench memory --warmup (default: its own, 2)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/difftrain-card"))
    ap.add_argument("--budget", type=float, default=540, help="seconds: no recipe is started after this")
    ap.add_argument("--variants", type=Path, default=None)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated label fragments: run only the variants naming one")
    args = ap.parse_args()
    runs = [
        {"label": n, "recipe": n, "card": _tier(n), "sets": [], "env": {}}
        for n in filter(None, args.recipes.split(","))
    ]
    if args.variants:
        runs += json.loads(args.variants.read_text())
    if args.only:
        runs = [r for r in runs if any(k in r["label"] for k in args.only.split(","))]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", OVERHEAD], capture_output=True, text=True)
    overhead = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-2000:]}
    runs_dir = args.work / "card_fit_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    failures = []
    print("overhead:", overhead, flush=True)
    rows = []
    for run in runs:
        name = run["label"]
        left = args.budget - (time.time() - t0)
        if left < 60:
            rows.append((name, "not run (time)", {}))
            continue
        # labels have spaces and can run past a file name's 255 bytes (qe80-fp8-ck2-graphs' did, 2026-12-02): the
        # label's first 80 characters and a digest of the whole, which keeps two labels that start alike apart
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
        js = runs_dir / f"{slug}_{hashlib.sha1(name.encode()).hexdigest()[:8]}.json"
        js.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "difftrain", "bench", "memory", "--recipe", run["recipe"], "--card"]
        cmd += [f"{run['card']}gb", "--steps", str(args.steps), "--json", str(js)]
        cmd += ["--warmup", str(args.warmup)] if args.warmup is not None else []
        cmd += ["--work", str(args.work / run["recipe"].split("-")[0])]  # the prebuilt model and cache
        for s in run.get("sets", []):
            cmd += ["--set", s]
        work = str(args.work / run["recipe"].split("-")[0])
        pre = subprocess.run(
            [sys.executable, "-c", PREBUILD, run["recipe"], work, *run.get("sets", [])], capture_output=True, text=True
        )
        if pre.returncode != 0:
            failures.append(f"===== {name} prebuild (rc {pre.returncode})\n{pre.stderr[-3000:]}\n")
        t = time.time()
        try:
            env = dict(os.environ, **run.get("env", {}))
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
            if p.returncode != 0:
                failures.append(f"===== {name} (rc {p.returncode})\n{(p.stdout + p.stderr)[-4000:]}\n")
            status = (
                "fits" if p.returncode == 0 else "NO FIT" if p.returncode == 1 and js.exists() else f"rc {p.returncode}"
            )
        except subprocess.TimeoutExpired:
            status = "timeout"
        j = json.loads(js.read_text()) if js.exists() else {}
        st, c = j.get("stats") or {}, j.get("card") or {}
        figures = (  # in the log as each run ends: a call stopped at its time limit still brings these back
            f" (alloc / reserved {j.get('peak_train_alloc_gib')} / {j.get('peak_train_reserved_gib')} GiB, headroom "
            f"{c.get('headroom_gib')}, host RSS load / train / end {st.get('peak_rss_gib_load')} / "
            f"{st.get('peak_rss_gib_train')} / {st.get('peak_rss_gib_end')}, {j.get('s_per_step')} s/step after {j.get('warmup')} steps)"
            if j
            else ""
        )
        print(f"{name}: {status} in {time.time() - t:.0f} s{figures}", flush=True)
        rows.append((name, status, j))
        write(args.out, overhead, rows, failures)
    if args.eager and args.budget - (time.time() - t0) > 60:
        here = Path(__file__).resolve().parent
        cmd = [sys.executable, str(here / "memory_tiers.py"), "--case", "E-lora", "--steps", str(args.steps)]
        p = subprocess.run(cmd + ["--work", str(args.work / "eager")], capture_output=True, text=True, cwd=here)
        res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        e = json.loads(res[-1][7:]) if res else {}
        print("eager:", e or p.stderr[-1500:], flush=True)
        st = e.get("stats", {})
        rows.append(
            (
                "eager diffusers+peft SDXL LoRA (no cap)",
                "-" if e else f"rc {p.returncode}",
                {"peak_train_reserved_gib": st.get("gpu_peak_reserved_gib"), "s_per_step": e.get("s_per_step_median")},
            )
        )
    print(write(args.out, overhead, rows, failures))


if __name__ == "__main__":
    main()
