"""Qwen-Image through the generic trainer on CPU: precompute (Qwen2.5-VL states cached at each caption's length),
training, resume, and the two LoRA files it writes (diffusers' layout, and the kohya names ComfyUI and musubi-tuner
use) loading into QwenImagePipeline with the same effect; merge and resize; a full fine-tune's transformer file."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import train


@pytest.fixture(scope="module")
def tiny_qwen_image(tmp_path_factory):
    from difftrain.families.qwenimage import QwenImage

    return QwenImage().build_tiny(tmp_path_factory.mktemp("qwenimage") / "tiny-qwen-image", seed=0)


def _transformer_out(pipe) -> torch.Tensor:
    from difftrain.families.llm_image import pack_2x2 as pack

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8, 8, generator=g)
    text = torch.randn(1, 9, 32, generator=g)
    with torch.no_grad():
        return pipe.transformer(
            hidden_states=pack(x),
            timestep=torch.tensor([0.4]),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=torch.ones(1, 9, dtype=torch.long),
            img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        )[0]


def test_both_lora_files_load_into_the_qwen_image_pipeline_alike(tiny_qwen_image, dataset, tmp_path):
    from diffusers import QwenImagePipeline
    from safetensors.torch import load_file

    from difftrain.data.cache import DataCache

    cfg = resolve(
        recipe="tiny-qwen-image-lora", sets=tiny_sets(tiny_qwen_image, dataset, tmp_path, **{"train.max_steps": 4})
    ).config
    precompute(cfg)
    cache = DataCache(tmp_path / "cache")
    items = cache.read_json("index.json")["items"]
    assert len({cache.get(it["texts"]["qwen25vl"])["prompt_embeds"].shape[0] for it in items}) > 1
    r = train(cfg)
    assert len(r.losses) == 4 and all(torch.isfinite(torch.tensor(r.losses)))
    peft_file, native_file = r.lora_path, r.lora_path.parent / "lora_kohya.safetensors"
    native = load_file(native_file)
    # lora_unet_ + diffusers' module path, with alphas: ComfyUI's and musubi-tuner's Qwen-Image names
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in native
    assert "lora_unet_transformer_blocks_1_txt_mlp_net_2.alpha" in native
    base = _transformer_out(QwenImagePipeline.from_pretrained(tiny_qwen_image))
    outs = []
    for f in (peft_file, native_file):
        pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image)
        pipe.load_lora_weights(str(f))
        outs.append(_transformer_out(pipe))
    assert not torch.allclose(outs[0], base, atol=1e-4)  # the LoRA changes the output
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    # lora merge: either file merged into the base gives the same transformer file (the original names), loadable
    from difftrain.lora.tools import merge

    for i, f in enumerate((peft_file, native_file)):
        merge(tiny_qwen_image, f, tmp_path / f"m{i}.safetensors")
    m0, m1 = load_file(tmp_path / "m0.safetensors"), load_file(tmp_path / "m1.safetensors")
    assert set(m0) == set(m1) and all(torch.allclose(m0[k], m1[k], atol=1e-6) for k in m0)
    # lora resize keeps each file's layout: the two cut to rank 2 still load alike
    from difftrain.lora.tools import resize

    cut = []
    for i, f in enumerate((peft_file, native_file)):
        resize(f, tmp_path / f"r{i}.safetensors", rank=2)
        pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image)
        pipe.load_lora_weights(str(tmp_path / f"r{i}.safetensors"))
        cut.append(_transformer_out(pipe))
    torch.testing.assert_close(cut[1], cut[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_resumed_qwen_image_run_matches_an_uninterrupted_one(tiny_qwen_image, dataset, tmp_path):
    sets = {"train.max_steps": 4, "train.checkpoint_every": 2}
    whole = resolve(
        recipe="tiny-qwen-image-lora", sets=tiny_sets(tiny_qwen_image, dataset, tmp_path / "a", **sets)
    ).config
    precompute(whole)
    full = train(whole)
    first = resolve(
        recipe="tiny-qwen-image-lora",
        sets=tiny_sets(tiny_qwen_image, dataset, tmp_path / "b", **{**sets, "train.max_steps": 2}),
    ).config
    precompute(first)
    train(first)
    resumed = resolve(
        recipe="tiny-qwen-image-lora", sets=tiny_sets(tiny_qwen_image, dataset, tmp_path / "b", **sets)
    ).config
    r = train(resumed, resume="latest")
    assert r.losses == pytest.approx(full.losses[2:], rel=1e-5)


@pytest.mark.slow
def test_a_full_fine_tune_saves_the_transformer_file(tiny_qwen_image, dataset, tmp_path):
    from safetensors.torch import load_file

    from difftrain.config.schema import ModelConfig
    from difftrain.families.qwenimage import QwenImage

    sets = tiny_sets(tiny_qwen_image, dataset, tmp_path, **{"train.max_steps": 1, "train.checkpoint_every": 100,
                     "report.to": "[]", "train.method": "full", "save.formats": "[single_file]",
                     "train.learning_rate": "1e-3", "save.precision": "fp32"})  # fmt: skip
    cfg = resolve(recipe="tiny-qwen-image-lora", sets=sets).config
    precompute(cfg)
    train(cfg)
    out = cfg.train.output_dir / "model.safetensors"
    assert "transformer_blocks.0.attn.to_q.weight" in set(load_file(out))
    fam = QwenImage()
    tuned = fam.load(ModelConfig(path=out, config="qwen-image-tiny"), ["transformer"], tokenizers=False)["transformer"]
    base = fam.load(ModelConfig(path=tiny_qwen_image), ["transformer"], tokenizers=False)["transformer"]
    name = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(tuned.state_dict()[name], base.state_dict()[name])
