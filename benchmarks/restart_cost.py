"""What a dying process costs a multi-GPU run, and two nodes rehearsed on one host (issue 26).

Cases (SDXL LoRA r16 at 1024 on random weights of the real architecture, as benchmarks/multi_gpu.py makes them;
DIFFTRAIN_BENCH_TINY=1: the tiny SDXL at 128 px on CPU/gloo):

- ``single``: ``difftrain train --gpus 2`` on one node: s/step (median after 2 warm-up steps), losses.
- ``nodes``: the same on two node launchers of one GPU each (``--nodes 2 --node-rank 0|1``, a c10d rendezvous on
  127.0.0.1): s/step and its losses beside ``single``'s.
- ``restart``: ``--gpus 2`` with rank 1 SIGKILLed once step ``kill`` is done (DIFFTRAIN_TEST_KILL, the fault
  the tests inject; checkpoints every ``every`` steps): seconds from the kill to the next completed step (the
  first metrics row of the step after the checkpoint the group continues from, polled every 20 ms), and the
  restarted attempt's load time.

    python benchmarks/restart_cost.py --work /tmp/rc --out $OUT
    DIFFTRAIN_BENCH_TINY=1 python benchmarks/restart_cost.py --work /tmp/rc      # CPU / gloo
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from multi_gpu import SDXL, TINY, prepare


def _sets(work: Path, run_dir: Path, steps: int, every: int | None) -> list[str]:
    sets = [*SDXL, "speed.sync_seconds=0"]
    if TINY:
        sets = [s.replace("resolution=1024", "resolution=128") for s in sets]
        sets += ["data.min_side=32", "model.config=sdxl-tiny", "train.device=cpu"]
    else:
        sets += ["train.device=cuda"]
    model, tok, cache = prepare(sets, work, 2)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return [
        *sets,
        f"model.path={model}",
        f"model.tokenizer_path={tok}",
        f"data.cache_dir={cache}",
        f"train.output_dir={run_dir}",
        f"train.max_steps={steps}",
        f"train.checkpoint_every={every}" if every else "train.checkpoint_every=null",
    ]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec:
            out.append(rec)
    return out


def _s_per_step(rows: list[dict]) -> float | None:
    dts = [b["time"] - a["time"] for a, b in itertools.pairwise(rows)][2:]
    return round(statistics.median(dts), 4) if dts else None


def _cmd(sets: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "difftrain", "train", *extra, *[a for s in sets for a in ("--set", s)]]


def _env(**extra: str) -> dict:
    return {**os.environ, "DIFFTRAIN_PROGRESS": "0", **extra}


def single(work: Path, steps: int) -> dict:
    run_dir = work / "run-single"
    sets = _sets(work, run_dir, steps, None)
    t = time.time()
    p = subprocess.run(_cmd(sets, "--gpus", "2"), capture_output=True, text=True, env=_env())
    if p.returncode:
        return {"case": "single", "error": p.stderr[-3000:]}
    rows = _rows(run_dir)
    return {
        "case": "single",
        "wall_s": round(time.time() - t, 1),
        "s_per_step": _s_per_step(rows),
        "losses": [r["loss"] for r in rows],
    }


def nodes(work: Path, steps: int) -> dict:
    run_dir = work / "run-nodes"
    sets = _sets(work, run_dir, steps, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    t = time.time()
    procs = []
    for n in (0, 1):
        env = _env() if TINY else _env(CUDA_VISIBLE_DEVICES=str(n))
        args = ["--gpus", "1", "--nodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1"]
        procs.append(
            subprocess.Popen(
                _cmd(sets, *args, "--master-port", port),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    errs = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        return {"case": "nodes", "error": "\n".join(e[-2000:] for e in errs)}
    rows = _rows(run_dir)
    return {
        "case": "nodes",
        "wall_s": round(time.time() - t, 1),
        "s_per_step": _s_per_step(rows),
        "losses": [r["loss"] for r in rows],
    }


def restart(work: Path, steps: int, every: int, kill: int) -> dict:
    run_dir = work / "run-restart"
    sets = _sets(work, run_dir, steps, every)
    note = work / "killed-at.txt"
    note.unlink(missing_ok=True)
    env = _env(DIFFTRAIN_TEST_KILL=f"1:{kill}", DIFFTRAIN_TEST_KILL_NOTE=str(note))
    t = time.time()
    p = subprocess.Popen(_cmd(sets, "--gpus", "2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    resumed_at = every * (kill // every)
    seen = None
    while p.poll() is None:
        if seen is None and note.exists():
            history = json.loads((run_dir / "run.json").read_text()).get("history", [])
            if any(h.get("kind") == "restart" for h in history) and any(
                r["step"] == resumed_at + 1 for r in _rows(run_dir)
            ):
                seen = time.time()
        time.sleep(0.02)
    err = p.communicate()[1]
    if p.returncode:
        return {"case": "restart", "error": err[-3000:]}
    killed = float(note.read_text())
    stats = json.loads((run_dir / "stats.json").read_text())
    rows = _rows(run_dir)
    # the agent's line when it saw the dead process ("failed (exitcode: -9) ... local_rank: 1"), its clock
    noticed = None
    for ln in err.splitlines():
        if "failed (exitcode" in ln and len(ln.split()) > 1:
            hms = ln.split()[1]
            day = time.strftime("%Y-%m-%d", time.localtime(killed))
            noticed = time.mktime(time.strptime(f"{day} {hms.split('.')[0]}", "%Y-%m-%d %H:%M:%S")) + float(
                "0." + hms.split(".")[1]
            )
            break
    restarted = next(
        (h.get("t") for h in json.loads((run_dir / "run.json").read_text())["history"] if h["kind"] == "restart"), None
    )
    return {
        "case": "restart",
        "wall_s": round(time.time() - t, 1),
        "killed_after_step": kill,
        "resumed_from_step": resumed_at,
        "kill_to_next_step_s": seen and round(seen - killed, 2),
        # kill -> the agent saw it and stopped the group; -> the restarted first process claimed the folder (its
        # interpreter, torch and difftrain imported); -> the first step after the checkpoint logged (the model
        # loaded, the checkpoint read, one step)
        "kill_to_agent_s": noticed and round(noticed - killed, 2),
        "agent_to_restarted_s": noticed and restarted and round(restarted - noticed, 2),
        "restarted_to_step_s": restarted and seen and round(seen - restarted, 2),
        "restarted_load_s": stats.get("load_seconds"),
        "steps_logged": [r["step"] for r in rows],
        "restart_line": next((ln for ln in err.splitlines() if "restart 1 of" in ln), None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default="single,nodes,restart")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4, help="checkpoint every N steps (the restart case)")
    ap.add_argument("--kill", type=int, default=6, help="rank 1 is killed once this step is done")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        if case == "restart":
            r = restart(args.work, args.steps, args.every, args.kill)
        else:
            r = {"single": single, "nodes": nodes}[case](args.work, args.steps)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "restart_cost.json").write_text(json.dumps(results, indent=1))
    print("\ncase     s/step   wall s  kill->next step s  note")
    for r in results:
        extra = r.get("error", "")[:80] or (
            f"resumed from {r['resumed_from_step']}: kill->agent {r['kill_to_agent_s']} s, agent->restarted process "
            f"{r['agent_to_restarted_s']} s, ->next step {r['restarted_to_step_s']} s (load {r['restarted_load_s']} s)"
            if r["case"] == "restart"
            else ""
        )
        print(
            f"{r['case']:<8} {r.get('s_per_step') or '-':>7} {r.get('wall_s', '-'):>7} "
            f"{r.get('kill_to_next_step_s') or '-':>18}  {extra}"
        )


if __name__ == "__main__":
    main()
