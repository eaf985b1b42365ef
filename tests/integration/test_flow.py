"""The whole SDXL LoRA flow on the tiny model, through the CLI."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from conftest import tiny_sets


def _set_args(sets):
    return [a for s in sets for a in ("--set", s)]


def test_cli_flow_merge_precompute_train_export(cli, tiny_model, dataset, tmp_path):
    meta = tmp_path / "meta.json"
    r = cli("merge-tags", dataset, meta)
    assert r.code == 0, r
    entries = json.loads(meta.read_text())
    assert len(entries) == 8 and all("tags" in e and "caption" in e for e in entries.values())

    sets = tiny_sets(
        tiny_model, dataset, tmp_path, **{"data.metadata": meta, "train.max_steps": 4, "train.checkpoint_every": 2}
    )
    r = cli("precompute", "--recipe", "tiny-sdxl-lora", *_set_args(sets))
    assert r.code == 0, r
    assert "8 encoded" in r.err.replace("\n", " ")

    r = cli("train", "--recipe", "tiny-sdxl-lora", *_set_args(sets))
    assert r.code == 0, r
    run = tmp_path / "run"
    assert (run / "pytorch_lora_weights.safetensors").exists()
    assert (run / "config.yaml").exists() and "max_steps: 4" in (run / "config.yaml").read_text()
    ckpts = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-00000002", "step-00000004"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4

    dest = tmp_path / "exported.safetensors"
    r = cli("export", run, "--checkpoint", str(ckpts[0]), "--out", dest)
    assert r.code == 0, r
    early, final = load_file(dest), load_file(run / "pytorch_lora_weights.safetensors")
    assert early.keys() == final.keys() and all(k.startswith("unet.") for k in final)
    assert any(not torch.equal(early[k], final[k]) for k in final)


def test_print_config_shows_sources(cli, tmp_path):
    user = tmp_path / "user.yaml"
    user.write_text("train:\n  learning_rate: 0.5\n  batch_size: 3\n")
    r = cli("train", "--recipe", "tiny-sdxl-lora", "--config", user, "--set", "train.batch_size=5", "--print-config")
    assert r.code == 0, r
    lines = {ln.split(":")[0]: ln for ln in r.out.splitlines()}
    assert lines["train.batch_size"].split("#")[0].split(":")[1].strip() == "5"
    assert lines["train.batch_size"].endswith("# --set train.batch_size")
    assert lines["train.learning_rate"].endswith(f"# file {user}")
    assert lines["lora.rank"].endswith("# recipe tiny-sdxl-lora")
    assert lines["train.noise_offset"].endswith("# default")
    assert not (tmp_path / "run").exists()
