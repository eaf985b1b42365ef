"""Qwen-Image on tiny seeded models of the real layout: the bundled real architecture's sizes, the text and the
transformer's inputs exactly as QwenImagePipeline builds them (a mixed-length batch gives each sample its own
prediction), loading the transformer and VAE files ComfyUI users have."""

from __future__ import annotations

import pytest
import torch

from difftrain.config.load import resolve
from difftrain.config.schema import ModelConfig
from difftrain.errors import ModelLoadError
from difftrain.families.qwenimage import QwenImage


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return QwenImage().build_tiny(tmp_path_factory.mktemp("qwenimage") / "m", seed=0)


def test_the_bundled_architecture_has_the_released_models_sizes():
    """Qwen-Image's 20.43B MMDiT, Qwen2.5-VL-7B-Instruct (8.29B with its vision tower and head) and the Qwen-Image
    VAE, built on the meta device from the bundled configs."""
    fam = QwenImage()
    mcfg = ModelConfig(config="qwen-image")
    with torch.device("meta"):
        counts = {
            p: sum(x.numel() for x in fam.empty_part(mcfg, p).parameters())
            for p in ("transformer", "text_encoder", "vae")
        }
    assert counts == {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531}


def test_captions_are_encoded_as_the_pipeline_encodes_them(tiny):
    from diffusers import QwenImagePipeline

    fam = QwenImage()
    comps = fam.load(ModelConfig(path=tiny), ["text_encoder"])
    opts = resolve(recipe="tiny-qwen-image-lora", sets=[f"model.path={tiny}", "data.dir=."]).config.text_encoders
    captions = ["a fox in the snow", "a much longer caption: a cat on a red sofa, evening light"]
    got = fam.encode_prompts(comps, captions, "qwen25vl", opts)["prompt_embeds"]
    pipe = QwenImagePipeline.from_pretrained(tiny)
    want, mask = pipe.encode_prompt(captions, device=torch.device("cpu"))
    for i, g in enumerate(got):
        torch.testing.assert_close(g, want[i][mask[i].bool()].float())
    assert got[0].shape[0] < got[1].shape[0]


def test_the_transformer_gets_the_pipelines_inputs_in_a_mixed_length_batch(tiny):
    from diffusers import QwenImagePipeline

    fam = QwenImage()
    comps = fam.load(ModelConfig(path=tiny), ["transformer", "text_encoder"])
    pipe = QwenImagePipeline.from_pretrained(tiny)
    captions = ["a fox", "a cat on a red sofa in the evening light"]
    opts = resolve(recipe="tiny-qwen-image-lora", sets=[f"model.path={tiny}", "data.dir=."]).config.text_encoders
    cached = fam.encode_prompts(comps, captions, "qwen25vl", opts)["prompt_embeds"]
    batch = fam.collate_text("qwen25vl", [{"prompt_embeds": t} for t in cached])
    g = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 16, 8, 12, generator=g)
    t = torch.tensor([250.0, 900.0])
    tr = comps["transformer"]
    with torch.no_grad():
        got = fam.denoise(tr, noisy, t, batch)
        for i in range(2):
            embeds, mask = pipe.encode_prompt([captions[i]], device=torch.device("cpu"))
            want = tr(
                hidden_states=pipe._pack_latents(noisy[i : i + 1], 1, 16, 8, 12),
                timestep=t[i : i + 1] / 1000,
                encoder_hidden_states_mask=mask,
                encoder_hidden_states=embeds,
                img_shapes=[[(1, 4, 6)]],
                return_dict=False,
            )[0]
            want = pipe._unpack_latents(want, 64, 96, 8).squeeze(2)
            torch.testing.assert_close(got[i : i + 1], want, rtol=1e-4, atol=1e-5)


def test_comfyui_files_load_the_transformer_and_vae(tiny, tmp_path):
    from safetensors.torch import save_file
    from test_wan_family import _wan_vae_name  # Wan 2.1's own VAE names (the Qwen-Image VAE has its layout)

    fam = QwenImage()
    ref = fam.load(ModelConfig(path=tiny), ["transformer", "vae"], tokenizers=False)
    prefixed = {f"model.diffusion_model.{k}": v.contiguous() for k, v in ref["transformer"].state_dict().items()}
    save_file(prefixed, tmp_path / "qwen_image.safetensors")
    save_file(
        {_wan_vae_name(k): v.contiguous() for k, v in ref["vae"].state_dict().items()}, tmp_path / "vae.safetensors"
    )
    mcfg = ModelConfig(
        path=tmp_path / "qwen_image.safetensors", config="qwen-image-tiny", ae=tmp_path / "vae.safetensors"
    )
    got = fam.load(mcfg, ["transformer", "vae"])
    for part in ("transformer", "vae"):
        want, have = ref[part].state_dict(), got[part].state_dict()
        assert set(have) == set(want) and all(torch.equal(have[k], want[k]) for k in want), part
    with pytest.raises(ModelLoadError, match=r"transformer only; it has no Qwen2\.5-VL text encoder") as e:
        fam.load(mcfg, ["text_encoder"])
    assert "model.text_encoder=qwen_2.5_vl_7b.safetensors" in e.value.hint
    with pytest.raises(ModelLoadError, match="does not look like a Qwen-Image transformer"):
        fam.load(ModelConfig(path=tmp_path / "vae.safetensors", config="qwen-image-tiny"), ["transformer"])


