"""Z-Image on tiny seeded models of the real layout: the bundled real architecture's sizes, the text and the
transformer's inputs exactly as ZImagePipeline builds them, the original file layout both ways (against diffusers'
own converter), loading the files ComfyUI users have, and a Turbo path warned about."""

from __future__ import annotations

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import ModelLoadError
from difftrain.families.zimage import ZImage
from difftrain.families.zimage import single_file as sf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ZImage().build_tiny(tmp_path_factory.mktemp("zimage") / "m", seed=0)


def test_the_bundled_architecture_has_the_released_models_sizes():
    """Z-Image's 6.15B transformer, Qwen3-4B (tied embeddings) and Flux.1's VAE, built on the meta device from
    the bundled configs."""
    fam = ZImage()
    mcfg = ModelConfig(config="z-image")
    with torch.device("meta"):
        counts = {
            p: sum(x.numel() for x in fam.empty_part(mcfg, p).parameters())
            for p in ("transformer", "text_encoder", "vae")
        }
    assert counts == {"transformer": 6_154_908_736, "text_encoder": 4_022_468_096, "vae": 83_819_683}


def test_captions_are_encoded_as_the_pipeline_encodes_them(tiny):
    from diffusers import ZImagePipeline

    fam = ZImage()
    comps = fam.load(ModelConfig(path=tiny), ["text_encoder"])
    cfg = resolve(recipe="tiny-zimage-lora", sets=[f"model.path={tiny}", "data.dir=."]).config
    captions = ["a fox in the snow", "a much longer caption: a cat on a red sofa, evening light"]
    got = fam.encode_prompts(comps, captions, "qwen3", cfg.text_encoders)["prompt_embeds"]
    pipe = ZImagePipeline.from_pretrained(tiny)
    want, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False)
    assert [g.shape[0] for g in got] == [w.shape[0] for w in want] and got[0].shape[0] < got[1].shape[0]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float())
    assert fam.text_stage_tag("qwen3", cfg.text_encoders).startswith("qwen3:fp32:512")


def test_the_transformer_gets_the_pipelines_inputs_and_the_prediction_is_noise_minus_x0(tiny):
    """A batch of two captions of different lengths (padded by collate_text) gives each sample what the pipeline
    gives it alone: the reversed timestep (1000 - t) / 1000 and the negated output."""
    fam = ZImage()
    comps = fam.load(ModelConfig(path=tiny), ["transformer"])
    tr = comps["transformer"]
    g = torch.Generator().manual_seed(0)
    texts = [torch.randn(7, 32, generator=g), torch.randn(19, 32, generator=g)]
    batch = fam.collate_text("qwen3", [{"prompt_embeds": t} for t in texts])
    assert batch["prompt_embeds"].shape == (2, 19, 32) and batch["prompt_length"].tolist() == [7, 19]
    noisy = torch.randn(2, 16, 8, 12, generator=g)
    t = torch.tensor([250.0, 900.0])
    with torch.no_grad():
        got = fam.denoise(tr, noisy, t, batch)
        for i in range(2):
            out = tr([noisy[i].unsqueeze(1)], ((1000 - t[i : i + 1]) / 1000), [texts[i]], return_dict=False)[0]
            torch.testing.assert_close(got[i], -out[0].squeeze(1), rtol=1e-4, atol=1e-5)


def test_the_original_layout_is_diffusers_converters_both_ways(tiny):
    """to_single_file then diffusers' convert_z_image_transformer_checkpoint_to_diffusers gives the state dict
    back; our streaming reader of the original names gives the same."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    from difftrain.families.common import LazyTensors

    tr = ZImage().load(ModelConfig(path=tiny), ["transformer"])["transformer"]
    sd = tr.state_dict()
    original = dict(LazyTensors(sf.to_single_file(sd)).items())
    assert "layers.0.attention.qkv.weight" in original and "final_layer.linear.weight" in original
    assert "layers.1.attention.out.weight" in original and "context_refiner.0.attention.q_norm.weight" in original
    back = convert_z_image_transformer_checkpoint_to_diffusers({f"{sf.PREFIX}{k}": v for k, v in original.items()})
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    ours = dict(sf.transformer_tensors(list(original), original.__getitem__))
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)
    assert sf.module_to_original("layers.0.attention.to_out.0") == "layers.0.attention.out"
    assert sf.module_to_original("layers.0.attention.to_q") is None
    assert sf.module_to_original("all_final_layer.2-1.linear") == "final_layer.linear"


def test_comfyui_files_load_the_transformer_vae_and_qwen3(tiny, tmp_path):
    """The transformer file in the original names (ComfyUI's prefix too, and fp8-stored), Flux.1's VAE file and
    Qwen3's own file (transformers' names under model., with a head) load as the diffusers folder's parts."""
    from safetensors.torch import save_file

    from difftrain.families.common import LazyTensors

    fam = ZImage()
    ref = fam.load(ModelConfig(path=tiny), ["transformer", "vae", "text_encoder"], tokenizers=False)
    original = dict(LazyTensors(sf.to_single_file(ref["transformer"].state_dict())).items())
    save_file({f"{sf.PREFIX}{k}": v.contiguous() for k, v in original.items()}, tmp_path / "z_image.safetensors")
    save_file({k: v.contiguous() for k, v in ref["vae"].state_dict().items()}, tmp_path / "ae.safetensors")
    qwen = {f"model.{k}": v.contiguous() for k, v in ref["text_encoder"].state_dict().items()}
    qwen["lm_head.weight"] = torch.zeros(3, 3)
    save_file(qwen, tmp_path / "qwen_3_4b.safetensors")
    mcfg = ModelConfig(
        path=tmp_path / "z_image.safetensors",
        config="z-image-tiny",
        ae=tmp_path / "ae.safetensors",
        text_encoder=tmp_path / "qwen_3_4b.safetensors",
        tokenizer_path=tiny / "tokenizer",
    )
    got = fam.load(mcfg, ["transformer", "vae", "text_encoder"])
    assert type(got["tokenizer"]).__name__ == "Qwen2Tokenizer"
    for part in ("transformer", "vae", "text_encoder"):
        want = ref[part].state_dict()
        have = got[part].state_dict()
        assert set(have) == set(want) and all(torch.equal(have[k], want[k]) for k in want), part
    assert fam.recognises_single_file(list(original)) and not fam.recognises_single_file(["blocks.0.attn.wq.weight"])
    with pytest.raises(ModelLoadError, match="Qwen3 text encoder"):
        fam.load(ModelConfig(path=tiny, text_encoder=tmp_path / "ae.safetensors"), ["text_encoder"], tokenizers=False)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        fam.load(ModelConfig(path=tmp_path / "z_image.safetensors", config="z-image-tiny",
                             text_encoder=tmp_path / "qwen_3_4b.safetensors"), ["text_encoder"])  # fmt: skip


