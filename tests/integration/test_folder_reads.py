"""A diffusers folder's models are read by difftrain (families.common.read_diffusers_model): the same tensors as
diffusers' from_pretrained gives, and no page of the files left mapped in the process. Why it matters: on the host
(fp8 and block swap load there) the read copy is freed layer by layer as the fp8 or pinned copies are made, where
from_pretrained's weights were views of a mapping that kept every page read in the RSS (flux-lora-8gb: 35.2 GiB
peak on the H100, the bf16 file beside its fp8 copy; benchmarks/host_load.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from difftrain.config.schema import ModelConfig
from difftrain.families import common
from difftrain.families.registry import get_family
from difftrain.utils import stored_float_dtype


def _mapped_files(folder: Path) -> set[str]:
    """Files under ``folder`` that this process has mapped now (Linux: /proc/self/maps)."""
    out = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(str(folder)):
            out.add(parts[5])
    return out


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


@linux
@pytest.mark.parametrize("name", ["sdxl", "sd3", "flux", "cogvideox"])
def test_folder_models_read_as_from_pretrained_and_leave_no_mapping(name, tmp_path):
    fam = get_family(name)
    folder = fam.build_tiny(tmp_path / name).resolve()
    parts = [fam.denoiser, "vae"]
    mcfg = ModelConfig(path=folder)
    # the dtype the files store: from_pretrained then returns views of its mapping, as with Flux's bf16 files
    dtype = stored_float_dtype(sorted((folder / fam.denoiser).glob("*.safetensors")))
    ours = fam.load(mcfg, parts, dtype=dtype, device="cpu", tokenizers=False)
    assert _mapped_files(folder) == set()  # the weights are private memory: nothing of the files stays mapped
    with common.mapped_reads():  # diffusers' from_pretrained, as before
        theirs = fam.load(mcfg, parts, dtype=dtype, device="cpu", tokenizers=False)
        assert _mapped_files(folder)  # the check above can fail: from_pretrained's weights are views of a mapping
    for part in parts:
        a, b = ours[part].state_dict(), theirs[part].state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (part, k)
        assert type(ours[part]) is type(theirs[part]) and dict(ours[part].config) == dict(theirs[part].config)
        assert not ours[part].training and not any(p.requires_grad for p in ours[part].parameters())


def _tiny_flux_transformer(tmp_path: Path, shard: str | None = None) -> tuple[Path, type]:
    from diffusers import FluxTransformer2DModel

    fam = get_family("flux")
    folder = fam.build_tiny(tmp_path / "flux")
    if shard:  # the same weights in shards with an index, as large models are published
        m = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")
        for f in (folder / "transformer").glob("*.safetensors"):
            f.unlink()
        m.save_pretrained(folder / "transformer", max_shard_size=shard)
    return folder, FluxTransformer2DModel


def test_sharded_folder_and_fp32_modules_read_as_from_pretrained(tmp_path):
    folder, cls = _tiny_flux_transformer(tmp_path, shard="20KB")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()

    class KeepsNormOut(cls):  # a class that keeps a module in fp32, as some diffusers models do
        _keep_in_fp32_modules: ClassVar[list[str]] = ["norm_out"]

    ours = common.read_diffusers_model(folder / "transformer", KeepsNormOut, torch.bfloat16, "cpu")
    assert ours is not None
    theirs = KeepsNormOut.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and a["norm_out.linear.weight"].dtype == torch.float32
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_what_the_reader_does_not_cover_is_left_to_from_pretrained(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, cls = _tiny_flux_transformer(tmp_path)
    f = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    first = next(iter(sd))
    sd["renamed." + first] = sd.pop(first)  # a key the model does not have (an older layout, say)
    save_file(sd, f)
    assert common.read_diffusers_model(folder / "transformer", cls, torch.bfloat16, "cpu") is None
    f.unlink()  # no safetensors weights at all: from_pretrained names what is missing
    assert common.read_diffusers_model(folder / "transformer", cls, torch.bfloat16, "cpu") is None