def _capture_block_inputs(fam, tr):
    """The first block's inputs in a two-sample batch of different caption lengths (the text mask in use)."""
    hooked = {}
    h = tr.transformer_blocks[0].register_forward_pre_hook(lambda m, a, k: hooked.update(a=a, k=k), with_kwargs=True)
    g = torch.Generator().manual_seed(2)
    batch = fam.collate_text("qwen25vl", [{"prompt_embeds": torch.randn(n, 32, generator=g)} for n in (5, 9)])
    with torch.no_grad():
        fam.denoise(tr, torch.randn(2, 16, 8, 12, generator=g), torch.tensor([300.0, 700.0]), batch)
    h.remove()
    return hooked


def test_the_loaded_transformer_rotates_in_real_arithmetic_with_the_same_numbers(tiny):
    """The load gives every attention the real-arithmetic rotary processor (qwenimage/attention.py): a block's
    outputs and its inputs' gradients are diffusers' processor's, bit for bit."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    fam = QwenImage()
    tr = fam.load(ModelConfig(path=tiny), ["transformer"])["transformer"]
    procs = [m.processor for m in tr.modules() if hasattr(m, "processor")]
    assert procs and all(type(p).__name__ == "RealRopeQwenDoubleStreamAttnProcessor2_0" for p in procs)
    hooked = _capture_block_inputs(fam, tr)
    block = tr.transformer_blocks[0]

    def run():
        kw = dict(hooked["k"])
        img = kw["hidden_states"] = kw["hidden_states"].detach().requires_grad_()
        txt = kw["encoder_hidden_states"] = kw["encoder_hidden_states"].detach().requires_grad_()
        outs = block(*hooked["a"], **kw)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        return [o.detach() for o in outs], [img.grad, txt.grad]

    ours, our_grads = run()
    block.attn.set_processor(QwenDoubleStreamAttnProcessor2_0())
    theirs, their_grads = run()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and ours[0].abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads))


def test_compiled_blocks_hold_no_complex_arithmetic(tiny):
    """The forward and backward graphs torch.compile makes of a block hold no operator with a complex result, where
    diffusers' processor makes complex tensors and multiplies them (left to eager kernels by inductor)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    from conftest import complex_ops_when_compiled

    fam = QwenImage()
    tr = fam.load(ModelConfig(path=tiny), ["transformer"])["transformer"]
    hooked = _capture_block_inputs(fam, tr)

    def complex_ops() -> set[str]:
        kw = {**hooked["k"], "hidden_states": hooked["k"]["hidden_states"].detach().requires_grad_()}
        return complex_ops_when_compiled(tr.transformer_blocks[0], hooked["a"], kw)

    assert not complex_ops()
    tr.transformer_blocks[0].attn.set_processor(QwenDoubleStreamAttnProcessor2_0())
    assert {"aten.view_as_complex.default", "aten.mul.Tensor"} <= complex_ops()


