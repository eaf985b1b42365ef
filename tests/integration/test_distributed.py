"""Several processes on gloo (CPU): DDP through `difftrain train --gpus 2` (torchrun's elastic agent)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.feed import recut
from difftrain.trainers.loop import Trainer

pytestmark = pytest.mark.slow
LORA = "pytorch_lora_weights.safetensors"


def _difftrain(*args: str, timeout: int = 600, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DIFFTRAIN_PROGRESS": "0", "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _same_training(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two runs of the same global batch: equal but for summation-order noise, which AdamW magnifies where a
    gradient is near zero (its update is m / sqrt(v)): at lr 1e-2 one element of 9 216 of a LoRA B matrix differed by
    2.1e-4 on an AVX512 machine with native bf16 (2026-11-25). Nearly every element within 1e-4, none past 5 % of
    the learning rate; another global batch or a skipped step moves them all by far more."""
    close = torch.isclose(a, b, rtol=1e-3, atol=1e-4)
    assert close.float().mean().item() > 0.999, (close.numel() - int(close.sum()), close.numel())
    torch.testing.assert_close(a, b, rtol=1e-2, atol=5e-4)


def _sets(model, data, out, cache, **extra):
    base = {
        "train.device": "cpu",
        "train.max_steps": 4,
        "train.checkpoint_every": 2,
        "train.learning_rate": 1e-2,
        "data.cache_dir": cache,
        "report.to": "[]",
        "report.html": "false",
    }
    return [a for s in tiny_sets(model, data, out, **{**base, **extra}) for a in ("--set", s)]


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory, tiny_model, _dataset_master):
    """The tiny SDXL LoRA on 2 processes x batch 2, and on 1 process x batch 4: the same global batch."""
    root = tmp_path_factory.mktemp("ddp")
    cache = root / "cache"
    # the cache at a fixed thread count, whatever the machine's cores or the test workers: the comparisons'
    # margin depends on the latents (AdamW at lr 1e-2 turns summation-order noise into weight differences),
    # and these tolerances were checked on a cache encoded with 2 threads
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        precompute(
            resolve(
                recipe="tiny-sdxl-lora",
                sets=tiny_sets(tiny_model, _dataset_master, root / "x", **{"data.cache_dir": cache}),
            ).config
        )
    finally:
        torch.set_num_threads(before)
    two = _difftrain(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--gpus",
        "2",
        *_sets(tiny_model, _dataset_master, root / "two", cache, **{"train.batch_size": 2}),
    )
    assert two.returncode == 0, two.stderr[-4000:]
    # the run's LoRA and metrics as it left them (a later test resumes into its folder)
    shutil.copy(root / "two" / "run" / LORA, root / "two.safetensors")
    shutil.copy(root / "two" / "run" / "metrics.jsonl", root / "two-metrics.jsonl")
    one = _difftrain(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        *_sets(tiny_model, _dataset_master, root / "one", cache, **{"train.batch_size": 4}),
    )
    assert one.returncode == 0, one.stderr[-4000:]
    return root, two, one


