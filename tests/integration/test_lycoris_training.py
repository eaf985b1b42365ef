"""LoHa, LoKr and DoRA through the trainer (issue 54): each trains on the tiny SDXL (UNet convs and attention, both
CLIPs), resumes exactly (adapter weights and optimizer state), writes the kohya/LyCORIS file (LoHa and LoKr alone:
diffusers loads neither), which lora merge bakes into the weights peft computes; a DoRA's diffusers file loads into
StableDiffusionXLPipeline with the trained model's output; lora resize refuses all three with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import CliResult, clean_failure, console_script, tiny_sets
from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train

KINDS = {
    "loha": {"lora.type": "loha"},
    "lokr": {"lora.type": "lokr", "lora.factor": 4},
    "dora": {"lora.use_dora": "true"},
}
LEAVES = {
    "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
    "lokr": {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_w1_a", "lokr_w1_b", "alpha"},
    "dora": {"weight", "alpha", "dora_scale"},  # lora_down.weight / lora_up.weight
}


def _cfg(model, data, out, kind, **extra):
    sets = {
        "lora.rank": 4,
        "lora.alpha": 2,
        "train.train_text_encoders": "true",
        "train.learning_rate": 1e-2,
        "train.batch_size": 2,
        "train.lr_scheduler": "cosine",
        "train.warmup_steps": 1,
        **KINDS[kind],
        **extra,
    }
    return resolve(recipe="tiny-sdxl-lora", sets=tiny_sets(model, data, out, **sets)).config


@pytest.fixture(scope="module")
def runs(tiny_model, _dataset_master, tmp_path_factory):
    """Per adapter: 4 steps straight, and 2 + 2 resumed from the step-2 checkpoint."""
    done = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind)
        straight = _cfg(tiny_model, _dataset_master, root / "a", kind, **{"train.max_steps": 4})
        precompute(straight)
        ref = train(straight)
        split = _cfg(
            tiny_model,
            _dataset_master,
            root / "b",
            kind,
            **{"train.max_steps": 4, "train.checkpoint_every": 2, "data.cache_dir": root / "a" / "cache"},
        )
        first = train(split, stop_at=2)
        second = train(split, resume="latest")
        done[kind] = (straight, ref, first, second)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_adapter_trains_and_resumes_exactly(runs, kind):
    _, ref, first, second = runs[kind]
    assert len(ref.losses) == 4 and all(torch.isfinite(torch.tensor(ref.losses)))
    assert first.losses + second.losses == pytest.approx(ref.losses, rel=1e-6, abs=1e-7)
    a, b = load_file(ref.lora_path), load_file(second.lora_path)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    ckpt = first.checkpoints[-1]
    # the checkpoint holds the optimizer state of every adapter tensor, and the file UIs load
    assert (ckpt / "lora_kohya.safetensors").exists() == (kind != "dora")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_files_are_in_lycoris_names_with_the_adapter_in_the_header(runs, kind):
    _, ref, _, _ = runs[kind]
    folder = ref.lora_path.parent
    kohya_file = folder / "lora_kohya.safetensors"
    sd = load_file(kohya_file)
    assert {k.rpartition(".")[2] for k in sd} <= LEAVES[kind]
    assert any(k.startswith("lora_unet_input_blocks_") for k in sd) and any(k.startswith("lora_te2_") for k in sd)
    with safe_open(str(kohya_file), framework="pt") as h:
        meta = h.metadata()
    assert meta["ss_network_module"] == "lycoris.kohya" and meta["difftrain.adapter"] == kind
    assert json.loads(meta["ss_network_args"])["algo"] == ("lora" if kind == "dora" else kind)
    if kind == "dora":
        assert ref.lora_path.name == "pytorch_lora_weights.safetensors"
        assert any(k.endswith("lora_magnitude_vector") for k in load_file(ref.lora_path))
        down = next(k for k in sd if k.endswith(".lora_down.weight"))
        scale = sd[down.replace(".lora_down.weight", ".dora_scale")]
        assert scale.shape[1:] == (1,) * (scale.dim() - 1)  # one magnitude per output row
    else:  # diffusers does not load LoHa / LoKr: no diffusers file, and the header says so
        assert ref.lora_path == kohya_file and not (folder / "pytorch_lora_weights.safetensors").exists()
        assert "diffusers does not load" in meta["difftrain.diffusers"]


def _peft_merged(cfg, lora_sd_parts):
    """The base parts with the trained adapter loaded into peft and merged by peft itself (merge_and_unload)."""
    from difftrain.families.sdxl import SDXL
    from difftrain.lora import files as lora_files
    from difftrain.lora.adapters import adapter_metadata, add_lora

    fam = SDXL()
    parts = ["unet", "text_encoder", "text_encoder_2"]
    comps = fam.load(cfg.model, parts, dtype=torch.float32, tokenizers=False)
    layers, alphas = lora_sd_parts
    out = {}
    for part in parts:
        targets = cfg.lora.targets if part == "unet" else fam.text_encoder_lora_targets
        add_lora(comps[part], cfg.lora, targets)
        lora_files.load_into(
            comps[part], part, layers[part], alphas[part], adapter_metadata(comps[part]), cfg.train.output_dir
        )
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in comps[part].modules():
            if isinstance(m, BaseTunerLayer):
                m.merge()
        out[part] = {k.replace(".base_layer", ""): v for k, v in comps[part].state_dict().items()}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_lora_merge_bakes_the_weights_peft_merges(runs, kind, tiny_model, tmp_path):
    from difftrain.families.sdxl import SDXL
    from difftrain.lora import files as lora_files
    from difftrain.lora.tools import merge

    cfg, ref, _, _ = runs[kind]
    kohya_file = ref.lora_path.parent / "lora_kohya.safetensors"
    fam = SDXL()
    parts = ["unet", "text_encoder", "text_encoder_2"]
    read = lora_files.read_lora_file(kohya_file, cfg.model, fam, parts)
    want = _peft_merged(cfg, read)
    merge(tiny_model, kohya_file, tmp_path / "merged.safetensors")
    got = fam.load(ModelConfig(path=tmp_path / "merged.safetensors", config="sdxl-tiny"), parts, tokenizers=False)
    base = fam.load(ModelConfig(path=tiny_model), parts, tokenizers=False)
    changed = 0
    for part in parts:
        g, b = got[part].state_dict(), base[part].state_dict()
        for k, w in want[part].items():
            if k in g and "lora" not in k:
                torch.testing.assert_close(g[k].float(), w.float(), rtol=1e-4, atol=1e-5, msg=f"{part}.{k}")
                changed += not torch.equal(g[k], b[k])
    assert changed > 20  # the adapter changed the UNet's and both CLIPs' layers


@pytest.mark.slow
def test_a_dora_loads_into_the_diffusers_pipeline_with_the_trained_output(runs, tiny_model):
    from diffusers import StableDiffusionXLPipeline

    from difftrain.families.sdxl import SDXL
    from difftrain.lora import files as lora_files
    from difftrain.lora.adapters import adapter_metadata, add_lora

    cfg, ref, _, _ = runs["dora"]
    fam = SDXL()
    trained = fam.load(cfg.model, ["unet"], dtype=torch.float32, tokenizers=False)["unet"]
    add_lora(trained, cfg.lora, cfg.lora.targets)  # the trained model: the run's adapter in peft's DoRA layers
    layers, alphas = lora_files.read_lora_file(
        ref.lora_path, cfg.model, fam, ["unet", "text_encoder", "text_encoder_2"]
    )
    lora_files.load_into(trained, "unet", layers["unet"], alphas["unet"], adapter_metadata(trained), ref.lora_path)
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_model, local_files_only=True)
    pipe.load_lora_weights(str(ref.lora_path.parent), weight_name=ref.lora_path.name)
    assert any("lora_magnitude_vector" in n for n, _ in pipe.unet.named_parameters())  # loaded as DoRA
    plain = StableDiffusionXLPipeline.from_pretrained(tiny_model, local_files_only=True).unet
    c = plain.config
    gen = torch.Generator().manual_seed(0)
    noisy = torch.randn(1, c.in_channels, 16, 16, generator=gen)
    text = torch.randn(1, 8, c.cross_attention_dim, generator=gen)
    pooled = torch.randn(1, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim, generator=gen)
    cond = {"text_embeds": pooled, "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}
    with torch.no_grad():
        outs = [u.eval()(noisy, 500, text, added_cond_kwargs=cond).sample for u in (trained, pipe.unet, plain)]
    assert (outs[0] - outs[2]).abs().max() > 100 * (outs[0] - outs[1]).abs().max()  # the DoRA matters, and loads
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_lora_resize_refuses_each_with_the_reason(runs, kind, tmp_path):
    _, ref, _, _ = runs[kind]
    f = ref.lora_path.parent / "lora_kohya.safetensors"
    r = _script("lora", "resize", str(f), "--rank", "2", "-o", str(tmp_path / "small.safetensors"))
    why = {"loha": "Hadamard product", "lokr": "Kronecker product", "dora": "magnitude divides by the norm"}[kind]
    clean_failure(r, 2, "no exact smaller rank", why, "Resize plain LoRA files only")
    assert not (tmp_path / "small.safetensors").exists()


def _script(*args: str) -> CliResult:
    import subprocess

    p = subprocess.run([console_script(), *args], capture_output=True, text=True, timeout=300)
    return CliResult(p.returncode, p.stdout, p.stderr)


@pytest.mark.slow
def test_export_of_a_loha_checkpoint_gives_its_lycoris_file(runs, tmp_path):
    _, _, first, _ = runs["loha"]
    ckpt = first.checkpoints[-1]
    r = _script("export", str(ckpt.parent.parent), "--checkpoint", str(ckpt), "--out", str(tmp_path))
    assert r.code == 0, r
    got = tmp_path / "lora_kohya.safetensors"
    assert got.read_bytes() == (ckpt / "lora_kohya.safetensors").read_bytes()
    assert any(k.endswith(".hada_w1_a") for k in load_file(got))
