"""Z-Image through the generic trainer on CPU: precompute (Qwen3 states cached without their padding), training,
resume, and the two LoRA files it writes (diffusers' layout, and the kohya names ComfyUI loads, q/k/v as one fused
qkv) loading into ZImagePipeline with the same effect."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train


@pytest.fixture(scope="module")
def tiny_zimage(tmp_path_factory):
    from difftrain.families.zimage import ZImage

    return ZImage().build_tiny(tmp_path_factory.mktemp("zimage") / "tiny-zimage", seed=0)


def _transformer_out(pipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1, 8, 8, generator=g)
    text = torch.randn(9, 32, generator=g)
    with torch.no_grad():
        return pipe.transformer([x], torch.tensor([0.4]), [text], return_dict=False)[0][0]


def test_both_lora_files_load_into_the_zimage_pipeline_alike(tiny_zimage, dataset, tmp_path):
    from diffusers import ZImagePipeline
    from safetensors.torch import load_file

    from difftrain.data.cache import DataCache

    cfg = resolve(
        recipe="tiny-zimage-lora", sets=tiny_sets(tiny_zimage, dataset, tmp_path, **{"train.max_steps": 4})
    ).config
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    items = cache.read_json("index.json")["items"]
    lengths = {cache.get(it["texts"]["qwen3"])["prompt_embeds"].shape[0] for it in items}
    assert len(lengths) > 1  # captions of several lengths, each cached without padding
    r = train(cfg)
    assert len(r.losses) == 4 and all(torch.isfinite(torch.tensor(r.losses)))
    peft_file, kohya_file = r.lora_path, r.lora_path.parent / "lora_kohya.safetensors"
    kohya = load_file(kohya_file)
    # ComfyUI's names: the original module paths, q/k/v fused as qkv, each with its alpha
    assert "lora_unet_layers_0_attention_qkv.lora_down.weight" in kohya
    assert "lora_unet_noise_refiner_0_feed_forward_w2.alpha" in kohya
    assert "lora_unet_context_refiner_0_attention_out.lora_up.weight" in kohya
    assert not [k for k in kohya if "to_q" in k or "to_out" in k]
    base = _transformer_out(ZImagePipeline.from_pretrained(tiny_zimage))
    outs = []
    for f in (peft_file, kohya_file):
        pipe = ZImagePipeline.from_pretrained(tiny_zimage)
        pipe.load_lora_weights(str(f))
        outs.append(_transformer_out(pipe))
    assert not torch.allclose(outs[0], base, atol=1e-4)  # the LoRA changes the output
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    # lora merge: either file merged into the base gives the same transformer file (the original names), loadable
    from difftrain.lora.tools import merge

    for i, f in enumerate((peft_file, kohya_file)):
        merge(tiny_zimage, f, tmp_path / f"m{i}.safetensors")
    m0, m1 = load_file(tmp_path / "m0.safetensors"), load_file(tmp_path / "m1.safetensors")
    assert set(m0) == set(m1) and all(torch.allclose(m0[k], m1[k], atol=1e-6) for k in m0)
    # lora resize keeps each file's layout (the fused qkv cut as one layer, as sd-scripts cuts it): both still load
    from difftrain.lora.tools import resize

    for i, f in enumerate((peft_file, kohya_file)):
        resize(f, tmp_path / f"r{i}.safetensors", rank=2)
        pipe = ZImagePipeline.from_pretrained(tiny_zimage)
        pipe.load_lora_weights(str(tmp_path / f"r{i}.safetensors"))
        assert not torch.allclose(_transformer_out(pipe), base, atol=1e-4)
    assert load_file(tmp_path / "r1.safetensors")["lora_unet_layers_0_attention_qkv.lora_down.weight"].shape[0] == 2


@pytest.mark.slow
def test_a_resumed_zimage_run_matches_an_uninterrupted_one(tiny_zimage, dataset, tmp_path):
    sets = {"train.max_steps": 4, "train.checkpoint_every": 2}
    whole = resolve(recipe="tiny-zimage-lora", sets=tiny_sets(tiny_zimage, dataset, tmp_path / "a", **sets)).config
    precompute(whole)
    full = train(whole)
    first = resolve(
        recipe="tiny-zimage-lora",
        sets=tiny_sets(tiny_zimage, dataset, tmp_path / "b", **{**sets, "train.max_steps": 2}),
    ).config
    precompute(first)
    train(first)
    resumed = resolve(recipe="tiny-zimage-lora", sets=tiny_sets(tiny_zimage, dataset, tmp_path / "b", **sets)).config
    r = train(resumed, resume="latest")
    assert r.losses == pytest.approx(full.losses[2:], rel=1e-5)


@pytest.mark.slow
def test_a_full_fine_tune_saves_the_original_transformer_file_and_a_diffusers_folder(tiny_zimage, dataset, tmp_path):
    """save.formats single_file and diffusers: model.safetensors is the transformer alone in the original names
    (fused qkv), loadable as model.path with the trained weights; the folder loads in ZImagePipeline."""
    from diffusers import ZImagePipeline
    from safetensors.torch import load_file

    from difftrain.config.schema import ModelConfig
    from difftrain.families.zimage import ZImage

    sets = tiny_sets(tiny_zimage, dataset, tmp_path, **{"train.max_steps": 1, "train.checkpoint_every": 100,
                     "report.to": "[]", "train.method": "full", "save.formats": "[single_file, diffusers]",
                     "train.learning_rate": "1e-3", "save.precision": "fp32"})  # fmt: skip
    cfg = resolve(recipe="tiny-zimage-lora", sets=sets).config
    precompute(cfg)
    train(cfg)
    out = cfg.train.output_dir / "model.safetensors"
    keys = set(load_file(out))
    assert "layers.0.attention.qkv.weight" in keys and not any("to_q" in k for k in keys)
    fam = ZImage()
    tuned = fam.load(ModelConfig(path=out, config="z-image-tiny"), ["transformer"], tokenizers=False)["transformer"]
    base = fam.load(ModelConfig(path=tiny_zimage), ["transformer"], tokenizers=False)["transformer"]
    name = "layers.0.attention.to_q.weight"
    assert not torch.equal(tuned.state_dict()[name], base.state_dict()[name])
    folder = next(p for p in cfg.train.output_dir.iterdir() if p.is_dir() and (p / "model_index.json").exists())
    pipe = ZImagePipeline.from_pretrained(folder)
    torch.testing.assert_close(pipe.transformer.state_dict()[name], tuned.state_dict()[name])


def test_a_wrong_text_encoder_file_stops_the_run_by_name_through_the_console_script(tiny_zimage, dataset, tmp_path):
    """model.text_encoder naming another model's file (here the VAE): exit 1, the file and what it should be,
    no traceback, no cache index written."""
    from safetensors.torch import load_file, save_file

    from conftest import clean_failure, script_train, set_args

    vae = tmp_path / "ae.safetensors"
    save_file(load_file(tiny_zimage / "vae" / "diffusion_pytorch_model.safetensors"), vae)
    sets = tiny_sets(tiny_zimage, dataset, tmp_path, **{"model.text_encoder": vae, "train.max_steps": 1})
    r = script_train("--recipe", "tiny-zimage-lora", *set_args(sets))
    clean_failure(r, 1, "ae.safetensors does not fit the bundled Z-Image architecture", "Qwen3 text encoder")
    assert not (tmp_path / "cache" / "index.json").exists()


def test_a_caption_over_the_limit_is_cut_and_said(tiny_zimage, capsys):
    from difftrain.config.schema import ModelConfig
    from difftrain.families.zimage import ZImage

    fam = ZImage()
    comps = fam.load(ModelConfig(path=tiny_zimage), ["text_encoder"])
    opts = resolve(recipe="tiny-zimage-lora", sets=[f"model.path={tiny_zimage}", "data.dir=."]).config.text_encoders
    long = "a fox " * 200  # 1 200 byte tokens
    out = fam.encode_prompts(comps, [long, "a fox"], "qwen3", opts)["prompt_embeds"]
    assert out[0].shape[0] == 512 and out[1].shape[0] < 512
    assert "1 caption(s) longer than Z-Image's 512 Qwen3 tokens" in " ".join(capsys.readouterr().err.split())


def test_a_text_encoder_that_runs_out_of_gpu_memory_is_a_clear_error_and_keeps_what_it_encoded(
    tiny_zimage, dataset, tmp_path, monkeypatch
):
    """The language model running out of GPU memory mid-stage (faked on the CPU: the second batch of captions) stops
    precompute with what to set, the captions encoded before it kept in the cache; the rerun encodes only the rest."""
    from difftrain.errors import DataError
    from difftrain.families.zimage import ZImage

    real, calls = ZImage.encode_prompts, []

    def counted(self, comps, captions, stage, opts):
        calls.append(len(captions))
        if len(calls) == 2 and fail:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return real(self, comps, captions, stage, opts)

    monkeypatch.setattr(ZImage, "encode_prompts", counted)

    def config(name):
        sets = tiny_sets(tiny_zimage, dataset, tmp_path / name, **{"precompute.batch_size": 1})
        return resolve(recipe="tiny-zimage-lora", sets=sets).config

    fail = True
    with pytest.raises(DataError) as e:
        precompute(config("a"))
    assert "text encoder ran out of GPU memory" in str(e.value) and "encoded before are kept" in str(e.value)
    assert "text_encoders.llm.precision: nf4" in e.value.hint and "precompute.device: cpu" in e.value.hint
    fail, calls[:] = False, []
    precompute(config("a"))  # the rerun
    rerun = len(calls)
    calls.clear()
    precompute(config("b"))  # a cache from nothing
    assert len(calls) > 1 and rerun == len(calls) - 1  # the caption encoded before it ran out was kept
