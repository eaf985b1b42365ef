"""Full fine-tuning of the tiny SDXL, with and without text encoders, through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.families.sdxl import single_file as sf
from difftrain.families.sdxl.family import PARTS, SDXL, bundled_config_dir
from difftrain.trainers.loop import train


def _args(sets):
    return [a for s in sets for a in ("--set", s)]


def _split(path):
    """A single file's tensors by part, in diffusers naming."""
    sd = load_file(path)
    return {
        part: {k[len(sf.PREFIXES[part]) :]: v for k, v in sd.items() if k.startswith(sf.PREFIXES[part])}
        for part in PARTS
    }


@pytest.fixture(scope="module")
def original_file(tiny_model, tmp_path_factory):
    comps = SDXL().load(ModelConfig(path=tiny_model), PARTS)
    sds = {p: comps[p].state_dict() for p in PARTS}
    return _split(
        SDXL().save_single_file(sds, SDXL.module_configs(comps), tmp_path_factory.mktemp("orig") / "orig.safetensors")
    )


def _changed(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


def _identical(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_full_unet_only(cli, tiny_model, dataset, tmp_path, original_file):
    sets = tiny_sets(
        tiny_model,
        dataset,
        tmp_path,
        **{
            "train.method": "full",
            "train.max_steps": 24,
            "train.batch_size": 4,
            "train.learning_rate": 1e-3,
            "train.checkpoint_every": 1000,
            "save.every_n_steps": 12,
            "save.every_n_epochs": 5,
        },
    )
    assert cli("precompute", "--recipe", "tiny-sdxl-lora", *_args(sets)).code == 0
    r = cli("train", "--recipe", "tiny-sdxl-lora", *_args(sets), "--save-precision", "fp32")
    assert r.code == 0, r
    # 8 images, batch 4: 2 steps an epoch; saves at step 12, at epoch 5 (step 10), and at the end
    saved = sorted(p.name for p in (tmp_path / "run" / "saved").iterdir())
    assert saved == ["epoch-0005", "step-00000012"]
    assert (tmp_path / "run" / "saved" / "step-00000012" / "model.safetensors").exists()
    assert (
        load_file(tmp_path / "run" / "model.safetensors")["model.diffusion_model.out.2.weight"].dtype == torch.float32
    )
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-6:]) / 6 < 0.8 * sum(losses[:6]) / 6
    out = _split(tmp_path / "run" / "model.safetensors")
    assert _changed(out["unet"], original_file["unet"])
    for part in ("vae", "text_encoder", "text_encoder_2"):  # frozen: bit-identical
        assert _identical(out[part], original_file[part]), part
    assert "encoded on the fly" not in r.err


def test_full_with_text_encoder_1_and_both_formats(cli, tiny_model, dataset, tmp_path, original_file):
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel

    sets = tiny_sets(
        tiny_model,
        dataset,
        tmp_path,
        **{
            "train.method": "full",
            "train.max_steps": 6,
            "full.train_text_encoder_1": "true",
            "full.learning_rate_te1": 1e-3,
            "save.formats": "[single_file, diffusers]",
            "save.precision": "fp32",
            "train.checkpoint_every": 1000,
            "memory.activations.kind": "checkpoint",
        },
    )
    assert cli("precompute", "--recipe", "tiny-sdxl-lora", *_args(sets)).code == 0
    r = cli("train", "--recipe", "tiny-sdxl-lora", *_args(sets))
    assert r.code == 0, r
    assert "encoded on the fly" in r.err.replace("\n", " ")
    file = tmp_path / "run" / "model.safetensors"
    out = _split(file)
    assert _changed(out["unet"], original_file["unet"])
    assert _changed(out["text_encoder"], original_file["text_encoder"])
    assert _identical(out["text_encoder_2"], original_file["text_encoder_2"])
    assert _identical(out["vae"], original_file["vae"])

    # the single file loads back identically through difftrain and through diffusers' own loader
    back = SDXL().load(ModelConfig(path=file, config="sdxl-tiny", tokenizer_path=tiny_model), PARTS)
    cfgdir = str(bundled_config_dir("sdxl-tiny"))
    theirs = {
        "unet": UNet2DConditionModel.from_single_file(
            str(file), config=cfgdir, subfolder="unet", local_files_only=True
        ),
        "vae": AutoencoderKL.from_single_file(str(file), config=cfgdir, subfolder="vae", local_files_only=True),
    }
    folder = StableDiffusionXLPipeline.from_pretrained(tmp_path / "run" / "diffusers", local_files_only=True)
    for part in PARTS:
        ours = {k: v for k, v in back[part].state_dict().items() if not k.endswith("position_ids")}
        diffusers_folder = {
            k: v for k, v in getattr(folder, part).state_dict().items() if not k.endswith("position_ids")
        }
        assert _identical(ours, diffusers_folder), part
        if part in theirs:
            assert _identical(ours, theirs[part].state_dict()), part