def test_a_turbo_checkpoint_is_warned_about_naming_the_base_model(tiny, tmp_path, capsys):
    from difftrain.families import llm_image

    turbo = tmp_path / "Z-Image-Turbo"
    turbo.symlink_to(tiny, target_is_directory=True)
    llm_image._WARNED.clear()
    ZImage().load(ModelConfig(path=turbo), ["transformer"])
    err = " ".join(capsys.readouterr().err.split())
    assert "distilled" in err and "Train on Z-Image (the base model" in err
    llm_image._WARNED.clear()
    ZImage().load(ModelConfig(path=tiny), ["transformer"])
    assert "distilled" not in capsys.readouterr().err


def test_the_loaded_transformer_rotates_in_real_arithmetic_with_the_same_numbers(tiny):
    """The load gives every attention the real-arithmetic rotary processor (zimage/attention.py); a batch of two
    captions of different lengths (the attention mask in use) gives the same output and the same LoRA-free input
    gradients, bit for bit, as diffusers' complex-multiply processor."""
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    fam = ZImage()
    tr = fam.load(ModelConfig(path=tiny), ["transformer"])["transformer"]
    procs = [m.processor for m in tr.modules() if hasattr(m, "processor")]
    assert procs and all(type(p).__name__ == "RealRopeZImageAttnProcessor" for p in procs)
    # one class for all: torch.compile guards on the processor's type, and a class per attention compiled each of
    # the 34 blocks again (34 graphs, 304 s before the first step on an H200, 2026-11-28)
    assert len({type(p) for p in procs}) == 1 and len(procs) > 1
    g = torch.Generator().manual_seed(1)
    texts = [torch.randn(5, 32, generator=g), torch.randn(11, 32, generator=g)]

    def run():
        x = [torch.randn(16, 1, 8, 12, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in (2, 3)]
        out = torch.stack(tr(x, torch.tensor([0.3, 0.8]), texts, return_dict=False)[0])
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [xi.grad for xi in x]

    ours, our_grads = run()
    for m in tr.modules():
        if hasattr(m, "processor"):
            m.set_processor(ZSingleStreamAttnProcessor())
    theirs, their_grads = run()
    assert torch.equal(ours, theirs) and ours.abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads))


def test_compiled_blocks_hold_no_complex_arithmetic(tiny):
    """What the processor is for: the forward and backward graphs torch.compile makes of a block hold no operator
    with a complex result (the rotary table is viewed as real pairs as it comes in), where diffusers' processor
    makes complex tensors and multiplies them, which inductor leaves to eager kernels."""
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    from conftest import complex_ops_when_compiled

    tr = ZImage().load(ModelConfig(path=tiny), ["transformer"])["transformer"]
    hooked = {}
    h = tr.layers[0].register_forward_pre_hook(lambda m, a, k: hooked.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        tr([torch.randn(16, 1, 8, 8)], torch.tensor([0.5]), [torch.randn(6, 32)], return_dict=False)
    h.remove()
    x, *rest = hooked["a"]

    def complex_ops() -> set[str]:
        return complex_ops_when_compiled(tr.layers[0], (x.detach().requires_grad_(), *rest), hooked["k"])

    assert not complex_ops()
    tr.layers[0].attention.set_processor(ZSingleStreamAttnProcessor())
    assert {"aten.view_as_complex.default", "aten.mul.Tensor"} <= complex_ops()
