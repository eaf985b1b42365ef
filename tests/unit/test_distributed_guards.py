"""The launcher and platform guards of several-process training, with the platform simulated."""

from __future__ import annotations

import torch

from difftrain import distributed as d


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
        "--set",
        "a=1",
    ]
    assert d.worker_argv(argv) == ["train", "--recipe", "r", "--set", "a=1"]
    one = d.torchrun_args(4, ["train"])
    assert "--standalone" in one and one[-3:] == ["--module", "difftrain", "train"]
    multi = d.torchrun_args(8, ["train"], nodes=2, node_rank=1, master_addr="10.0.0.1")
    assert "--node-rank=1" in multi and "--master-addr=10.0.0.1" in multi and "--nnodes=2" in multi
    rdzv = d.torchrun_args(8, ["train"], nodes=2, rdzv_endpoint="h:29400")
    assert "--rdzv-endpoint=h:29400" in rdzv and "--standalone" not in rdzv
