"""The SDXL family loads a diffusers folder, a single .safetensors file, and (only when allowed) a pickle."""

from __future__ import annotations

import pytest
import torch

from difftrain.config.schema import ModelConfig
from difftrain.errors import ModelLoadError, UnsafeCheckpoint
from difftrain.families.sdxl.family import PARTS, SDXL


def _state(comps):
    return {
        part: {k: v for k, v in comps[part].state_dict().items() if not k.endswith("position_ids")} for part in PARTS
    }


def _save(comps, path):
    return SDXL().save_single_file({p: comps[p].state_dict() for p in PARTS}, SDXL.module_configs(comps), path)


def _assert_same(a, b):
    for part in PARTS:
        assert a[part].keys() == b[part].keys(), part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k}"


@pytest.fixture(scope="module")
def folder_comps(tiny_model):
    return SDXL().load(ModelConfig(path=tiny_model), PARTS)


def test_single_file_round_trip(tiny_model, folder_comps, tmp_path):
    fam = SDXL()
    file = _save(folder_comps, tmp_path / "tiny_sdxl.safetensors")
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.diffusion_model.") for k in keys)
    assert any(k.startswith("first_stage_model.") for k in keys)
    assert any(k.startswith("conditioner.embedders.1.model.transformer.resblocks.") for k in keys)

    mcfg = ModelConfig(path=file, config="sdxl-tiny", tokenizer_path=tiny_model)
    back = fam.load(mcfg, PARTS)
    _assert_same(_state(folder_comps), _state(back))
    ids = back["tokenizer"](["a red circle"]).input_ids
    assert ids == folder_comps["tokenizer"](["a red circle"]).input_ids
    # the same prompt encodes to the same embeddings through either source
    torch.testing.assert_close(
        fam.encode_prompts(back, ["a red circle"])["prompt_embeds"],
        fam.encode_prompts(folder_comps, ["a red circle"])["prompt_embeds"],
    )


def test_single_file_with_wrong_bundled_config_is_refused(folder_comps, tmp_path, tiny_model):
    file = _save(folder_comps, tmp_path / "tiny.safetensors")
    with pytest.raises(ModelLoadError) as e:
        SDXL().load(ModelConfig(path=file, config="sdxl-base-1.0", tokenizer_path=tiny_model), ["unet"])
    assert "model.config" in e.value.hint and "sdxl-tiny" in e.value.hint
    assert "'sdxl-base-1.0'" in e.value.message and "missing" in e.value.message


def test_pickle_refused_by_default_then_loaded_weights_only(folder_comps, tmp_path, tiny_model):
    from safetensors.torch import load_file

    file = _save(folder_comps, tmp_path / "tiny.safetensors")
    ckpt = tmp_path / "tiny.ckpt"
    torch.save({"state_dict": load_file(file)}, ckpt)
    with pytest.raises(UnsafeCheckpoint) as e:
        SDXL().load(ModelConfig(path=ckpt, config="sdxl-tiny", tokenizer_path=tiny_model), ["unet"])
    assert "--allow-pickle" in e.value.hint

    back = SDXL().load(ModelConfig(path=ckpt, config="sdxl-tiny", tokenizer_path=tiny_model, allow_pickle=True), PARTS)
    _assert_same(_state(folder_comps), _state(back))


def test_pickle_with_code_is_not_executed(tmp_path, tiny_model):
    """weights_only=True: a checkpoint that would run code on unpickling is rejected, not run."""
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ckpt = tmp_path / "evil.ckpt"
    ckpt.write_bytes(pickle.dumps({"state_dict": Evil()}))
    with pytest.raises(Exception):  # noqa: B017 (whatever the loader raises, the payload must not run)
        SDXL().load(ModelConfig(path=ckpt, config="sdxl-tiny", tokenizer_path=tiny_model, allow_pickle=True), ["unet"])
    assert not marker.exists()


def test_folder_that_is_not_sdxl(tmp_path):
    with pytest.raises(ModelLoadError, match="not a diffusers SDXL folder"):
        SDXL().load(ModelConfig(path=tmp_path), ["unet"])
