"""difftrain lora resize: each layer's ΔW cut to its best rank-k approximation (checked against torch.linalg.svd
of ΔW itself), the energy kept reported, sd-scripts' scale convention (alpha = old alpha / old rank * k), layout,
names and metadata kept."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftrain.errors import UsageError
from difftrain.lora.tools import delta, resize

RANK, ALPHA = 6, 3.0


def _layers(gen):
    """name -> (down, up): a Linear, a 3x3 conv, and a Linear whose ΔW has rank 2 (from rank-6 factors)."""
    low = torch.randn(24, 2, generator=gen) @ torch.randn(2, RANK, generator=gen)
    return {
        "lin": (torch.randn(RANK, 16, generator=gen), torch.randn(24, RANK, generator=gen)),
        "conv": (torch.randn(RANK, 4, 3, 3, generator=gen), torch.randn(8, RANK, 1, 1, generator=gen)),
        "low": (torch.randn(RANK, 16, generator=gen), low),
    }


@pytest.fixture
def kohya_file(tmp_path):
    sd = {}
    for name, (down, up) in _layers(torch.Generator().manual_seed(0)).items():
        key = f"lora_unet_{name}"
        sd |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(ALPHA)}
    save_file(
        sd,
        tmp_path / "lora_kohya.safetensors",
        metadata={
            "ss_network_dim": str(RANK),
            "ss_network_alpha": "3",
            "sshs_model_hash": "stale",
            "ss_output_name": "mine",
        },
    )
    return tmp_path / "lora_kohya.safetensors"


@pytest.fixture
def diffusers_file(tmp_path):
    sd = {}
    for name, (down, up) in _layers(torch.Generator().manual_seed(0)).items():
        sd |= {f"unet.{name}.lora_A.weight": down, f"unet.{name}.lora_B.weight": up}
    peft = {"unet.r": RANK, "unet.lora_alpha": ALPHA, "unet.target_modules": ["lin", "conv", "low"]}
    save_file(sd, tmp_path / "pytorch_lora_weights.safetensors", metadata={"lora_adapter_metadata": json.dumps(peft)})
    return tmp_path / "pytorch_lora_weights.safetensors"


def _deltas(path):
    sd = load_file(path)
    out = {}
    for k in sd:
        if k.endswith(".lora_down.weight"):
            name = k.removesuffix(".lora_down.weight")
            out[name] = delta(sd[k], sd[name + ".lora_up.weight"], sd[name + ".alpha"].item())
    return out


def _best(d: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    u, s, vh = torch.linalg.svd(d.flatten(1).double(), full_matrices=False)
    return (u[:, :k] * s[:k] @ vh[:k]).reshape(d.shape).float(), float(s[:k].square().sum() / s.square().sum())


def test_full_rank_reproduces_every_delta(kohya_file, tmp_path):
    r = resize(kohya_file, tmp_path / "same.safetensors", rank=RANK)
    before, after = _deltas(kohya_file), _deltas(r.path)
    assert before.keys() == after.keys() == {"lora_unet_lin", "lora_unet_conv", "lora_unet_low"}
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=1e-5, atol=1e-5)
    assert all(abs(x.energy - 1) < 1e-9 for x in r.layers)


def test_lower_rank_is_the_best_rank_r_approximation_with_its_energy(kohya_file, tmp_path):
    r = resize(kohya_file, tmp_path / "r2.safetensors", rank=2)
    before, after = _deltas(kohya_file), _deltas(r.path)
    sd = load_file(r.path)
    rows = {x.name: x for x in r.layers}
    for k in before:
        want, energy = _best(before[k], 2)
        torch.testing.assert_close(after[k], want, rtol=1e-4, atol=1e-4)
        assert sd[f"{k}.lora_down.weight"].shape[0] == 2 and rows[k].new_rank == 2 and rows[k].rank == RANK
        assert rows[k].energy == pytest.approx(energy, abs=1e-6)
        assert sd[f"{k}.alpha"].item() == pytest.approx(ALPHA / RANK * 2)  # the scale alpha/rank is kept
    assert sd["lora_unet_conv.lora_up.weight"].shape == (8, 2, 1, 1) and sd[
        "lora_unet_conv.lora_down.weight"
    ].shape == (2, 4, 3, 3)
    # ΔW of known rank 2 keeps everything; the full-rank layers lose some
    assert rows["lora_unet_low"].energy == pytest.approx(1.0, abs=1e-9)
    torch.testing.assert_close(after["lora_unet_low"], before["lora_unet_low"], rtol=1e-4, atol=1e-4)
    assert rows["lora_unet_lin"].energy < 0.99 and rows["lora_unet_conv"].energy < 0.99
    assert r.min.energy < r.mean < 1 and r.min.energy <= r.overall < 1
    with safe_open(str(r.path), framework="pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "2" and meta["ss_network_alpha"] == "1" and meta["ss_output_name"] == "mine"
    assert "sshs_model_hash" not in meta and "resized from 6 to 2" in meta["ss_training_comment"]


def test_energy_picks_the_smallest_rank_per_layer_capped_by_rank(kohya_file, tmp_path):
    before = _deltas(kohya_file)
    r = resize(kohya_file, tmp_path / "e.safetensors", energy=0.9)
    for x in r.layers:
        s2 = torch.linalg.svdvals(before[x.name].flatten(1).double()).square()
        kept = torch.cumsum(s2, 0) / s2.sum()
        want = int((kept < 0.9).sum()) + 1
        assert x.new_rank == want and x.energy >= 0.9 and (want == 1 or kept[want - 2] < 0.9)
    assert {x.new_rank for x in r.layers} != {RANK}
    capped = resize(kohya_file, tmp_path / "c.safetensors", energy=0.999, rank=3)
    assert max(x.new_rank for x in capped.layers) == 3
    with safe_open(str(r.path), framework="pt") as f:
        assert f.metadata()["ss_network_dim"] == "Dynamic"


def test_the_diffusers_layout_keeps_its_names_and_updates_its_peft_config(diffusers_file, tmp_path):
    r = resize(diffusers_file, tmp_path / "d.safetensors", energy=0.9, rank=RANK)
    assert r.layout == "diffusers"
    sd = load_file(r.path)
    assert sd.keys() == load_file(diffusers_file).keys()
    with safe_open(str(r.path), framework="pt") as f:
        peft = json.loads(f.metadata()["lora_adapter_metadata"])
    ranks = {x.name.removeprefix("unet."): x.new_rank for x in r.layers}
    for module, k in ranks.items():
        assert sd[f"unet.{module}.lora_A.weight"].shape[0] == k
        assert peft["unet.rank_pattern"].get(module, peft["unet.r"]) == k
        assert peft["unet.alpha_pattern"].get(module, peft["unet.lora_alpha"]) == pytest.approx(ALPHA / RANK * k)
    assert peft["unet.target_modules"] == ["lin", "conv", "low"]


def test_bad_requests_are_refused(kohya_file, tmp_path, cli):
    with pytest.raises(UsageError, match="above the LoRA's rank 6"):
        resize(kohya_file, tmp_path / "x.safetensors", rank=8)
    r = cli("lora", "resize", kohya_file, "-o", tmp_path / "x.safetensors", "--energy", "1.5")
    assert r.code == 2 and "(0, 1]" in r.err and "Traceback" not in r.err
    (tmp_path / "lora.pt").write_bytes(b"not opened")
    r = cli("lora", "resize", tmp_path / "lora.pt", "-o", tmp_path / "x.safetensors", "--rank", "2")
    assert r.code == 2 and "does not unpickle" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "x.safetensors").exists()


def test_the_cli_prints_each_layers_energy(kohya_file, tmp_path, cli):
    r = cli("lora", "resize", kohya_file, "-o", tmp_path / "r.safetensors", "--rank", "2")
    assert r.code == 0, r
    assert "lora_unet_low" in r.err and "100.00%" in r.err and "energy kept" in r.err and "min" in r.err
