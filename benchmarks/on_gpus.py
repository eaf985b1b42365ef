"""Several benchmark commands at once, each on a GPU of its own, inside one device call's time (a multi-GPU machine
lent for measurements that need one GPU each: four cases in the time of one).

    python3 benchmarks/on_gpus.py --out $OUT --budget 520 \\
        --job '0=python3 benchmarks/fast_default.py --out {out} --work {work} --cases plain-wan,wan-1.3b-lora-8gb' \\
        --job '1=python3 benchmarks/card_fit.py --out {out} --work {work} --recipes "" --variants F.json --only a' \\
        --job '1=python3 benchmarks/card_fit.py --out {out} --work {work} --recipes "" --variants F.json --only b'

Each ``--job GPU=COMMAND`` runs with CUDA_VISIBLE_DEVICES=GPU; jobs naming the same GPU run one after another, the
GPUs at once. ``{out}`` is the job's folder under --out (brought back), ``{work}`` a folder of its own under --work,
removed when the job ends unless --keep: the 2026-11-28 calls filled the machine's disk with earlier jobs' random
models and the next jobs died writing theirs (a random Qwen-Image transformer is 41 GB: four at once take 164 of a
four-GPU machine's 235 GB; give one job several variants rather than a job each, so it builds its model once). A job
past the budget is stopped (its process group, SIGTERM then SIGKILL) with what it wrote kept. Each job's output goes to
``--out``/jobN.log; the last lines of every log are printed at the end (the tables the scripts print last).

The GPUs are separate but the host is shared: CPU-bound work (compiling, launch-bound steps, host copies) runs beside
the other jobs', which docs/benchmarks.md says beside such figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path


def _run_queue(jobs: list[tuple[int, str]], gpu: str, args: argparse.Namespace, deadline: float, rcs: dict) -> None:
    for i, command in jobs:
        out, work = args.out / f"job{i}", args.work / f"job{i}"
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        cmd = command.format(out=out, work=work, gpu=gpu)
        left = deadline - time.time()
        if left < 5:
            rcs[i] = "not run (time)"
            continue
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
        with open(args.out / f"job{i}.log", "w") as log:
            log.write(f"$ CUDA_VISIBLE_DEVICES={gpu} {cmd}\n")
            log.flush()
            p = subprocess.Popen(cmd, shell=True, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rcs[i] = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                    try:
                        os.killpg(p.pid, sig)
                        p.wait(timeout=wait)
                        break
                    except (subprocess.TimeoutExpired, ProcessLookupError):
                        continue
                rcs[i] = "stopped at the budget"
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _bundle(out: Path) -> None:
    """The jobs' folders as one jobs.json ({"jobN/file": text}): a device call brings back at most 8 files, and four
    jobs' json, tables and failure logs are more than that (2026-11-28: the card fits' figures did not come back)."""
    files = {
        str(f.relative_to(out)): f.read_text(errors="replace")
        for d in sorted(out.glob("job*/"))
        for f in sorted(d.rglob("*"))
        if f.is_file() and f.stat().st_size < 4 * 2**20
    }
    if files:
        (out / "jobs.json").write_text(json.dumps(files, indent=1) + "\n")
        for d in out.glob("job*/"):
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/on_gpus"))
    # 520: device.sh's install and the jobs' stop take ~50 s of a call's 600 (a budget of 550 ran past 600 on
    # 2026-11-28, and the call's closing table, printed last, was lost)
    ap.add_argument("--budget", type=float, default=520, help="seconds from the start: jobs still running are stopped")
    ap.add_argument("--job", action="append", default=[], help="GPU=COMMAND ({out}, {work} and {gpu} filled in)")
    ap.add_argument("--tail", type=int, default=25, help="lines of each job's log printed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the jobs' work folders")
    args = ap.parse_args()
    deadline = time.time() + args.budget
    queues: dict[str, list[tuple[int, str]]] = {}
    for i, job in enumerate(args.job):
        gpu, sep, command = job.partition("=")
        if not sep or not gpu.strip() or not command.strip():
            raise SystemExit(f"--job {job!r}: give it as GPU=COMMAND, e.g. '0=python3 benchmarks/x.py --out {{out}}'")
        queues.setdefault(gpu.strip(), []).append((i, command))
    args.work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.work).free / 2**30
    print(
        f"on_gpus: {len(args.job)} jobs on GPUs {', '.join(queues)}; {free:.0f} GiB free under {args.work}", flush=True
    )
    rcs: dict[int, object] = {}
    threads = [
        threading.Thread(target=_run_queue, args=(jobs, gpu, args, deadline, rcs)) for gpu, jobs in queues.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    _bundle(args.out)
    for i, job in enumerate(args.job):
        log = args.out / f"job{i}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        print(f"\n===== job{i} (GPU {job.partition('=')[0]}): {rcs.get(i)}")
        print("\n".join(line[:400] for line in lines[-args.tail :]))


if __name__ == "__main__":
    main()
