"""Qwen-Image-Edit through precompute and the generic trainer on CPU: pairs from a control folder (numbered
references) and from a pairs file, a pair with a missing or unreadable reference skipped and listed, the cache keyed
by the references' content, a LoRA the Edit Plus pipeline loads (both files alike), validation samples from
validation references, resume."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from PIL import Image, ImageOps

from conftest import console_script, set_args, tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train

RECIPE = "tiny-qwen-image-edit-lora"


@pytest.fixture(scope="module")
def tiny_plus(tmp_path_factory):
    from difftrain.families.qwenimage import QwenImageEdit

    return QwenImageEdit().build_tiny(tmp_path_factory.mktemp("qie") / "tiny-qwen-image-edit", seed=0)


def make_controls(data, control):
    """Two references per target, numbered as musubi-tuner numbers them: the target mirrored, and in grey."""
    control.mkdir()
    for f in sorted(data.glob("*.png")):
        im = Image.open(f).convert("RGB")
        ImageOps.mirror(im).save(control / f"{f.stem}_0.png")
        ImageOps.grayscale(im).convert("RGB").save(control / f"{f.stem}_1.png")
    return control


@pytest.fixture
def pairs(dataset, tmp_path):
    return dataset, make_controls(dataset, tmp_path / "control")


@pytest.fixture
def small_sizes(monkeypatch):
    """The Edit Plus pipeline's reference sizes (for validation samples) scaled down for a CPU test."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_mod

    monkeypatch.setattr(plus_mod, "VAE_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(plus_mod, "CONDITION_IMAGE_SIZE", 48 * 48)


def _cfg(model, data, out, **extra):
    return resolve(recipe=RECIPE, sets=tiny_sets(model, data, out, **extra)).config


def test_precompute_skips_and_lists_broken_pairs_and_keys_by_the_references(tiny_plus, pairs, tmp_path):
    from difftrain.data.cache import DataCache

    data, control = pairs
    targets = sorted(data.glob("*.png"))
    (control / f"{targets[0].stem}_0.png").unlink()  # a missing reference
    (control / f"{targets[1].stem}_1.png").write_bytes(b"not a png")  # an unreadable one
    for f in control.glob(f"{targets[3].stem}_*.png"):  # none at all
        f.unlink()
    cfg = _cfg(tiny_plus, data, tmp_path, **{"data.control_dir": control})
    rep = precompute(cfg)
    assert rep.items == len(targets) - 3
    skipped = dict(rep.skipped)
    assert f"{targets[0].stem}_0.* is missing" in skipped[str(targets[0])]
    assert f"{targets[1].stem}_1.png" in skipped[str(targets[1])]
    assert "no reference image" in skipped[str(targets[3])]
    listed = json.loads((tmp_path / "cache" / "precompute-report.json").read_text())["skipped"]
    assert {s["path"] for s in listed} >= {str(targets[i]) for i in (0, 1, 3)}
    cache = DataCache(tmp_path / "cache")
    item = cache.read_json("index.json")["items"][0]
    entry = cache.get(item["latent"])
    assert entry["reference_latents"].shape == (2, *entry["latents"].shape)
    # a changed reference re-encodes that pair's latents and instruction, nothing else
    ImageOps.flip(Image.open(control / f"{targets[2].stem}_0.png")).save(control / f"{targets[2].stem}_0.png")
    again = precompute(cfg)
    assert (again.latents_encoded, again.texts_encoded) == (1, 1)


def test_a_pairs_file_gives_the_same_cache_as_the_control_folder(tiny_plus, pairs, tmp_path):
    data, control = pairs
    lines = [
        {"image": f.name, "control_path_0": str(control / f"{f.stem}_0.png"),
         "control_path_1": str(control / f"{f.stem}_1.png"), "caption": (data / f"{f.stem}.caption").read_text()}
        for f in sorted(data.glob("*.png"))
    ]  # fmt: skip
    (data / "pairs.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    sets = {"data.allow_outside_paths": "true"}
    by_folder = precompute(_cfg(tiny_plus, data, tmp_path / "a", **{"data.control_dir": control}, **sets))
    by_file = precompute(_cfg(tiny_plus, data, tmp_path / "a", **{"data.pairs": data / "pairs.jsonl"}, **sets))
    assert by_folder.items == by_file.items == len(lines)
    assert (by_file.latents_encoded, by_file.texts_encoded) == (0, 0)  # the same entries: nothing new to encode


def test_caption_dropout_drops_the_instruction_and_keeps_each_pairs_references(tiny_plus, pairs, tmp_path):
    """data.caption_dropout_rate: each item's empty instruction is encoded with its own references (its own entry,
    kept by cache prune), and the dropout draws it."""
    from difftrain.data.cache import DataCache, prune_cache
    from difftrain.data.captions import CaptionAugment, pick_text
    from difftrain.data.index import CacheIndex

    data, control = pairs
    cfg = _cfg(tiny_plus, data, tmp_path, **{"data.control_dir": control, "data.caption_dropout_rate": 0.5})
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    index = CacheIndex.from_json(cache.read_json("index.json"), tmp_path / "cache" / "index.json")
    assert index.empty_text is None and all(it.empty_texts for it in index.items)
    empties = [cache.get(it.empty_texts["qwen25vl"])["prompt_embeds"] for it in index.items]
    assert not torch.equal(empties[0], empties[1])  # the empty instruction, each with its own pictures
    prune_cache(tmp_path / "cache")
    assert all(DataCache(tmp_path / "cache").get(it.empty_texts["qwen25vl"]) is not None for it in index.items)
    aug = CaptionAugment.from_config(cfg.data)
    drawn = [pick_text(it, aug, 0, e, None) for it in index.items for e in range(4)]
    assert any(t == it.empty_texts for t in drawn for it in index.items)
    assert any(t == it.texts for t in drawn for it in index.items)
    assert len(train(cfg, stop_at=2).losses) == 2


@pytest.mark.slow
def test_the_first_edit_pairs_one_reference_by_name_and_refuses_several(dataset, pairs, tmp_path):
    """Qwen-Image-Edit (one reference): control/a.png for a.png, trained; two numbered references are refused."""
    from difftrain.errors import DataError
    from difftrain.families.qwenimage import QwenImageEdit

    model = QwenImageEdit().build_tiny(tmp_path / "edit", seed=0, config="qwen-image-edit-tiny")
    data, numbered = pairs
    single = tmp_path / "single"
    single.mkdir()
    for f in sorted(numbered.glob("*_0.png")):
        f.rename(single / f.name.replace("_0.png", ".png"))
    sets = {"model.config": "qwen-image-edit-tiny", "train.max_steps": 2}
    cfg = _cfg(model, data, tmp_path / "a", **sets, **{"data.control_dir": single})
    assert precompute(cfg).items == len(list(data.glob("*.png")))
    assert len(train(cfg).losses) == 2
    for f in sorted(data.glob("*.png")):  # two references each again
        (numbered / f"{f.stem}_0.png").write_bytes((single / f.name).read_bytes())
    with pytest.raises(DataError, match="takes one reference image"):
        precompute(_cfg(model, data, tmp_path / "b", **sets, **{"data.control_dir": numbered}))


def test_no_usable_pair_fails_cleanly_through_the_console_script(tiny_plus, dataset, tmp_path):
    (tmp_path / "control").mkdir()
    sets = tiny_sets(tiny_plus, dataset, tmp_path, **{"data.control_dir": tmp_path / "control"})
    r = subprocess.run(
        [console_script(), "precompute", "--recipe", RECIPE, *set_args(sets)], capture_output=True, text=True
    )
    err = " ".join(r.stderr.split())
    assert r.returncode == 1 and "No usable images" in err and "no reference image" in err
    assert "Traceback" not in r.stderr
    r = subprocess.run(
        [console_script(), "precompute", "--recipe", RECIPE, *set_args(tiny_sets(tiny_plus, dataset, tmp_path))],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "data.control_dir" in r.stderr and "Traceback" not in r.stderr


def _transformer_out(pipe) -> torch.Tensor:
    from difftrain.families.llm_image import pack_2x2 as pack

    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 16, 8, 8, generator=g)
    text = torch.randn(1, 9, 32, generator=g)
    with torch.no_grad():
        return pipe.transformer(
            hidden_states=torch.cat([pack(x), pack(ref)], dim=1),
            timestep=torch.tensor([0.4]),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=torch.ones(1, 9, dtype=torch.long),
            img_shapes=[[(1, 4, 4), (1, 4, 4)]],
            return_dict=False,
        )[0]


@pytest.mark.slow
def test_the_lora_loads_into_the_edit_pipeline_and_validation_edits_the_references(
    tiny_plus, pairs, tmp_path, small_sizes
):
    from diffusers import QwenImageEditPlusPipeline

    from difftrain.config.schema import ModelConfig
    from difftrain.families.qwenimage import QwenImageEdit

    data, control = pairs
    stem = sorted(data.glob("*.png"))[0].stem
    refs = f"[[{control / f'{stem}_0.png'}, {control / f'{stem}_1.png'}]]"
    cfg = _cfg(tiny_plus, data, tmp_path, **{"data.control_dir": control, "train.max_steps": 4,
               "validation.prompts": "[make it blue]", "validation.images": refs,
               "validation.num_inference_steps": 2, "validation.resolution": 64})  # fmt: skip
    precompute(cfg)
    r = train(cfg)
    assert len(r.losses) == 4 and all(torch.isfinite(torch.tensor(r.losses)))
    samples = sorted((tmp_path / "run" / "samples").rglob("*.png"))
    assert samples and Image.open(samples[-1]).size == (64, 64)
    fam = QwenImageEdit()
    proc = fam.load(ModelConfig(path=tiny_plus), ["text_encoder"])["processor"]
    base = _transformer_out(QwenImageEditPlusPipeline.from_pretrained(tiny_plus, processor=proc))
    outs = []
    for f in (r.lora_path, r.lora_path.parent / "lora_kohya.safetensors"):
        pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_plus, processor=proc)
        pipe.load_lora_weights(str(f))
        outs.append(_transformer_out(pipe))
    assert not torch.allclose(outs[0], base, atol=1e-4)  # the LoRA changes the output
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    # lora merge into the Edit folder's transformer: the Edit transformer file with the LoRA in it
    from safetensors.torch import load_file

    from difftrain.lora.tools import merge

    merge(tiny_plus, r.lora_path, tmp_path / "merged.safetensors")
    merged = load_file(tmp_path / "merged.safetensors")
    name = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(merged[name], pipe.transformer.state_dict()[name.replace(".weight", ".base_layer.weight")])


@pytest.mark.slow
def test_a_resumed_edit_run_matches_an_uninterrupted_one(tiny_plus, pairs, tmp_path):
    data, control = pairs
    sets = {"train.max_steps": 4, "train.checkpoint_every": 2, "data.control_dir": control}
    whole = _cfg(tiny_plus, data, tmp_path / "a", **sets)
    precompute(whole)
    full = train(whole)
    first = _cfg(tiny_plus, data, tmp_path / "b", **{**sets, "train.max_steps": 2})
    precompute(first)
    train(first)
    r = train(_cfg(tiny_plus, data, tmp_path / "b", **sets), resume="latest")
    assert r.losses == pytest.approx(full.losses[2:], rel=1e-5)


@pytest.mark.slow
def test_a_sweep_trains_each_trial_on_one_cache_of_pairs(tiny_plus, pairs, tmp_path, cli):
    """`difftrain sweep` over Edit pairs (issue 53's sweeps): one cache of the targets with their references, which
    both trials train on to a finite loss; the two learning rates give two different runs."""
    from difftrain.data.cache import DataCache

    data, control = pairs
    sets = tiny_sets(
        tiny_plus, data, tmp_path, **{"data.control_dir": control, "train.max_steps": 2, "report.to": "[]"}
    )
    r = cli("sweep", "--recipe", RECIPE, *set_args(sets), "--grid", "optimizer.lr=1e-3,1e-2", "-o", tmp_path / "sw")
    assert r.code == 0, r
    rows = json.loads((tmp_path / "sw" / "results.json").read_text())
    assert sorted(row["train.learning_rate"] for row in rows) == [1e-3, 1e-2]
    assert all(row["status"] == "ok" and row["steps"] == 2 for row in rows)
    assert all(torch.isfinite(torch.tensor(row["final_loss"])) for row in rows)
    assert rows[0]["final_loss"] != rows[1]["final_loss"]
    cache = DataCache(tmp_path / "cache")
    refs = [cache.get(it["latent"])["reference_latents"] for it in cache.read_json("index.json")["items"]]
    assert refs and all(x.shape[0] == 2 for x in refs)  # each target's two numbered references
