"""FSDP checkpoints with torchao's 8- and 4-bit AdamW moments (memory.engine fsdp + adamw8bit/adamw4bit, issue 53):
each process writes its quantized shares as their parts (codes and scales, no bigger than held); a resume on as many
processes gets them back bit for bit, on another count each share is dequantized, cut and quantized again.

The optimizer's step runs on CUDA only (tests/gpu/test_multi_gpu.py trains with it); here its state is set by hand
on two gloo processes and one, which is all save_shares / load_shares see. torchao is not in the main test run's
install (CI runs this file with it on the path)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.optim")

SCRIPT = r"""
import json, os, sys, zlib
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import torchao.optim as ao
from difftrain.memory import fsdp
from difftrain.memory.optimizers import local_shares

kind, folder, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
folder.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
fully_shard(model)
# as make_optimizer builds it under memory.engine fsdp: torchao's AdamW over the local shares
opt = local_shares(ao.AdamW8bit if kind == "8bit" else ao.AdamW4bit)(model.parameters(), lr=1e-2)


def whole(name, what):  # the same seeded full tensor on every process: what the moments are set to
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{what}".encode()))
    shape = dict(model.named_parameters())[name].shape
    t = torch.randn(shape, generator=g)
    return t.abs() if what == "exp_avg_sq" else t


def rows(p, t):  # this process's rows of a whole tensor (FSDP's Shard(0))
    start, end = fsdp._rows(p.shape[0], world, rank)
    return t[start:end]


names = {id(p): n for n, p in model.named_parameters()}
if mode == "step":  # two steps on the shares against torchao's own optimizer on the whole model
    whole_model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
    whole_model.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    ref = (ao.AdamW8bit if kind == "8bit" else ao.AdamW4bit)(whole_model.parameters(), lr=1e-2)
    start = {n: p.detach().clone() for n, p in whole_model.named_parameters()}
    for i in range(2):
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(i))
        for m, o in ((model, opt), (whole_model, ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    out = {}
    for n, p in model.named_parameters():
        got, want = p.detach().full_tensor(), dict(whole_model.named_parameters())[n].detach()
        out[n] = {"equal": torch.equal(got, want), "moved": not torch.equal(got, start[n])}
    (folder / f"step{rank}.json").write_text(json.dumps(out))
elif mode == "save":
    for p in model.parameters():
        st = opt.state[p]
        st["step"] = torch.tensor(3.0)
        for what, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            buf = opt._new_buffer(p, signed)
            assert not isinstance(buf, torch.distributed.tensor.DTensor)  # this process's own moments
            buf.copy_(rows(p, whole(names[id(p)], what)))
            st[what] = buf
    fsdp.save_shares(model, opt, folder, rank, world)
    saved = {f"{names[id(p)]}:{w}": getattr(opt.state[p][w], "codes", None) for p in model.parameters()
             for w in ("exp_avg", "exp_avg_sq")}
    torch.save({k: v for k, v in saved.items() if v is not None}, folder / f"codes{rank}.pt")
else:
    fsdp.load_shares(model, opt, folder, rank, world)
    out = {}
    for p in model.parameters():
        n = names[id(p)]
        assert float(opt.state[p]["step"]) == 3.0
        for what in ("exp_avg", "exp_avg_sq"):
            local = opt.state[p][what]
            value = local.dequantize() if hasattr(local, "dequantize") else local
            err = (value - rows(p, whole(n, what))).abs().max().item()
            fresh = opt._new_buffer(p, what == "exp_avg")  # the same values quantized once, here
            fresh.copy_(rows(p, whole(n, what)))
            once = ((fresh.dequantize() if hasattr(fresh, "dequantize") else fresh) - rows(p, whole(n, what)))
            out[f"{n}:{what}"] = {"err": err, "once": once.abs().max().item(), "quantized": hasattr(local, "codes"),
                                  "codes": local.codes.tolist() if hasattr(local, "codes") else None}
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # torchao steps only with lr as a tensor
    (folder / f"loaded{rank}-{world}.json").write_text(json.dumps(out))
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp: Path, n: int, *args: str) -> None:
    script = tmp / "shares.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={_port()}"]
    r = subprocess.run([*cmd, str(script), *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_quantized_fsdp_shares_resume_exactly_on_as_many_processes_and_closely_on_another_count(kind, tmp_path):
    from safetensors import safe_open

    folder = tmp_path / "fsdp"
    _run(tmp_path, 2, kind, str(folder), "save")
    files = sorted(folder.glob("rank*.safetensors"))
    assert [f.name for f in files] == ["rank00000.safetensors", "rank00001.safetensors"]
    with safe_open(str(files[0]), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        codes = f.get_tensor("o:0.weight:exp_avg#codes")
    # the quantized moments are stored as their parts (uint8 codes, a scale a block), not as floats
    assert codes.dtype == torch.uint8 and "o:0.weight:exp_avg" not in keys and "o:0.weight:exp_avg#scale" in keys
    q = json.loads(meta["quantized"])
    assert q["o:0.weight:exp_avg"]["class"].endswith("OptimState8bit" if kind == "8bit" else "OptimState4bit")
    assert "o:0.bias:exp_avg" in keys and "o:0.bias:exp_avg" not in q  # too small to quantize: a plain tensor

    # on as many processes: every code as it was written
    _run(tmp_path, 2, kind, str(folder), "load")
    for rank in (0, 1):
        saved = torch.load(folder / f"codes{rank}.pt")  # the test's own file, written above
        loaded = json.loads((folder / f"loaded{rank}-2.json").read_text())
        assert saved and all(
            torch.equal(torch.tensor(loaded[k]["codes"], dtype=torch.uint8), v) for k, v in saved.items()
        )
    # on one process: the moments as the two shares held them, quantized again (within the quantization's error)
    _run(tmp_path, 1, kind, str(folder), "load")
    one = json.loads((folder / "loaded0-1.json").read_text())
    assert one["0.weight:exp_avg"]["quantized"] and not one["0.bias:exp_avg"]["quantized"]
    # quantized twice (by two processes' blocks, then by one's): within twice the error of quantizing once
    assert all(0 < v["err"] <= 2 * v["once"] for k, v in one.items() if "weight" in k), one
    assert one["0.bias:exp_avg"]["err"] == 0.0  # plain moments come back exactly


@pytest.mark.slow
def test_torchaos_adamw8bit_stepping_local_shares_updates_as_on_the_whole_weights(tmp_path):
    """memory/optimizers.py local_shares: torchao's 8-bit AdamW stepped on each of two processes' shares (its moments
    local tensors; torchao's own DTensor moments do not compile in torch 2.11) moves every weight exactly as torchao's
    optimizer on the unsharded model does (the shares' quantization blocks are the whole tensor's: 256-value blocks
    of whole rows)."""
    folder = tmp_path / "step"
    _run(tmp_path, 2, "8bit", str(folder), "step")
    for rank in (0, 1):
        got = json.loads((folder / f"step{rank}.json").read_text())
        assert len(got) == 4 and all(v["equal"] and v["moved"] for v in got.values()), got
