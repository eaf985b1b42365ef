"""Qwen-Image 2.1 on CPU: precompute and a short LoRA training of the tiny model through the console script, its loss
finite, the diffusers-layout LoRA it writes loading into QwenImage21Pipeline and changing what it predicts; the
ComfyUI-layout LoRA (kohya names, the SwiGLU's gate and up as one fused ``gate_up``) applied as ComfyUI applies a LoRA
to its model's weights, giving the same output; lora merge and resize of both; a full fine-tune's diffusers folder and
single file (ComfyUI's names)."""

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
    assert lora.is_file() and (run / "lora_kohya.safetensors").is_file()  # and ComfyUI's layout beside it

    fam = QwenImage21()
    mcfg = ModelConfig(path=tiny_qi21)
    base = _transformer_out(fam.pipeline(fam.load(mcfg, ["transformer", "vae", "text_encoder"]), mcfg))
    pipe = fam.pipeline(fam.load(mcfg, ["transformer", "vae", "text_encoder"]), mcfg)
    pipe.load_lora_weights(str(lora))
    adapted = {n for n, _ in pipe.transformer.named_modules() if n.endswith("lora_A")}
    assert any(".img_mlp.gate_layer." in n for n in adapted) and any(".attn.to_q." in n for n in adapted)
    assert not torch.allclose(_transformer_out(pipe), base, atol=1e-4)


def _pipe(tiny_qi21, transformer_path=None):
    """QwenImage21Pipeline over the tiny model, with ``transformer_path`` (a single file) as its transformer."""
    from difftrain.config.schema import ModelConfig
    from difftrain.families.qwenimage import QwenImage21

    fam = QwenImage21()
    mcfg = ModelConfig(path=tiny_qi21)
    comps = fam.load(mcfg, ["transformer", "vae", "text_encoder"])
    if transformer_path is not None:
        tuned = ModelConfig(path=transformer_path, config="qwen-image-2.1-tiny")
        comps["transformer"] = fam.load(tuned, ["transformer"], tokenizers=False)["transformer"]
    return fam.pipeline(comps, mcfg)


