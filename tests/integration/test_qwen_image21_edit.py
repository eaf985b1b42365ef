"""Qwen-Image 2.1 with reference images ("qwen-image-2.1-edit") on CPU, on the tiny seeded model: the cached
instruction and reference latents are what QwenImage21Pipeline's own encoding makes of the instruction and of the
reference fitted to the target's bucket; ``denoise`` predicts what the pipeline's transformer call does with the
pipeline's own inputs (the reference latents before the target's, img_shapes, img_mask); a target without its reference
is skipped and listed; a short training writes a LoRA the pipeline loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps

from conftest import tiny_sets

RECIPE = "tiny-qwen-image-2.1-edit-lora"
PARTS = ["transformer", "vae", "text_encoder"]


@pytest.fixture(scope="module")
def tiny_qi21(tmp_path_factory):
    from difftrain.families.qwenimage import QwenImage21

    return QwenImage21().build_tiny(tmp_path_factory.mktemp("qi21e") / "tiny-qwen-image-2.1", seed=0)


def make_controls(data, control):
    """One reference per target, by name (control/a.png for a.png): the target mirrored."""
    control.mkdir()
    for f in sorted(data.glob("*.png")):
        ImageOps.mirror(Image.open(f).convert("RGB")).save(control / f.name)
    return control


@pytest.fixture(scope="module")
def edit_run(tiny_qi21, _dataset_master, tmp_path_factory):
    """The tiny model's edit cache: every target with its mirrored reference but the last, whose reference is
    missing. (config, precompute's report, the cache index, the control folder.)"""
    from difftrain.config.load import resolve
    from difftrain.data.cache import DataCache
    from difftrain.data.index import CacheIndex
    from difftrain.precompute.run import precompute

    root = tmp_path_factory.mktemp("qi21e-run")
    data = Path(shutil.copytree(_dataset_master, root / "images"))
    control = make_controls(data, root / "control")
    missing = sorted(data.glob("*.png"))[-1]
    (control / missing.name).unlink()
    sets = tiny_sets(tiny_qi21, data, root, **{"data.control_dir": control, "train.max_steps": 3, "report.to": "[]",
                     "train.checkpoint_every": "null"})  # fmt: skip
    cfg = resolve(recipe=RECIPE, sets=sets).config
    rep = precompute(cfg)
    cache = DataCache(root / "cache")
    index = CacheIndex.from_json(cache.read_json("index.json"), root / "cache" / "index.json")
    return cfg, rep, cache, index, control, missing


@pytest.fixture(scope="module")
def pipe(tiny_qi21):
    """QwenImage21Pipeline over the tiny model, its processor with Qwen3-VL's image processor."""
    from difftrain.config.schema import ModelConfig
    from difftrain.families.qwenimage import QwenImage21Edit

    fam = QwenImage21Edit()
    mcfg = ModelConfig(path=tiny_qi21)
    return fam.pipeline(fam.load(mcfg, PARTS), mcfg)


def _fitted(control, item):
    """The item's reference as precompute fits it: to the target's bucket, centred."""
    from difftrain.data.buckets import fit_to_bucket
    from difftrain.data.sources import load_rgb

    return fit_to_bucket(load_rgb(control / Path(item.image).name), tuple(item.bucket))[0]


@pytest.mark.slow
def test_a_target_without_its_reference_is_skipped_and_the_instruction_is_the_pipelines(edit_run, pipe):
    from difftrain.families.qwenimage import QwenImage21, QwenImage21Edit

    cfg, rep, cache, index, control, missing = edit_run
    assert rep.items == len(index.items) == 7
    assert "no reference image" in dict(rep.skipped)[str(missing)]
    fam = QwenImage21Edit()
    opts = cfg.text_encoders
    assert fam.text_stage_tag("qwen3vl", opts) != QwenImage21().text_stage_tag("qwen3vl", opts)
    for item in index.items[:2]:
        entry = cache.get(item.texts["qwen3vl"])
        ref = _fitted(control, item)
        with torch.no_grad():
            embeds, mask, pad = pipe._get_qwen_prompt_embeds([item.caption], image=[ref], device="cpu")
        assert mask.all()  # one prompt: nothing padded
        torch.testing.assert_close(entry["prompt_embeds"], embeds[0].float(), rtol=0, atol=0)
        assert torch.equal(entry["image_pad_mask"].bool(), pad[0])
        # one vision token per 32x32 pixels of the fitted reference: its latents' 2x2 groups
        assert int(pad[0].sum()) == (ref.width // 32) * (ref.height // 32)


@pytest.mark.slow
def test_the_cached_reference_latents_are_the_pipelines_vae_encoding(edit_run, pipe):
    _, _, cache, index, control, _ = edit_run
    for item in index.items[:2]:
        entry = cache.get(item.latent)
        ref = _fitted(control, item).convert("RGBA")  # the pipeline's condition image (an opaque alpha)
        w, h = ref.size
        with torch.no_grad():
            want = pipe._encode_vae_image(pipe.image_processor.preprocess(ref, height=h, width=w).unsqueeze(2), None)
        assert entry["reference_latents"].shape == (1, 16, h // 16, w // 16)
        torch.testing.assert_close(entry["reference_latents"][0], want[0, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_denoise_is_the_pipelines_transformer_call_for_each_sample(edit_run, pipe):
    """Two targets of one bucket whose instructions differ in length (one transformer call each): the prediction of
    each is the pipeline's call with its own encoding of the instruction and reference, its reference latents before
    the noisy target's, its img_shapes and img_mask; the target's tokens of the output."""
    from difftrain.families.qwenimage import QwenImage21Edit
    from difftrain.families.qwenimage.v21 import pack, unpack

    _, _, cache, index, control, _ = edit_run
    fam = QwenImage21Edit()
    by_bucket: dict[tuple, list] = {}
    for it in index.items:
        by_bucket.setdefault(tuple(it.bucket), []).append(it)
    items = next(its for its in by_bucket.values() if len(its) == 2 and len(its[0].caption) != len(its[1].caption))
    texts = fam.collate_text("qwen3vl", [cache.get(it.texts["qwen3vl"]) for it in items])
    assert len(set(texts["prompt_length"].tolist())) == 2
    refs = torch.stack([cache.get(it.latent)["reference_latents"] for it in items])
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, *cache.get(items[0].latent)["latents"].shape, generator=g)
    timesteps = torch.tensor([300.0, 800.0])
    batch = {**texts, "reference_latents": refs}
    with torch.no_grad():
        got = fam.denoise(pipe.transformer, noisy, timesteps, batch)
    h, w = noisy.shape[-2:]
    for i, item in enumerate(items):
        ref = _fitted(control, item).convert("RGBA")
        rw, rh = ref.size
        with torch.no_grad():
            embeds, emask, pad = pipe.encode_prompt(prompt=item.caption, image=[ref], device="cpu")
            latents, ref_latents = pipe.prepare_latents(
                [pipe.image_processor.preprocess(ref, height=rh, width=rw).unsqueeze(2)],
                1, 16, h * 16, w * 16, torch.float32, "cpu", None, latents=pack(noisy[i : i + 1]),
            )  # fmt: skip
            img_shapes = [[(1, rh // 16, rw // 16), (1, h, w)]]  # as __call__ builds them
            img_mask = torch.cat([pad, pad.new_ones(1, latents.shape[1] // 4)], dim=1)  # append_target_slots
            want = pipe.transformer(
                hidden_states=torch.cat([ref_latents, latents], dim=1),
                timestep=timesteps[i : i + 1] / 1000,
                encoder_hidden_states=embeds,
                encoder_hidden_states_mask=emask,
                img_shapes=img_shapes,
                img_mask=img_mask,
                return_dict=False,
            )[0][:, -latents.size(1) :]
        torch.testing.assert_close(got[i : i + 1], unpack(want, h, w), rtol=1e-4, atol=1e-5)
    # the reference matters: another reference's latents change the prediction
    with torch.no_grad():
        other = fam.denoise(pipe.transformer, noisy, timesteps, {**batch, "reference_latents": refs.flip(0)})
    assert not torch.allclose(other, got, atol=1e-4)


def _transformer_out(pipe) -> torch.Tensor:
    """The transformer's prediction for a random target 4x4 after one 2x2 reference in its slot of the instruction."""
    from difftrain.families.qwenimage.v21 import pack

    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(1, 16, 4, 4, generator=g), torch.randn(1, 16, 2, 2, generator=g)
    text = torch.randn(1, 8, 32, generator=g)
    pad = torch.tensor([[False, False, True, False, False, False, False, False]])
    with torch.no_grad():
        return pipe.transformer(
            hidden_states=torch.cat([pack(ref), pack(x)], dim=1),
            encoder_hidden_states=text,
            timestep=torch.tensor([0.4]),
            img_shapes=[[(1, 2, 2), (1, 4, 4)]],
            img_mask=torch.cat([pad, torch.ones(1, 4, dtype=torch.bool)], dim=1),
            return_dict=False,
        )[0][:, -16:]


@pytest.mark.slow
def test_three_steps_train_a_lora_the_pipeline_loads(edit_run, tiny_qi21, pipe):
    from diffusers import QwenImage21Pipeline

    from difftrain.trainers.loop import train

    cfg = edit_run[0]
    r = train(cfg)
    assert len(r.losses) == 3 and all(torch.isfinite(torch.tensor(r.losses)))
    base = _transformer_out(pipe)
    adapted = QwenImage21Pipeline(
        scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder, processor=pipe.processor,
        transformer=type(pipe.transformer).from_pretrained(tiny_qi21 / "transformer"),
    )  # fmt: skip
    adapted.load_lora_weights(str(r.lora_path))
    names = {n for n, _ in adapted.transformer.named_modules() if n.endswith("lora_A")}
    assert any(".attn.to_q." in n for n in names) and any(".img_mlp.gate_layer." in n for n in names)
    assert not torch.allclose(_transformer_out(adapted), base, atol=1e-4)


def test_the_text_entry_is_keyed_by_the_bucket_its_references_are_fitted_to(tiny_qi21, dataset, tmp_path):
    """The same instruction and reference with targets of two buckets: two text entries (the reference fills other
    vision tokens in each), each to be encoded with the reference fitted to its own target's bucket."""
    from difftrain.config.load import resolve
    from difftrain.data.cache import DataCache
    from difftrain.families.registry import get_family
    from difftrain.precompute.plan import make_plan, scan
    from difftrain.runtime.distributed import World

    control = make_controls(dataset, tmp_path / "control")
    a, b = sorted(dataset.glob("*.png"))[:2]  # 256x256 and 320x192
    (dataset / f"{b.stem}.caption").write_text((dataset / f"{a.stem}.caption").read_text())
    (control / b.name).write_bytes((control / a.name).read_bytes())
    cfg = resolve(recipe=RECIPE, sets=tiny_sets(tiny_qi21, dataset, tmp_path, **{"data.control_dir": control})).config
    fam = get_family(cfg.family)
    records, _ = scan(cfg, fam, World(), torch.device("cpu"))
    plan = make_plan(records, cfg, fam, DataCache(tmp_path / "cache"), World())
    items = {Path(p.record.path).name: p for p in plan.items}
    pa, pb = items[a.name], items[b.name]
    assert pa.bucket != pb.bucket and pa.texts != pb.texts
    for p in (pa, pb):
        assert plan.reference_fit[p.texts["qwen3vl"]] == (p.bucket, None)  # centred: no random crop
        assert plan.references[p.texts["qwen3vl"]] == (control / Path(p.record.path).name,)


def test_the_image_processor_is_the_folders_and_a_reference_it_would_resize_is_refused(tiny_qi21, tmp_path):
    """processor/preprocessor_config.json, or the image processor in transformers 5's processor_config.json; at
    Qwen3-VL's own minimum (256 x 256 pixels) a 64 x 64 reference would be resized into more vision tokens than its
    latents fill: refused with the reason."""
    import json

    from difftrain.config.schema import ModelConfig, TextEncodersConfig
    from difftrain.errors import ConfigError
    from difftrain.families.qwenimage import QwenImage21Edit

    folder = Path(shutil.copytree(tiny_qi21, tmp_path / "model"))
    own = folder / "processor" / "preprocessor_config.json"
    cfg = json.loads(own.read_text())
    own.unlink()
    joint = {"image_processor": {**cfg, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}}
    (folder / "processor" / "processor_config.json").write_text(json.dumps(joint))
    fam, mcfg = QwenImage21Edit(), ModelConfig(path=folder)
    assert fam.processor_config(mcfg)["size"]["shortest_edge"] == 65536
    comps = fam.load(mcfg, ["text_encoder"])
    ref = Image.new("RGB", (64, 64), (200, 30, 30))
    opts = TextEncodersConfig()
    with pytest.raises(ConfigError, match="resized them"):
        fam.encode_prompts_with_images(comps, ["make it blue"], [[ref]], "qwen3vl", opts, mcfg)
    own.write_text(json.dumps(cfg))  # the folder's own file first: the tiny minimum (32 x 32)
    comps = fam.load(mcfg, ["text_encoder"])
    out = fam.encode_prompts_with_images(comps, ["make it blue"], [[ref]], "qwen3vl", opts, mcfg)
    embeds, pad = out["prompt_embeds"][0], out["image_pad_mask"][0]
    assert int(pad.sum()) == 4 and embeds.shape[0] == pad.shape[0]  # 2x2 vision tokens, one per row


@pytest.mark.slow
def test_two_references_are_encoded_and_denoised_as_the_pipeline_takes_two_images(pipe):
    """Two references (one slot each in the template, their latents in order before the target's): the family's
    encoding and denoise against the pipeline's own encode_prompt, prepare_latents and transformer call."""
    import numpy as np

    from difftrain.config.schema import ModelConfig, TextEncodersConfig
    from difftrain.families.qwenimage import QwenImage21Edit
    from difftrain.families.qwenimage.v21 import pack, unpack

    fam = QwenImage21Edit()
    rng = np.random.default_rng(0)
    refs = [Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)) for _ in range(2)]
    caption = "put the first on the second"
    comps = {"text_encoder": pipe.text_encoder, "processor": pipe.processor, "vae": pipe.vae}
    text = fam.encode_prompts_with_images(comps, [caption], [refs], "qwen3vl", TextEncodersConfig(), ModelConfig())
    pixels = torch.stack([torch.from_numpy(np.array(r)).permute(2, 0, 1) for r in refs])[None].float() / 127.5 - 1
    with torch.no_grad():
        lat = fam.image_condition_entries(comps, pixels[:, 0], references=pixels)["reference_latents"]
    assert lat.shape == (1, 2, 16, 4, 6)
    batch = {**fam.collate_text("qwen3vl", [{k: v[0] for k, v in text.items()}]), "reference_latents": lat}
    noisy = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([500.0])
    with torch.no_grad():
        got = fam.denoise(pipe.transformer, noisy, t, batch)
        rgba = [r.convert("RGBA") for r in refs]
        embeds, emask, pad = pipe.encode_prompt(prompt=caption, image=rgba, device="cpu")
        vae_images = [pipe.image_processor.preprocess(r, height=64, width=96).unsqueeze(2) for r in rgba]
        latents, ref_latents = pipe.prepare_latents(
            vae_images, 1, 16, 64, 64, torch.float32, "cpu", None, latents=pack(noisy)
        )
        want = pipe.transformer(
            hidden_states=torch.cat([ref_latents, latents], dim=1),
            timestep=t / 1000,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=emask,
            img_shapes=[[(1, 4, 6), (1, 4, 6), (1, 4, 4)]],
            img_mask=torch.cat([pad, pad.new_ones(1, latents.shape[1] // 4)], dim=1),
            return_dict=False,
        )[0][:, -16:]
    assert int(pad.sum()) == 2 * 6
    torch.testing.assert_close(text["prompt_embeds"][0], embeds[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(got, unpack(want, 4, 4), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_bench_trains_it_on_a_synthetic_cache_of_several_buckets(tmp_path):
    """bench's random cache holds instructions whose vision tokens fill the references' slots (random numbers
    there made the transformer refuse the batch), and references and latents at each bucket's size at the 16x VAE."""
    from difftrain.config.load import resolve
    from difftrain.data.cache import DataCache
    from difftrain.flows.bench import bench_memory, synthetic_cache

    cfg = resolve(recipe="tiny-qwen-image-2.1-edit-lora", sets=["train.device=cpu"]).config
    root = synthetic_cache(cfg, tmp_path / "cache", n=1, buckets=[(64, 96), (96, 64)])
    cache = DataCache(root)
    for it in cache.read_json("index.json")["items"]:
        lat = cache.get(it["latent"])
        text = cache.get(it["texts"]["qwen3vl"])
        assert lat["reference_latents"].shape[1:] == lat["latents"].shape
        h, w = lat["latents"].shape[-2:]
        assert (h * 16, w * 16) in {(64, 96), (96, 64)}
        assert int(text["image_pad_mask"].sum()) == h * w // 4
        assert text["prompt_embeds"].shape[0] == text["image_pad_mask"].shape[0]
    r = bench_memory(cfg, tmp_path / "work", steps=2)
    assert r.s_per_step is not None and r.s_per_step > 0


def test_the_planner_counts_the_reference_as_many_image_tokens_again():
    from difftrain.config.load import resolve
    from difftrain.planning.estimate import plan_memory

    sets = ["model.config=qwen-image-2.1", "data.resolution=1024", "data.max_side=2048", "data.min_side=512"]
    plain = plan_memory(resolve(recipe="tiny-qwen-image-2.1-lora", sets=sets).config)
    edit = plan_memory(resolve(recipe="tiny-qwen-image-2.1-edit-lora", sets=sets).config)
    assert plain.gpu["activations"] > 0
    assert edit.gpu["activations"] == pytest.approx(2 * plain.gpu["activations"])
    assert edit.gpu["weights"] == pytest.approx(plain.gpu["weights"])
