"""The launcher and platform guards of several-process training, with the platform simulated."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from difftrain.runtime import distributed as d


def test_world_comes_from_torchruns_environment():
    assert d.world_from_env({}) == d.World(0, 1, 0)
    w = d.world_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (w.rank, w.size, w.local_rank, w.main, w.distributed) == (3, 4, 1, False, True)


def test_windows_gets_a_store_without_libuv_and_linux_keeps_the_default():
    assert d.launcher_env({}, platform="win32")["USE_LIBUV"] == "0"
    assert "USE_LIBUV" not in d.launcher_env({}, platform="linux")
    assert d.launcher_env({"USE_LIBUV": "1"}, platform="win32")["USE_LIBUV"] == "1"  # the user's choice stands


def test_gloo_where_there_is_no_nccl():
    assert d.backend_for(torch.device("cpu")) == "gloo"


def test_ddp_buckets_stay_under_2_to_the_31_elements():
    sdxl_full = 2_567_463_684  # the SDXL UNet's parameters: more than a 32-bit size holds
    opts = d.ddp_options(sdxl_full, "gloo")
    assert opts["bucket_cap_mb"] * 2**20 / 4 < d.INT32_MAX and opts["gradient_as_bucket_view"] is False
    huge = d.ddp_options(sdxl_full, "gloo", bucket_cap_mb=10_000)  # a cap of 2.6 G elements, as a user might set
    assert huge["bucket_cap_mb"] * 2**20 / 4 < d.INT32_MAX
    assert "gradient_as_bucket_view" not in d.ddp_options(1_000_000, "gloo")
    assert d.ddp_options(10**6, "nccl", bucket_cap_mb=100)["bucket_cap_mb"] == 100


def test_global_batches_split_evenly_and_cover_every_item():
    w = [d.World(r, 3, r) for r in range(3)]
    slices = [d.local_slice(8, x) for x in w]
    assert [(s.start, s.stop) for s in slices] == [(0, 3), (3, 6), (6, 8)]
    assert [d.local_slice(6, x).stop - d.local_slice(6, x).start for x in w] == [2, 2, 2]


def test_workers_run_the_users_command_without_the_launcher_options():
    argv = [
        "train",
        "--recipe",
        "r",
        "--gpus",
        "4",
        "--nodes=2",
        "--node-rank",
        "1",
        "--master-addr",
        "h",
        "--max-restarts=2",
        "--set",
        "a=1",
    ]
    assert d.worker_argv(argv) == ["train", "--recipe", "r", "--set", "a=1"]
    one = d.torchrun_args(4, ["train"], max_restarts=3)
    assert "--standalone" in one and one[-3:] == ["--module", "difftrain", "train"] and "--max-restarts=3" in one
    # several machines: a c10d rendezvous at --master-addr:--master-port, hosted by node rank 0 (so that every
    # machine's agent restarts its workers when a process dies on any of them)
    multi = d.torchrun_args(8, ["train"], nodes=2, node_rank=1, master_addr="10.0.0.1")
    assert "--rdzv-backend=c10d" in multi and "--rdzv-endpoint=10.0.0.1:29500" in multi and "--nnodes=2" in multi
    assert "--rdzv-conf=is_host=0" in multi and "--master-addr=10.0.0.1" not in multi
    host = d.torchrun_args(8, ["train"], nodes=2, node_rank=0, master_addr="10.0.0.1", master_port=1234)
    assert "--rdzv-conf=is_host=1" in host and "--rdzv-endpoint=10.0.0.1:1234" in host
    rdzv = d.torchrun_args(8, ["train"], nodes=2, rdzv_endpoint="h:29400")
    assert "--rdzv-endpoint=h:29400" in rdzv and "--standalone" not in rdzv
    # one machine with an address given: torchrun's static rendezvous, as before
    static = d.torchrun_args(2, ["train"], master_addr="127.0.0.1", master_port=2345)
    assert "--master-addr=127.0.0.1" in static and "--master-port=2345" in static


def test_a_failed_processs_cause_is_named():
    assert d.failure_cause(-9) == "killed by SIGKILL (the out-of-memory killer, or kill -9)"
    assert d.failure_cause(-6).startswith("killed by SIGABRT")
    assert d.failure_cause(1, "RuntimeError: boom") == "exit code 1: RuntimeError: boom"
    assert d.failure_cause(1, "To enable traceback see: https://...") == "exit code 1"


def test_a_process_that_lost_its_peer_says_so_not_that_it_found_a_bug(monkeypatch, capsys):
    from difftrain.cli.app import report_error

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    err = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34738. This is ...")
    assert report_error(err) == 1
    text = " ".join(capsys.readouterr().err.split())
    assert "rank 0: error: lost a process of the group (" in text and "report it" not in text
    assert "restarts the group while train.max_restarts allows" in text
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no peer to lose, the message as any unexpected error
    report_error(err)
    assert "an unexpected RuntimeError" in capsys.readouterr().err


def test_each_restart_of_the_group_keeps_its_keys_apart_in_the_agents_store():
    """torchrun's agent keeps one store across the group's restarts: a restarted group must not read the dead
    group's keys (its gloo addresses)."""
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}
    world = d.World(rank=0, size=1)
    first = d.attempt_store(world, datetime.timedelta(seconds=10), {**env, "TORCHELASTIC_RESTART_COUNT": "0"})
    again = d.attempt_store(world, datetime.timedelta(seconds=10), {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    first.set("rank_0", "dead address")
    assert not again.check(["rank_0"])  # the restarted group does not see it
    assert server.get("difftrain/attempt_0/rank_0") == b"dead address"
    assert d.attempt_store(world, datetime.timedelta(seconds=10), {}) is None  # not under the agent: torch's own


@pytest.mark.slow
def test_fused_backward_on_several_ddp_processes_is_refused_before_any_process_starts(tiny_model, dataset, tmp_path):
    """fused_backward steps each weight inside backward, before DDP averages its gradient: on 2 gloo processes the
    run trained to its end, then stopped on "different weights". The launcher now refuses it at once, and so does
    each process (torchrun started directly); one process, or DeepSpeed, is unaffected."""
    from pathlib import Path

    from difftrain.config.load import resolve
    from difftrain.runtime.distributed import engine_problem

    full = ["train.method=full", "memory.fused_backward=true", "memory.optimizer.kind=adafactor",
            "train.max_grad_norm=null"]  # fmt: skip
    cfg = resolve(recipe="tiny-sdxl-lora", sets=full).config
    assert "memory.fused_backward on 2 processes" in engine_problem(cfg, 2)
    assert engine_problem(cfg, 1) is None
    assert engine_problem(resolve(recipe="tiny-sdxl-lora").config, 2) is None  # a LoRA without it trains on 2
    offload = ["train.method=full", "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
               "train.max_grad_norm=null"]  # fmt: skip
    assert "offload_gradients on 2 processes" in engine_problem(
        resolve(recipe="tiny-sdxl-lora", sets=offload).config, 2
    )
    from difftrain.errors import ConfigError
    from difftrain.trainers import setup
    from difftrain.trainers.setup import prepare_process

    named = resolve(recipe="tiny-sdxl-lora", sets=[*full, "memory.engine.kind=single"]).config
    with pytest.raises(ConfigError, match="fused_backward on 2 processes"):  # a process under torchrun, before init
        prepare_process(named, d.World(rank=1, size=2, local_rank=1), torch.device("cpu"))
    # engine auto (the default) decides after the group forms: no CUDA GPU, so DDP, which cannot train it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(setup.dist_, "broadcast_object", lambda obj, world: obj)
        with pytest.raises(ConfigError, match="fused_backward on 2 processes"):
            setup.choose_engine(cfg, d.World(rank=1, size=2, local_rank=1), torch.device("cpu"), None)
    script = Path(sys.executable).parent / "difftrain"
    out = tmp_path / "run"
    args = [str(script), "train", "--recipe", "tiny-sdxl-lora", "--gpus", "2", "--set", f"model.path={tiny_model}",
            "--set", f"data.dir={dataset}", "--set", f"train.output_dir={out}", "--set", "train.device=cpu"]  # fmt: skip
    for s in full:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "memory.fused_backward on 2 processes" in r.stderr and "memory.engine: {kind: deepspeed" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()  # refused before the run folder or a process


@pytest.mark.parametrize("trained,backend,view", [(10**6, "nccl", True), (2_567_463_684, "gloo", False)])
def test_ddp_engine_options_reach_the_wrappers(monkeypatch, trained, backend, view):
    """memory.engine ddp's gradient_as_bucket_view and static_graph are handed to DistributedDataParallel, except
    the bucket view where gloo needs it off (over 2^31 trained elements)."""
    from difftrain.config.schema import EngineDDP
    from difftrain.trainers import setup

    made = []

    class Recorder:
        def __init__(self, module, device_ids=None, **opts):
            made.append(opts)

    monkeypatch.setattr(setup, "DDP", Recorder)
    monkeypatch.setattr(d, "backend_for", lambda device: backend)
    engine = EngineDDP(gradient_as_bucket_view=True, static_graph=True)
    cfg = type("Cfg", (), {"memory": type("M", (), {"engine": engine})()})()
    p = torch.nn.Parameter(torch.zeros(1))
    parts = setup.Parts(comps={}, trained={"unet": torch.nn.Linear(1, 1)}, params=[p], groups=[])
    monkeypatch.setattr(p, "numel", lambda: trained, raising=False)
    setup._wrap_ddp(cfg, d.World(0, 2, 0), torch.device("cpu"), parts)
    assert made and made[0]["static_graph"] is True and made[0]["gradient_as_bucket_view"] is view
