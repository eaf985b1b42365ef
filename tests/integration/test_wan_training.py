"""Wan through the generic trainer on CPU: images as one-frame clips, and the two LoRA files it writes (diffusers'
layout and musubi-tuner's, which ComfyUI loads) loading into WanPipeline with the same effect."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from difftrain.families.wan import Wan

    return Wan().build_tiny(tmp_path_factory.mktemp("wan") / "tiny-wan", seed=0)


def _transformer_out(pipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 2, 4, 6, generator=g)
    text = torch.randn(1, 512, 32, generator=g)
    with torch.no_grad():
        return pipe.transformer(
            hidden_states=x, timestep=torch.tensor([600.0]), encoder_hidden_states=text, return_dict=False
        )[0]


def test_both_lora_files_load_into_wan_pipeline_alike(tiny_wan, dataset, tmp_path):
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from difftrain.data.cache import DataCache

    cfg = resolve(recipe="tiny-wan-lora", sets=tiny_sets(tiny_wan, dataset, tmp_path, **{"train.max_steps": 4})).config
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    item = cache.read_json("index.json")["items"][0]
    assert cache.get(item["latent"])["latents"].ndim == 4  # [C, F=1, h, w]
    r = train(cfg)
    assert len(r.losses) == 4 and all(torch.isfinite(torch.tensor(r.losses)))
    peft_file, kohya_file = r.lora_path, r.lora_path.parent / "lora_kohya.safetensors"
    kohya = load_file(kohya_file)
    # musubi-tuner's names, every Linear of both blocks (10 each), each with its alpha
    assert "lora_unet_blocks_1_ffn_2.lora_down.weight" in kohya and "lora_unet_blocks_0_self_attn_q.alpha" in kohya
    assert len([k for k in kohya if k.endswith(".alpha")]) == 20
    base = _transformer_out(WanPipeline.from_pretrained(tiny_wan))
    outs = []
    for f in (peft_file, kohya_file):
        pipe = WanPipeline.from_pretrained(tiny_wan)
        pipe.load_lora_weights(str(f))
        outs.append(_transformer_out(pipe))
    assert not torch.allclose(outs[0], base, atol=1e-4)  # the LoRA changes the output
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_low_noise_expert_trains_and_its_loras_load_into_transformer_2(dataset, tmp_path):
    """Wan2.2 A14B: model.expert low_noise trains transformer_2/ below the boundary; its diffusers file loads with
    load_into_transformer_2=True and its kohya file is named for the expert, with the same effect."""
    from diffusers import WanPipeline
    from safetensors import safe_open

    from difftrain.families.wan import Wan

    model = Wan().build_tiny(tmp_path / "a14b", seed=0, config="wan-tiny-a14b")
    sets = tiny_sets(model, dataset, tmp_path, **{"train.max_steps": 2, "model.expert": "low_noise"})
    cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
    precompute(cfg)
    r = train(cfg)
    kohya_file = r.lora_path.parent / "lora_kohya_low_noise.safetensors"
    assert kohya_file.exists() and not (r.lora_path.parent / "lora_kohya.safetensors").exists()
    with safe_open(str(r.lora_path), "pt") as f:
        assert f.metadata()["difftrain.expert"] == "low_noise"
    outs = []
    for f in (r.lora_path, kohya_file):
        pipe = WanPipeline.from_pretrained(model)
        high = _transformer_out(pipe)
        pipe.load_lora_weights(str(f), load_into_transformer_2=True)
        assert torch.equal(_transformer_out(pipe), high)  # the high-noise expert untouched
        pipe.transformer, pipe.transformer_2 = pipe.transformer_2, pipe.transformer
        outs.append(_transformer_out(pipe))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_model_expert_both_trains_each_expert_into_its_own_folder_through_the_console_script(dataset, tmp_path):
    """Wan2.2 A14B with model.expert both: `difftrain train` (the real console script) trains the high-noise expert
    and then the low-noise one, each a run of its own under train.output_dir with its LoRA named for it, each its
    own transformer (the LoRAs differ), the cache encoded once; other commands refuse both by name."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors import safe_open

    from difftrain.families.wan import Wan

    model = Wan().build_tiny(tmp_path / "a14b", seed=0, config="wan-tiny-a14b")
    sets = tiny_sets(model, dataset, tmp_path, **{"train.max_steps": 2, "model.expert": "both"})
    script = str(Path(sys.executable).parent / "difftrain")
    args = [script, "train", "--recipe", "tiny-wan-lora", *(x for s in sets for x in ("--set", s))]
    env = {**os.environ, "DIFFTRAIN_PROGRESS": "0"}
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    experts = {}
    for e in ("high_noise", "low_noise"):
        kohya = run / e / f"lora_kohya_{e}.safetensors"
        assert kohya.exists() and (run / e / "config.yaml").read_text().count(f"expert: {e}") == 1
        with safe_open(str(run / e / "pytorch_lora_weights.safetensors"), "pt") as f:
            assert f.metadata()["difftrain.expert"] == e
            experts[e] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open is not a dict)
    assert experts["high_noise"].keys() == experts["low_noise"].keys()
    assert any(not torch.equal(experts["high_noise"][k], experts["low_noise"][k]) for k in experts["low_noise"])
    assert "the high_noise expert" in r.stderr and "the low_noise expert" in r.stderr
    bench = subprocess.run([script, "bench", "memory", "--recipe", "tiny-wan-lora", "--steps", "1",
                            *(x for s in sets for x in ("--set", s))], capture_output=True, text=True, env=env,
                           timeout=600)  # fmt: skip
    assert bench.returncode != 0 and "only `difftrain train` runs that" in bench.stderr
    assert "Traceback" not in bench.stderr


