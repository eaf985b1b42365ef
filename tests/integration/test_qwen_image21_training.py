"""Qwen-Image 2.1 through the console script on CPU: precompute and a short LoRA training of the tiny model, its loss
finite, the diffusers-layout LoRA it writes loading into QwenImage21Pipeline and changing what it predicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import tiny_sets


@pytest.fixture(scope="module")
def tiny_qi21(tmp_path_factory):
    from difftrain.families.qwenimage import QwenImage21

    return QwenImage21().build_tiny(tmp_path_factory.mktemp("qi21") / "tiny-qwen-image-2.1", seed=0)


def _transformer_out(pipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 4, 4, generator=g)
    text = torch.randn(1, 7, 32, generator=g)
    img_mask = torch.cat([torch.zeros(1, 7, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        return pipe.transformer(
            hidden_states=pipe._pack_latents(x, 1, 16, 4, 4),
            encoder_hidden_states=text,
            timestep=torch.tensor([0.4]),
            img_shapes=[[(1, 4, 4)]],
            img_mask=img_mask,
            return_dict=False,
        )[0]


@pytest.mark.slow
def test_the_console_script_trains_a_lora_the_pipeline_loads(tiny_qi21, dataset, tmp_path):
    from difftrain.config.schema import ModelConfig
    from difftrain.families.qwenimage import QwenImage21

    sets = tiny_sets(tiny_qi21, dataset, tmp_path, **{"train.max_steps": 3, "train.device": "cpu", "report.to": "[]",
                     "report.html": "false", "train.checkpoint_every": "null"})  # fmt: skip
    cmd = [sys.executable, "-m", "difftrain", "train", "--recipe", "tiny-qwen-image-2.1-lora"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "DIFFTRAIN_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    run = tmp_path / "run"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    lora = run / "pytorch_lora_weights.safetensors"
    assert lora.is_file() and not (run / "lora_kohya.safetensors").exists()  # no kohya layout for 2.1

    fam = QwenImage21()
    mcfg = ModelConfig(path=tiny_qi21)
    base = _transformer_out(fam.pipeline(fam.load(mcfg, ["transformer", "vae", "text_encoder"]), mcfg))
    pipe = fam.pipeline(fam.load(mcfg, ["transformer", "vae", "text_encoder"]), mcfg)
    pipe.load_lora_weights(str(lora))
    adapted = {n for n, _ in pipe.transformer.named_modules() if n.endswith("lora_A")}
    assert any(".img_mlp.gate_layer." in n for n in adapted) and any(".attn.to_q." in n for n in adapted)
    assert not torch.allclose(_transformer_out(pipe), base, atol=1e-4)