def test_two_processes_train_as_one_with_the_same_global_batch(two_procs):
    root, two, _ = two_procs
    assert "the 2 processes' trained weights agree" in two.stderr  # both ranks: bit-identical weights
    assert two.stderr.count("engine auto: DDP (no CUDA GPU to weigh the plan against)") == 1  # said once, by rank 0
    for run, kind in (("two", "ddp"), ("one", "single")):  # each checkpoint records the engine auto chose
        states = sorted((root / run / "run").glob("checkpoints/*/trainer_state.json"))
        assert states and all(json.loads(p.read_text())["engine"]["kind"] == kind for p in states), run
    a, b = load_file(root / "two.safetensors"), load_file(root / "one" / "run" / LORA)
    assert a.keys() == b.keys()
    for k in a:
        _same_training(a[k], b[k])
    la = [json.loads(x)["loss"] for x in (root / "two-metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (root / "one" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert la == pytest.approx(lb, rel=1e-4)  # the logged loss is the global batch's
    # one writer: rank 1 wrote its memory figures and nothing else
    assert (root / "two" / "run" / "stats.rank1.json").is_file()
    assert sorted(p.name for p in (root / "two" / "run").glob("checkpoints/*")) == sorted(
        p.name for p in (root / "one" / "run").glob("checkpoints/*")
    )


def test_a_two_process_checkpoint_resumes_on_one_process(two_procs, tiny_model, _dataset_master):
    root, _, _ = two_procs
    ckpts = sorted((root / "two" / "run" / "checkpoints").iterdir())
    first = ckpts[0]
    assert json.loads((first / "trainer_state.json").read_text())["world_size"] == 2
    # same global batch (1 x 4): the run continues exactly as the two processes did
    same = _difftrain(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--resume",
        str(first),
        *_sets(tiny_model, _dataset_master, root / "two", root / "cache", **{"train.batch_size": 4}),
    )
    assert same.returncode == 0, same.stderr[-3000:]
    # (resumed into the same folder: its final LoRA is the one-process continuation)
    a = load_file(root / "two" / "run" / LORA)
    b = load_file(root / "one" / "run" / LORA)
    for k in a:
        _same_training(a[k], b[k])
    # another global batch (1 x 2): the rest of the epoch is re-cut, every item still trained once
    other = _difftrain(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--resume",
        str(first),
        *_sets(tiny_model, _dataset_master, root / "two", root / "cache", **{"train.batch_size": 2}),
    )
    assert other.returncode == 0, other.stderr[-3000:]
    assert "global batch changed from 4 to 2" in other.stderr


def test_recut_serves_every_remaining_item_once_within_its_bucket():
    keys = ["a", "a", "b", "a", "b", "b", "a", "c"]
    batches = [[0, 1], [2, 4], [3, 6], [5], [7]]
    out = recut(batches, keys, 3)
    assert sorted(i for b in out for i in b) == list(range(8))
    assert all(len({keys[i] for i in b}) == 1 and len(b) <= 3 for b in out)
    assert out[0] == [0, 1, 3]  # bucket order and item order kept


def test_rank_one_is_quiet_and_every_error_names_its_rank(tiny_model, dataset, tmp_path):
    bad = _difftrain(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--gpus",
        "2",
        "--no-precompute",  # an empty cache, kept empty: both processes fail on it
        *_sets(tiny_model, dataset, tmp_path, tmp_path / "nocache"),
    )
    assert bad.returncode == 1
    assert "rank 0: error: No precomputed data" in bad.stderr and "rank 1: error: No precomputed data" in bad.stderr
    assert "train failed in 2 of the processes" in bad.stderr
    # a user error: the agent's restarts end at once, silently; the last message says so (not "after 3 restarts")
    assert bad.stderr.count("rank 0: error:") == 1 and bad.stderr.count("rank 1: error:") == 1
    assert "not restarted" not in bad.stderr
    assert "a restart would meet again" in bad.stderr and "after 3 restarts" not in bad.stderr


def test_a_single_process_trainer_is_not_distributed(tiny_model, dataset, tmp_path):
    cfg = resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, dataset, tmp_path)).config
    t = Trainer(cfg)
    assert not t.world.distributed and t.world.main