@pytest.mark.slow
def test_lora_merge_and_resize_take_qwen_image_21_loras(tiny_qi21, dataset, tmp_path):
    from difftrain.config.load import resolve
    from difftrain.lora.tools import merge, resize
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import train

    sets = tiny_sets(tiny_qi21, dataset, tmp_path, **{"train.max_steps": 3, "report.to": "[]",
                     "train.checkpoint_every": "null", "train.learning_rate": "1e-2"})  # fmt: skip
    cfg = resolve(recipe="tiny-qwen-image-2.1-lora", sets=sets).config
    precompute(cfg)
    lora = train(cfg).lora_path
    base = _transformer_out(_pipe(tiny_qi21))
    pipe = _pipe(tiny_qi21)
    pipe.load_lora_weights(str(lora))
    with_lora = _transformer_out(pipe)
    assert not torch.allclose(with_lora, base, atol=1e-4)
    # merged into the base: one transformer file in the checkpoint's names, predicting as the base with the LoRA
    merge(tiny_qi21, lora, tmp_path / "merged.safetensors")
    torch.testing.assert_close(_transformer_out(_pipe(tiny_qi21, tmp_path / "merged.safetensors")), with_lora,
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    # the ComfyUI layout: lora_unet_ + ComfyUI's module paths, gate and up as one fused gate_up; applied as ComfyUI
    # applies a LoRA (W += alpha / rank * up @ down on the weight lora_unet_ + its module path names) to the
    # transformer file in ComfyUI's names, then read by diffusers' own converter of ComfyUI's files: as the pipeline
    # with the diffusers-layout LoRA
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    from difftrain.families.qwenimage import QwenImage21

    kohya = load_file(lora.parent / "lora_kohya.safetensors")
    assert "lora_unet_transformer_blocks_0_img_mlp_gate_up.lora_down.weight" in kohya
    assert "lora_unet_transformer_blocks_0_attn_to_q.alpha" in kohya
    assert not [k for k in kohya if "gate_layer" in k or "_proj." in k]
    plain = _pipe(tiny_qi21).transformer
    QwenImage21().save_single_file({"transformer": plain.state_dict()}, {}, tmp_path / "comfy.safetensors")
    comfy = load_file(tmp_path / "comfy.safetensors")
    assert "transformer_blocks.0.img_mlp.gate_up.weight" in comfy and not [k for k in comfy if "gate_layer" in k]
    used = set()
    for k in list(comfy):
        name = "lora_unet_" + k.removesuffix(".weight").replace(".", "_")
        if f"{name}.lora_down.weight" in kohya:
            down, up = kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"]
            comfy[k] = comfy[k] + float(kohya[f"{name}.alpha"]) / down.shape[0] * (up @ down)
            used |= {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"}
    assert used == set(kohya)  # every key lands on a weight of ComfyUI's model (none "not loaded")
    patched = QwenImage21Transformer2DModel.from_config(plain.config)
    patched.load_state_dict(convert_qwen_image21_transformer_checkpoint_to_diffusers(comfy))
    pipe = _pipe(tiny_qi21)
    pipe.transformer = patched
    torch.testing.assert_close(_transformer_out(pipe), with_lora, rtol=1e-4, atol=1e-5)
    # merged from the ComfyUI-layout file: the same transformer file as from the diffusers one
    merge(tiny_qi21, lora.parent / "lora_kohya.safetensors", tmp_path / "merged_kohya.safetensors")
    m0, m1 = load_file(tmp_path / "merged.safetensors"), load_file(tmp_path / "merged_kohya.safetensors")
    assert set(m0) == set(m1) and all(torch.allclose(m0[k], m1[k], atol=1e-6) for k in m0)
    # resized, the ComfyUI-layout file keeps its fused gate_up, cut as one layer
    resize(lora.parent / "lora_kohya.safetensors", tmp_path / "rk.safetensors", rank=1)
    assert (
        load_file(tmp_path / "rk.safetensors")["lora_unet_transformer_blocks_0_img_mlp_gate_up.lora_down.weight"].shape[
            0
        ]
        == 1
    )
    # resized to its own rank it predicts the same; cut to rank 1 it still loads and still changes the output
    rank = cfg.lora.rank
    for r in (rank, 1):
        resize(lora, tmp_path / f"r{r}.safetensors", rank=r)
        pipe = _pipe(tiny_qi21)
        pipe.load_lora_weights(str(tmp_path / f"r{r}.safetensors"))
        out = _transformer_out(pipe)
        if r == rank:
            torch.testing.assert_close(out, with_lora, rtol=1e-4, atol=1e-5)
        else:
            assert not torch.allclose(out, base, atol=1e-5)


@pytest.mark.slow
def test_a_qwen_image_21_full_fine_tune_saves_a_diffusers_folder_and_the_single_file(tiny_qi21, dataset, tmp_path):
    from diffusers import QwenImage21Transformer2DModel

    from difftrain.config.load import resolve
    from difftrain.precompute.run import precompute
    from difftrain.trainers.loop import train

    sets = tiny_sets(tiny_qi21, dataset, tmp_path, **{"train.max_steps": 1, "train.checkpoint_every": 100,
                     "report.to": "[]", "train.method": "full", "save.formats": "[single_file, diffusers]",
                     "train.learning_rate": "1e-3", "save.precision": "fp32"})  # fmt: skip
    cfg = resolve(recipe="tiny-qwen-image-2.1-lora", sets=sets).config
    precompute(cfg)
    train(cfg)
    out = cfg.train.output_dir
    folder = QwenImage21Transformer2DModel.from_pretrained(out / "diffusers" / "transformer").state_dict()
    base = _pipe(tiny_qi21).transformer.state_dict()
    name = "transformer_blocks.0.attn.to_q.weight"
    assert name in folder and not torch.equal(folder[name], base[name])  # trained
    # the single file (the checkpoint's own names) loads back to the folder's weights
    tuned = _pipe(tiny_qi21, out / "model.safetensors").transformer.state_dict()
    assert set(tuned) == set(folder) and all(torch.equal(tuned[k], folder[k].to(tuned[k].dtype)) for k in folder)