def _hub_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen2.5-VL in the Hub checkpoint's names, as ComfyUI's qwen_2.5_vl_7b.safetensors has them."""
    out = {}
    for k, v in sd.items():
        k = k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
        out[k] = v.contiguous()
    return out


def test_comfyui_text_encoder_files_load_qwen25vl(tiny, tmp_path):
    """model.text_encoder: Qwen2.5-VL from its own file in the Hub checkpoint's names (ComfyUI's), with or without
    lm_head, and an fp8_scaled one (each Linear weight times its scale_weight); it encodes as the folder's."""
    from safetensors.torch import save_file

    fam = QwenImage()
    ref = fam.load(ModelConfig(path=tiny), ["text_encoder"])
    want = ref["text_encoder"].state_dict()
    hub = _hub_names(want)
    assert any(k.startswith("visual.") for k in hub) and any(k.startswith("model.layers.") for k in hub)
    save_file(hub, tmp_path / "qwen_2.5_vl.safetensors")
    save_file({k: v for k, v in hub.items() if k != "lm_head.weight"}, tmp_path / "headless.safetensors")
    scaled = {}
    for k, v in hub.items():
        if k.startswith("model.layers.") and k.endswith("proj.weight"):
            s = v.abs().max() / 448
            scaled[k], scaled[k.removesuffix("weight") + "scale_weight"] = (v / s).to(torch.float8_e4m3fn), s
        else:
            scaled[k] = v
    scaled["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    save_file(scaled, tmp_path / "qwen_2.5_vl_fp8_scaled.safetensors")
    opts = resolve(recipe="tiny-qwen-image-lora", sets=[f"model.path={tiny}", "data.dir=."]).config.text_encoders
    captions = ["a fox", "a cat on a red sofa in the evening light"]
    encoded = fam.encode_prompts(ref, captions, "qwen25vl", opts)["prompt_embeds"]
    for name, exact in (("qwen_2.5_vl", True), ("headless", True), ("qwen_2.5_vl_fp8_scaled", False)):
        comps = fam.load(ModelConfig(path=tiny, text_encoder=tmp_path / f"{name}.safetensors"), ["text_encoder"])
        have = comps["text_encoder"].state_dict()
        assert set(have) == set(want), name
        for k in want:
            if exact or "proj.weight" not in k or "language_model.layers" not in k:
                assert torch.equal(have[k], want[k]) or (name == "headless" and k == "lm_head.weight"), (name, k)
            else:  # fp8: within its 3-bit mantissa of the weight
                torch.testing.assert_close(have[k], want[k], rtol=0.07, atol=want[k].abs().max().item() / 40)
        if exact:
            got = fam.encode_prompts(comps, captions, "qwen25vl", opts)["prompt_embeds"]
            assert all(torch.equal(a, b) for a, b in zip(got, encoded)), name
    tr = fam.load(ModelConfig(path=tiny), ["transformer"])["transformer"]
    save_file({k: v.contiguous() for k, v in tr.state_dict().items()}, tmp_path / "not_qwen25vl.safetensors")
    with pytest.raises(ModelLoadError, match=r"not_qwen25vl\.safetensors does not fit .* Qwen2\.5-VL text encoder"):
        fam.load(ModelConfig(path=tiny, text_encoder=tmp_path / "not_qwen25vl.safetensors"), ["text_encoder"])


def comfyui_set(fam, folder, config: str, out, **load) -> tuple[dict, ModelConfig]:
    """The folder's model loaded (``load``: the family's load options) and ComfyUI's files written from it: the
    transformer alone, Qwen2.5-VL in the Hub's names (its own file), the tokenizer from the folder; the model config
    that names them. Shared by the Qwen-Image and Edit tests."""
    from safetensors.torch import save_file

    ref = fam.load(ModelConfig(path=folder), ["transformer", "text_encoder"], **load)
    save_file({k: v.contiguous() for k, v in ref["transformer"].state_dict().items()}, out / "transformer.safetensors")
    save_file(_hub_names(ref["text_encoder"].state_dict()), out / "qwen_2.5_vl.safetensors")
    mcfg = ModelConfig(
        path=out / "transformer.safetensors",
        config=config,
        text_encoder=out / "qwen_2.5_vl.safetensors",
        tokenizer_path=folder / "tokenizer",
    )
    return ref, mcfg


def test_a_transformer_file_with_the_text_encoders_own_file_needs_no_folder(tiny, tmp_path):
    """The ComfyUI set: the transformer file, the VAE file and Qwen2.5-VL's file, the tokenizer from its folder."""
    fam = QwenImage()
    ref, mcfg = comfyui_set(fam, tiny, "qwen-image-tiny", tmp_path, tokenizers=False)
    got = fam.load(mcfg, ["text_encoder"])
    assert "tokenizer" in got
    want = ref["text_encoder"].state_dict()
    assert all(torch.equal(got["text_encoder"].state_dict()[k], v) for k, v in want.items())


def test_unused_parameters_are_exactly_those_no_gradient_reaches(tiny):
    """A full fine-tune freezes what takes no part in the output (DDP refused the trained step: 'parameters that
    were not used in producing loss'): after a backward, the parameters without a gradient are the family's list."""
    fam = QwenImage()
    tr = fam.load(ModelConfig(path=tiny), ["transformer"])["transformer"].requires_grad_(True)
    width = tr.config.joint_attention_dim
    batch = fam.collate_text("qwen25vl", [{"prompt_embeds": torch.randn(n, width)} for n in (5, 9)])
    batch = {k: v.to(next(tr.parameters()).dtype) if v.is_floating_point() else v for k, v in batch.items()}
    noisy = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    fam.denoise(tr, noisy, torch.tensor([250.0, 900.0]), batch).square().mean().backward()
    no_grad = {n for n, p in tr.named_parameters() if p.grad is None}
    unused = fam.unused_parameters(tr)
    assert (
        set(unused) == no_grad and len(unused) == 6
    )  # the last block's text output projection and MLP (weights, biases)
