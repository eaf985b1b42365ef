"""memory.engine fsdp (torch's FSDP2) on the CPU: one process trains as the plain engine does; two gloo processes
(`train --gpus 2`) train as one with the same global batch; a two-process checkpoint resumes on one (issue 28)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer, train

FULL = {
    "train.method": "full",
    "memory.weights.kind": "fp32",
    "train.mixed_precision": "no",
    "memory.optimizer.kind": "adamw",
    "train.learning_rate": 1e-3,
    "train.max_steps": 4,
    "train.checkpoint_every": 2,
    "save.precision": "fp32",
    "speed.compile": "false",
    "train.device": "cpu",
    "report.to": "[]",
    "report.html": "false",
}


def _close(a: dict, b: dict, rel: float) -> None:
    """Two exports of the same training: equal as a whole within ``rel`` (AdamW turns summation-order noise in
    near-zero gradients into steps of about the learning rate on single elements)."""
    assert a.keys() == b.keys() and len(a) > 100
    va, vb = (torch.cat([x[k].float().flatten() for k in sorted(x)]) for x in (a, b))
    assert ((va - vb).norm() / vb.norm()).item() < rel


@pytest.mark.slow
def test_fsdp_on_one_process_trains_as_the_plain_engine_and_checkpoints_whole_tensors(tiny_model, dataset, tmp_path):
    def cfg(out, **extra):
        sets = tiny_sets(tiny_model, dataset, tmp_path / out, **{**FULL, "data.cache_dir": tmp_path / "cache", **extra})
        return resolve(recipe="tiny-sdxl-lora", sets=sets).config

    plain = cfg("plain")
    precompute(plain)
    a = train(plain)
    t = Trainer(cfg("fsdp", **{"memory.engine.kind": "fsdp"}))
    b = t.run()
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(t.parts.trained["unet"], FSDPModule) and t.parts.fsdp
    # every block is its own FSDP unit
    assert sum(isinstance(m, FSDPModule) for m in t.parts.trained["unet"].modules()) > 10
    assert b.losses == pytest.approx(a.losses, rel=1e-5)
    import torch.distributed as dist

    assert not dist.is_initialized()  # the group of one FSDP made for this process ended with the run
    _close(load_file(a.saved[-1]), load_file(b.saved[-1]), 1e-4)
    # resumed from its step-2 shares, the run ends exactly where it ended uninterrupted
    again = train(cfg("fsdp", **{"memory.engine.kind": "fsdp"}), resume=str(b.checkpoints[0]))
    assert again.losses == pytest.approx(b.losses[2:], rel=1e-6)
    x, y = load_file(again.saved[-1]), load_file(b.saved[-1])
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    from safetensors import safe_open

    shares = sorted((b.checkpoints[-1] / "fsdp").glob("rank*.safetensors"))
    assert [p.name for p in shares] == ["rank00000.safetensors"]  # one process: one file of whole tensors
    with safe_open(str(shares[0]), framework="pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_slice("w:conv_in.weight").get_shape()) == tuple(t.parts.trained["unet"].conv_in.weight.shape)
    assert {"o:conv_in.weight:exp_avg", "o:conv_in.weight:exp_avg_sq", "o:conv_in.weight:step"} <= keys


@pytest.mark.slow
def test_fsdp_is_refused_where_it_cannot_train(tiny_model, dataset, tmp_path):
    from difftrain.errors import ConfigError

    for extra, needle in (
        ({"memory.optimizer.kind": "adamw8bit"}, "bitsandbytes' 8-bit AdamW does not step sharded"),
        ({"memory.engine.master_dtype": "bf16"}, "would lose every update smaller than bf16's step"),
        ({"memory.optimizer.kind": "adafactor"}, "adafactor does not step sharded"),
        ({"ema.enabled": "true"}, "ema reads whole weights"),
    ):
        with pytest.raises(ConfigError, match=needle):
            resolve(
                recipe="tiny-sdxl-lora",
                sets=tiny_sets(tiny_model, dataset, tmp_path, **{**FULL, "memory.engine.kind": "fsdp", **extra}),
            )
    # through the console script: exit 2, the reason, no traceback, nothing written
    sets = tiny_sets(tiny_model, dataset, tmp_path / "lora", **{**FULL, "memory.engine.kind": "fsdp",
                     "train.method": "lora"})  # fmt: skip
    r = _difftrain("train", "--recipe", "tiny-sdxl-lora", *[a for s in sets for a in ("--set", s)])
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and "memory.engine fsdp: it shards full fine-tunes" in text, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "lora" / "run").exists()


def _difftrain(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DIFFTRAIN_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.mark.slow
def test_two_fsdp_processes_train_as_one_and_their_checkpoint_resumes_on_one(tiny_model, _dataset_master, tmp_path):
    cache = tmp_path / "cache"
    precompute(resolve(recipe="tiny-sdxl-lora",
                       sets=tiny_sets(tiny_model, _dataset_master, tmp_path / "x", **{"data.cache_dir": cache})).config)  # fmt: skip

    def run(out: str, batch: int, *extra: str) -> subprocess.CompletedProcess:
        sets = tiny_sets(tiny_model, _dataset_master, tmp_path / out,
                         **{**FULL, "memory.engine.kind": "fsdp", "train.batch_size": batch, "data.cache_dir": cache,
                            "save.formats": "[diffusers]"})  # fmt: skip
        r = _difftrain("train", "--recipe", "tiny-sdxl-lora", *extra, *[a for s in sets for a in ("--set", s)])
        assert r.returncode == 0, r.stderr[-4000:]
        return r

    run("two", 1, "--gpus", "2")
    run("one", 2)

    def losses(out: str) -> list[float]:
        rows = (tmp_path / out / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in rows if "loss" in json.loads(x)]

    assert len(losses("one")) == 4 and losses("two") == pytest.approx(losses("one"), rel=1e-4)

    def unet(folder) -> dict:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    base = unet(tiny_model / "unet")

    def change(out: str) -> torch.Tensor:  # what training moved the UNet by
        sd = unet(tmp_path / out / "run" / "diffusers" / "unet")
        assert sd.keys() == base.keys()
        return torch.cat([sd[k].flatten() - base[k].float().flatten() for k in sorted(sd)])

    def near(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    two, one = change("two"), change("one")
    assert one.norm() > 0 and near(two, one) < 0.02
    first = sorted((tmp_path / "two" / "run" / "checkpoints").iterdir())[0]
    state = json.loads((first / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["engine"]["kind"] == "fsdp"
    from safetensors import safe_open

    rows = []  # each process wrote its own rows of every weight, the two together the whole
    for f in sorted((first / "fsdp").glob("rank*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            rows.append(h.get_slice("w:conv_in.weight").get_shape()[0])
    assert len(rows) == 2 and sum(rows) == base["conv_in.weight"].shape[0]
    # the two-process checkpoint at step 2, resumed on one process (same global batch): it ends as the two did;
    # with the optimizer's moments lost it would not (steps 3 and 4 would be Adam's first steps again)
    run("two", 2, "--resume", str(first))
    assert near(change("two"), two) < 0.02


@pytest.mark.parametrize("family,recipe", [("flux", "tiny-flux-lora"), ("sd3", "tiny-sd3-lora"),
                                           ("cogvideox", "tiny-cogvideox-lora"), ("wan", "tiny-wan-lora"),
                                           ("zimage", "tiny-zimage-lora"), ("krea2", "tiny-krea2-lora"),
                                           ("qwen-image", "tiny-qwen-image-lora"), ("flux2", "tiny-flux2-lora")])  # fmt: skip
def test_fsdp_trains_every_family_as_the_plain_engine(family, recipe, _dataset_master, tmp_path, recwarn):
    """Each family's denoiser built on the meta device, sharded block by block (its swap_blocks) and filled from the
    file (buffers too: rotary tables, position embeddings) trains as the plain engine does; no sharded unit hands out
    a view (FSDP2 warns that an in-place op on one would skip the all-gather: memory/fsdp.py copies them)."""
    from difftrain.families.registry import get_family

    model = get_family(family).build_tiny(tmp_path / "model")

    def cfg(out, **extra):
        sets = tiny_sets(model, _dataset_master, tmp_path / out, **{**FULL, "train.max_steps": 3, "save.formats": "[]",
                         "train.checkpoint_every": 1000, "data.cache_dir": tmp_path / "cache", **extra})  # fmt: skip
        return resolve(recipe=recipe, sets=sets).config

    plain = cfg("plain")
    precompute(plain)
    a = train(plain)
    b = train(cfg("fsdp", **{"memory.engine.kind": "fsdp"}))
    assert len(a.losses) == 3 and b.losses == pytest.approx(a.losses, rel=1e-5)
    assert not [w for w in recwarn if "returned a view tensor" in str(w.message)]


@pytest.mark.slow
def test_fsdp_with_offloaded_shares_trains_as_without_and_resumes(tiny_model, dataset, tmp_path):
    """memory.engine.offload_params (torch's CPUOffloadPolicy: the shares and AdamW's step on the CPU): on the CPU
    it moves nothing, so the plumbing is what is checked here: the same losses, and an exact resume."""

    def cfg(out, **extra):
        sets = tiny_sets(tiny_model, dataset, tmp_path / out, **{**FULL, "data.cache_dir": tmp_path / "cache",
                         "memory.engine.kind": "fsdp", **extra})  # fmt: skip
        return resolve(recipe="tiny-sdxl-lora", sets=sets).config

    plain = cfg("plain")
    precompute(plain)
    a = train(plain)
    b = train(cfg("off", **{"memory.engine.offload_params": "true"}))
    assert b.losses == pytest.approx(a.losses, rel=1e-6)
    c = train(cfg("off", **{"memory.engine.offload_params": "true"}), resume=str(b.checkpoints[0]))
    assert c.losses == pytest.approx(b.losses[2:], rel=1e-6)


@pytest.mark.slow
def test_an_fsdp_checkpoint_is_not_resumed_by_another_engine(tiny_model, dataset, tmp_path):
    """A resume under engine auto keeps FSDP (its checkpoint holds shares, not whole tensors), and says so where the
    config cannot train with it; a config naming another engine is refused with what to resume with."""
    from difftrain.errors import CheckpointError, ConfigError
    from difftrain.planning.engines import choose_engine

    def cfg(**extra):
        sets = tiny_sets(tiny_model, dataset, tmp_path, **{**FULL, "data.cache_dir": tmp_path / "cache", **extra})
        return resolve(recipe="tiny-sdxl-lora", sets=sets).config

    precompute(cfg())
    made = train(cfg(**{"memory.engine.kind": "fsdp", "train.max_steps": 2}))
    kept, line = choose_engine(cfg(), 2, 80.0, recorded={"kind": "fsdp"})
    assert kept.memory.engine.kind == "fsdp" and "as the checkpoint resumed was made" in line
    with pytest.raises(ConfigError, match=r"made with memory\.engine fsdp"):
        choose_engine(cfg(**{"memory.optimizer.kind": "adamw8bit"}), 2, 80.0, recorded={"kind": "fsdp"})
    with pytest.raises(CheckpointError, match="holds FSDP shares"):
        train(cfg(**{"memory.engine.kind": "single", "train.max_steps": 3}), resume=str(made.checkpoints[-1]))
    # through the console script: exit 1 (a failure: the checkpoint, not the usage), what to resume with, no
    # traceback, the checkpoint untouched
    before = {p.name: p.read_bytes() for p in (made.checkpoints[-1] / "fsdp").iterdir()}
    sets = tiny_sets(tiny_model, dataset, tmp_path, **{**FULL, "data.cache_dir": tmp_path / "cache",
                     "memory.engine.kind": "ddp", "train.max_steps": 3})  # fmt: skip
    r = _difftrain("train", "--recipe", "tiny-sdxl-lora", "--resume", str(made.checkpoints[-1]),
                   *[a for x in sets for a in ("--set", x)])  # fmt: skip
    text = " ".join(r.stderr.split())
    assert r.returncode == 1 and "holds FSDP shares" in text and "memory.engine: {kind: fsdp}" in text, r.stderr
    assert "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in (made.checkpoints[-1] / "fsdp").iterdir()} == before


@pytest.mark.slow
def test_fsdp_with_compiled_blocks_trains_as_eager(tiny_model, dataset, tmp_path, monkeypatch):
    """speed.compile under FSDP (named; auto keeps it eager until measured on GPUs): each block's forward is
    compiled and FSDP's gathering hooks stay around it, eager; with gradient checkpointing inside the compiled
    blocks the losses follow the eager FSDP run (inductor's C++ backend on the CPU)."""
    from difftrain.families.sdxl import SDXL

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # the transformer blocks only: SDXL's resnets come in many more shapes, each its own compile on the CPU
    # (222 s with them, for the same check of FSDP's hooks around a compiled forward)
    monkeypatch.setattr(SDXL, "repeated_blocks", ("BasicTransformerBlock",))

    def cfg(out, **extra):
        sets = {**FULL, "data.cache_dir": tmp_path / "cache", "memory.engine.kind": "fsdp", "train.max_steps": 3,
                "train.checkpoint_every": 1000, "memory.activations.kind": "checkpoint", **extra}  # fmt: skip
        return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, dataset, tmp_path / out, **sets)).config

    def weights(tr):
        from torch.distributed.tensor import DTensor

        unet = tr.parts.trained["unet"]
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone() for n, p in unet.named_parameters()}  # fmt: skip

    eager = cfg("eager")
    precompute(eager)
    te = Trainer(eager)
    a = te.run()
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    t = Trainer(cfg("compiled", **{"speed.compile": "true"}))
    b = t.run()
    # every weight eager FSDP changed, the compiled run changed too, by as much (a parameter whose gradient never
    # reached the optimizer shows here, not in the losses: on the GPU, ZeRO-3 with compiled blocks left the
    # transformer blocks' norm biases unchanged while its losses followed eager's to 0.02 %)
    base = {k: v.float() for f in sorted((tiny_model / "unet").glob("*.safetensors")) for k, v in load_file(f).items()}
    we, wc = weights(te), weights(t)
    moved = [n for n in we if not torch.equal(we[n], base[n])]
    assert len(moved) > 100
    assert [n for n in moved if torch.equal(wc[n], base[n])] == []
    # by as much, but for the few whose gradient is noise: a per-channel shift right before a GroupNorm (a resnet's
    # conv1 bias and time embedding, the last resnet's output biases before norm_out) has a near-zero gradient,
    # whose sign Adam turns into a whole step (measured: 0.005 % median difference, 17 of 428 tensors over 1 %)
    rel = [((wc[n] - we[n]).norm() / (we[n] - base[n]).norm()).item() for n in moved]
    noisy = [n for n, r in zip(moved, rel, strict=True) if r > 0.01]
    assert sorted(rel)[len(rel) // 2] < 1e-3
    odd = [n for n in noisy if not (n.endswith(".bias") or ".time_emb_proj." in n)]
    assert odd == [] and len(noisy) < 0.1 * len(moved), noisy
    from diffusers.models.attention import BasicTransformerBlock

    blocks = [m for m in t.parts.trained["unet"].modules() if isinstance(m, BasicTransformerBlock)]
    assert blocks and all("forward" in vars(m) for m in blocks)  # the forward compiled, not the hooked call
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured graphs (no silent eager fallback)
    assert b.losses == pytest.approx(a.losses, rel=2e-3, abs=1e-4)
    torch._dynamo.reset()