def _full_cfg(tiny_model, data, out, **extra):
    base = {
        "train.method": "full",
        "memory.weights.kind": "bf16",
        "ema.enabled": "true",
        "ema.decay": 0.8,
        "ema.update_every": 2,
        "train.batch_size": 2,
        "train.learning_rate": 1e-3,
        "save.precision": "fp32",
    }
    base.update(extra)
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(tiny_model, data, out, **base)).config


@pytest.mark.slow
def test_bf16_full_with_ema_resumes_exactly_and_exports_ema(tiny_model, dataset, tmp_path):
    from difftrain.precompute.run import precompute

    ref_cfg = _full_cfg(tiny_model, dataset, tmp_path / "a", **{"train.max_steps": 6, "train.checkpoint_every": 6})
    precompute(ref_cfg)
    ref = train(ref_cfg)
    split = _full_cfg(
        tiny_model,
        dataset,
        tmp_path / "b",
        **{"train.max_steps": 6, "train.checkpoint_every": 3, "data.cache_dir": tmp_path / "a" / "cache"},
    )
    train(split, stop_at=3)
    resumed = train(split, resume="latest")
    assert resumed.losses == pytest.approx(ref.losses[3:], rel=1e-6)
    a, b = load_file(ref.saved[-1]), load_file(resumed.saved[-1])
    assert all(torch.equal(a[k], b[k]) for k in a)

    # what was exported is the EMA, not the raw bf16 weights
    from difftrain.trainers.state import load_tree

    ck = ref.checkpoints[-1]
    raw, ema = load_tree(ck, "trainable"), load_tree(ck, "ema")
    exported = SDXL().load(ModelConfig(path=ref.saved[-1], config="sdxl-tiny"), ["unet"])["unet"].state_dict()
    assert raw.keys() == ema.keys() and len(raw) == len(exported)
    for name in ("conv_in.weight", "mid_block.attentions.0.proj_in.weight"):
        assert raw[f"unet.{name}"].dtype == torch.bfloat16 and ema[f"unet.{name}"].dtype == torch.float32
        assert torch.equal(exported[name], ema[f"unet.{name}"])
        assert not torch.equal(exported[name], raw[f"unet.{name}"].float())


def test_no_distributed_setup_in_single_process(tiny_model, dataset, tmp_path, monkeypatch):
    """One GPU, one process: nothing of torch.distributed (process group, store, NCCL/gloo) is touched."""
    import torch.distributed as dist

    from difftrain.precompute.run import precompute

    def forbidden(*a, **k):
        raise AssertionError("torch.distributed was used in a single-process run")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(dist, "TCPStore", forbidden)
    cfg = _full_cfg(tiny_model, dataset, tmp_path, **{"train.max_steps": 2, "ema.enabled": "false"})
    precompute(cfg)
    train(cfg)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "sets,needle",
    [
        (
            ["train.method=full", "memory.weights.kind=fp16", "train.mixed_precision=fp16"],
            "fp16 weights cannot take small updates",
        ),
        (["train.method=full", "full.train_unet=false"], "nothing to train"),
        (["full.train_text_encoder_1=true"], "train.method full"),
    ],
)
def test_full_validators(cli, sets, needle):
    r = cli("train", "--recipe", "tiny-sdxl-lora", *_args(sets))
    assert r.code == 2 and needle in r.err.replace("\n", " ")