def test_save_attention_trains_as_plain_checkpointing_without_recomputing_the_self_attention(
    tiny_wan, dataset, tmp_path, monkeypatch
):
    """memory.activations.save_attention through the trainer: the same losses as plain checkpointing, and one
    self-attention fewer per block in a step (the tiny clips' tokens are few: the threshold is lowered to them)."""
    from conftest import count_attention
    from difftrain.memory import checkpoint_policy

    monkeypatch.setattr(checkpoint_policy, "MIN_KEYS", 20)  # the tiny one-frame clips' tokens, not the 512 text's
    losses, counts = {}, {}
    for keep in (False, True):
        sets = tiny_sets(tiny_wan, dataset, tmp_path / str(keep), **{"train.max_steps": 3})
        sets += [f"memory.activations={{kind: checkpoint, save_attention: {str(keep).lower()}}}"]
        cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
        precompute(cfg)
        with count_attention() as counted:
            losses[keep] = train(cfg).losses
        counts[keep] = (len([k for k in counted.keys if k >= 20]), len([k for k in counted.keys if k < 20]))
    assert losses[True] == losses[False]
    long_plain, short_plain = counts[False]
    long_kept, short_kept = counts[True]
    assert long_plain > 0 and short_kept == short_plain  # the cross-attentions to the caption recomputed alike
    assert long_kept * 2 == long_plain  # each self-attention ran once a step, not again in backward


def test_the_flop_count_on_fake_tensors_is_the_real_steps(tiny_wan, dataset, tmp_path):
    """bench speed counts a step's FLOPs on fake tensors (no memory: the 14B at 81x480x832 ran out of 140 GiB
    counting for real): through the real Wan trainer, checkpointed, it counts what the real step without
    checkpoints counts, and leaves no gradient behind."""
    from difftrain.flows import bench
    from difftrain.trainers.loop import Trainer

    sets = [*tiny_sets(tiny_wan, dataset, tmp_path, **{"train.max_steps": 1}), "memory.activations={kind: checkpoint}"]
    cfg = resolve(recipe="tiny-wan-lora", sets=sets).config
    precompute(cfg)
    trainer = Trainer(cfg)
    trainer.setup()
    real = bench._step_flops(trainer, fake=False)
    fake = bench._step_flops(trainer, fake=True)
    assert real is not None and real[0] > 0 and fake == real and fake[1] is True
    assert all(p.grad is None for p in trainer.parts.comps["transformer"].parameters())