def test_precompute_on_two_processes_builds_the_same_cache(tiny_model, _dataset_master, tmp_path):
    from difftrain.data.cache import DataCache

    one = tmp_path / "one"
    precompute(
        resolve(
            recipe="tiny-sdxl-lora",
            sets=tiny_sets(tiny_model, _dataset_master, one, **{"data.cache_dir": one / "cache"}),
        ).config
    )
    r = _difftrain(
        "precompute",
        "--recipe",
        "tiny-sdxl-lora",
        "--gpus",
        "2",
        "--model",
        str(tiny_model),
        "--data-dir",
        str(_dataset_master),
        "--set",
        f"data.cache_dir={tmp_path / 'two' / 'cache'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = DataCache(one / "cache"), DataCache(tmp_path / "two" / "cache")
    ia, ib = a.read_json("index.json"), b.read_json("index.json")
    assert ia["items"] == ib["items"] and len(ia["items"]) == 8
    assert set(a.manifest["entries"]) == set(b.manifest["entries"])
    assert not list((tmp_path / "two" / "cache").glob("manifest.rank*.json"))
    # both processes wrote shards, and every entry reads back as the one process encoded it
    assert len(b.manifest["shards"]) >= 2
    for it in ia["items"][:3]:
        for key in (it["latent"], *it["texts"].values()):
            for name, t in a.get(key).items():
                torch.testing.assert_close(b.get(key)[name], t)
    assert "latents: 8 encoded" in r.stderr  # the first process reports the whole job


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_with_a_kill(model, data, root, name: str, kill: str, *extra: str) -> subprocess.CompletedProcess:
    """The two_procs run (2 processes x batch 2, its cache) into ``root/name``, process RANK killing itself once
    step STEP is done (``kill`` "RANK:STEP", DIFFTRAIN_TEST_KILL)."""
    sets = _sets(model, data, root / name, root / "cache", **{"train.batch_size": 2})
    return _difftrain("train", "--recipe", "tiny-sdxl-lora", "--gpus", "2", *extra, *sets, DIFFTRAIN_TEST_KILL=kill)


def test_a_killed_rank_restarts_the_group_which_ends_as_the_uninterrupted_run(two_procs, tiny_model, _dataset_master):
    """Issue 26, item 3: rank 1 is SIGKILLed after step 3 (the last checkpoint: step 2); torchrun's agent restarts
    the group, which continues from step-00000002 by itself, says so in one line, and ends with the LoRA of the
    uninterrupted run."""
    root, _, _ = two_procs
    r = _two_with_a_kill(tiny_model, _dataset_master, root, "killed", "1:3")
    assert r.returncode == 0, r.stderr[-4000:]
    text = " ".join(r.stderr.split())
    assert "restart 1 of 3: a process of the group ended" in text
    assert f"training continues from {root / 'killed' / 'run' / 'checkpoints' / 'step-00000002'} (step 2)" in text
    a, b = load_file(root / "killed" / "run" / LORA), load_file(root / "two.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # exact, as a resume is
    steps = [json.loads(x)["step"] for x in (root / "killed" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # step 3's first row went with the restart
    history = json.loads((root / "killed" / "run" / "run.json").read_text())["history"]
    assert [h["kind"] for h in history] == ["new", "restart"] and history[1]["step"] == 2


def test_a_killed_rank_with_no_restarts_left_is_named_with_its_cause(two_procs, tiny_model, _dataset_master):
    root, _, _ = two_procs
    r = _two_with_a_kill(tiny_model, _dataset_master, root, "dead", "1:1", "--max-restarts", "0")
    text = " ".join(r.stderr.split())
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "rank 1: killed by SIGKILL (the out-of-memory killer, or kill -9)" in text


def test_a_fault_before_the_first_step_ends_the_restarts_at_once(two_procs, tiny_model, _dataset_master):
    """An unexpected exception in rank 1 before any step (not a lost peer, not the group's communication) would
    meet the same inputs on every restart: the group is not restarted three times to find that out, and the last
    message says why and how to get the traceback."""
    root, _, _ = two_procs
    r = _two_with_a_kill(tiny_model, _dataset_master, root, "fault", "1:0:raise")
    text = " ".join(r.stderr.split())
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("rank 1: error: an unexpected RuntimeError: injected fault at step 0") == 1
    assert "a restart would meet again, so the group's restarts ended at once" in text
    assert "after 3 restarts" not in text and "restart 1 of 3" not in text
    assert "DIFFTRAIN_DEBUG=1" in text


def test_a_fault_after_a_checkpoint_restarts_the_group_which_ends_as_the_uninterrupted_run(
    two_procs, tiny_model, _dataset_master
):
    """The same exception once steps were done (here once step 2's checkpoint is written) may not come back (an
    allocator's fragmentation, a flaky GPU): the agent restarts the group, which continues from the checkpoint."""
    root, _, _ = two_procs
    r = _two_with_a_kill(tiny_model, _dataset_master, root, "late", "1:2:raise")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "restart 1 of 3: a process of the group ended" in " ".join(r.stderr.split())
    a, b = load_file(root / "late" / "run" / LORA), load_file(root / "two.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_nodes_on_one_host_train_as_one_node_and_resume_on_one(two_procs, tiny_model, _dataset_master):
    """Issue 26, item 4: two node launchers (--nodes 2, --node-rank 0 and 1, one process each) meet at a c10d
    rendezvous on localhost and train as the one-node run on two processes; a checkpoint of theirs resumes on a
    single process."""
    root, _, _ = two_procs
    port = str(_free_port())
    env = {**os.environ, "DIFFTRAIN_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    sets = _sets(tiny_model, _dataset_master, root / "nodes", root / "cache", **{"train.batch_size": 2})
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "difftrain",
                "train",
                "--recipe",
                "tiny-sdxl-lora",
                "--gpus",
                "1",
                "--nodes",
                "2",
                "--node-rank",
                str(n),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                *sets,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    run = root / "nodes" / "run"
    a, b = load_file(run / LORA), load_file(root / "two.safetensors")
    for k in a:
        _same_training(a[k], b[k])
    la = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (root / "two-metrics.jsonl").read_text().splitlines()]
    assert la == pytest.approx(lb, rel=1e-4)
    state = json.loads((run / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    # its checkpoint on one node, one process with the same global batch (a new folder: a fork)
    r = _difftrain(
        "train",
        "--recipe",
        "tiny-sdxl-lora",
        "--resume",
        str(run / "checkpoints" / "step-00000002"),
        *_sets(tiny_model, _dataset_master, root / "nodes-resumed", root / "cache", **{"train.batch_size": 4}),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(root / "nodes-resumed" / "run" / LORA), load_file(root / "one" / "run" / LORA)
    for k in a:
        _same_training(a[k], b[k])


def test_ddp_bucket_views_and_static_graph_train_bit_for_bit_as_the_defaults(tiny_model, _dataset_master, tmp_path):
    """memory.engine ddp's gradient_as_bucket_view and static_graph (issue 28: DDP's own options, to be measured
    for speed) change nothing of the training: the same LoRA, bit for bit; static_graph with accumulation is
    refused before any process starts."""
    cache = tmp_path / "cache"
    precompute(resolve(recipe="tiny-sdxl-lora",
                       sets=tiny_sets(tiny_model, _dataset_master, tmp_path / "x", **{"data.cache_dir": cache})).config)  # fmt: skip

    def run(out: str, **extra) -> subprocess.CompletedProcess:
        sets = _sets(tiny_model, _dataset_master, tmp_path / out, cache,
                     **{"train.batch_size": 1, "memory.engine.kind": "ddp", "train.checkpoint_every": "null", **extra})  # fmt: skip
        return _difftrain("train", "--recipe", "tiny-sdxl-lora", "--gpus", "2", *sets)

    plain = run("plain")
    tuned = run("tuned", **{"memory.engine.gradient_as_bucket_view": "true", "memory.engine.static_graph": "true"})
    assert plain.returncode == 0 and tuned.returncode == 0, (plain.stderr + tuned.stderr)[-4000:]
    a, b = load_file(tmp_path / "plain" / "run" / LORA), load_file(tmp_path / "tuned" / "run" / LORA)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    refused = run("acc", **{"memory.engine.static_graph": "true", "train.grad_accum": 2})
    assert refused.returncode == 2 and "static graph does not take" in " ".join(refused.stderr.split())
    assert "Traceback" not in refused.stderr and not (tmp_path / "acc" / "run").exists()


def test_a_qwen_image_full_fine_tune_trains_on_two_processes(_dataset_master, tmp_path):
    """Qwen-Image's last block computes a text stream the model never reads: DDP refused the trained step ("parameters
    that were not used in producing loss") until the family named them and the full fine-tune froze them; they are
    saved unchanged."""
    from difftrain.families.qwenimage import QwenImage

    model = QwenImage().build_tiny(tmp_path / "m")
    full = {"train.method": "full", "save.formats": "[diffusers]", "train.checkpoint_every": 1000}
    r = _difftrain("train", "--recipe", "tiny-qwen-image-lora", "--gpus", "2",
                   *_sets(model, _dataset_master, tmp_path / "two", tmp_path / "cache", **full))  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    after = load_file(next((tmp_path / "two" / "run").rglob("transformer/*.safetensors")))
    before = load_file(next((model / "transformer").glob("*.safetensors")))
    frozen = [
        k for k in before if k.startswith(("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.txt_mlp."))
    ]
    assert len(frozen) == 6 and all(torch.equal(after[k], before[k].to(after[k].dtype)) for k in frozen)
    assert not torch.equal(after["transformer_blocks.1.img_mlp.net.2.weight"],
                           before["transformer_blocks.1.img_mlp.net.2.weight"].to(after["transformer_blocks.1.img_mlp.net.2.weight"].dtype))  # fmt: skip
