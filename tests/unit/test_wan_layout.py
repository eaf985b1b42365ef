"""Wan (issue 51, first slice): the bundled architectures have the published sizes when diffusers' own classes
build them, and the original layout's names map to diffusers' both ways as diffusers' converter maps them."""

from __future__ import annotations

import json

import pytest
import torch

from difftrain.families.common import configs_root
from difftrain.families.wan import single_file as sf

ARCHS = ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b"]


def _build(arch: str, part: str) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = json.loads((configs_root() / arch / part / "config.json").read_text())
    with torch.device("meta"):
        if part.startswith("transformer"):
            return WanTransformer3DModel.from_config(cfg)
        if part == "vae":
            return AutoencoderKLWan.from_config(cfg)
        return UMT5EncoderModel(UMT5Config(**{k: v for k, v in cfg.items() if not k.startswith("_")}))


def _count(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_the_bundled_wan_architectures_have_the_published_sizes():
    """1.3B, 14B (each Wan 2.2 expert too), 2.1 I2V 14B with its image cross-attention (16.4B), TI2V 5B; the 2.1
    VAE (127M, every variant but the 5B), the 2.2 VAE (705M) and UMT5-XXL's encoder (5.68B)."""
    counts = {(a, p): _count(_build(a, p)) for a in ARCHS for p in ("transformer", "transformer_2", "vae", "text_encoder")
              if (configs_root() / a / p / "config.json").is_file()}  # fmt: skip
    assert counts["wan2.1-t2v-1.3b", "transformer"] == 1_418_996_800
    assert counts["wan2.1-t2v-14b", "transformer"] == 14_288_491_584
    assert counts["wan2.1-i2v-14b", "transformer"] == 16_394_878_784
    for expert in ("transformer", "transformer_2"):
        assert counts["wan2.2-t2v-a14b", expert] == counts["wan2.1-t2v-14b", "transformer"]
        # the 2.2 I2V experts: the 14B with 36 input channels (20 more in the patch embedding), no image attention
        assert counts["wan2.2-i2v-a14b", expert] - counts["wan2.1-t2v-14b", "transformer"] == 20 * 5120 * 4
    assert counts["wan2.2-ti2v-5b", "transformer"] == 4_999_787_712
    assert {counts[a, "vae"] for a in ARCHS if a != "wan2.2-ti2v-5b"} == {126_892_531}
    assert counts["wan2.2-ti2v-5b", "vae"] == 704_688_668
    assert {counts[a, "text_encoder"] for a in ARCHS} == {5_680_910_336}


@pytest.mark.parametrize("arch", ["wan2.1-t2v-1.3b", "wan2.1-i2v-14b", "wan2.2-ti2v-5b"])
def test_the_original_names_map_as_diffusers_converter_maps_them(arch):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    names = list(_build(arch, "transformer").state_dict())
    original = {n: sf.to_original(n) for n in names}
    assert None not in original.values() and len(set(original.values())) == len(names)
    assert all(sf.to_diffusers(o) == n for n, o in original.items())  # both ways
    assert all(sf.to_diffusers(sf.PREFIX + o) == n for n, o in original.items())  # ComfyUI's prefix
    for prefix in ("", sf.PREFIX):
        theirs = convert_wan_transformer_to_diffusers({prefix + o: torch.empty(0) for o in original.values()})
        assert sorted(theirs) == sorted(names)
        assert all(sf.to_diffusers(prefix + o) in theirs for o in original.values())
    assert sf.is_wan_file([sf.PREFIX + o for o in original.values()])
    assert sf.to_original("blocks.0.norm2.weight") == "blocks.0.norm3.weight"  # the two norms trade names
    assert sf.to_diffusers("blocks.0.unknown.weight") is None and sf.to_original("nothing.weight") is None


def test_the_wan22_vae_names_map_to_autoencoderklwan_both_ways():
    """wan2.2_vae.safetensors (TI2V-5B's VAE) in Wan's own names: every tensor Wan's module has for the real
    configuration (tests/fixtures/wan22_vae_keys.json: names and shapes from wan/modules/vae2_2.py's WanVAE_ with
    Wan2_2_VAE's settings, on the meta device) lands on the AutoencoderKLWan tensor of the same shape, all of them
    are covered, and the names come back."""
    from pathlib import Path

    fixture = Path(__file__).parents[1] / "fixtures" / "wan22_vae_keys.json"
    original = json.loads(fixture.read_text())
    assert len(original) == 196 and sf.is_wan22_vae(original)
    diffusers = {k: list(v.shape) for k, v in _build("wan2.2-ti2v-5b", "vae").state_dict().items()}
    mapped = {sf.vae22_to_diffusers(k): shape for k, shape in original.items()}
    assert None not in mapped and mapped == diffusers
    assert all(sf.vae22_to_original(sf.vae22_to_diffusers(k), num_res_blocks=2) == k for k in original)
    v21 = {k: list(v.shape) for k, v in _build("wan2.1-t2v-1.3b", "vae").state_dict().items()}
    assert not sf.is_wan22_vae(v21) and sf.vae22_to_diffusers("encoder.downsamples.0.residual.0.gamma") is None
