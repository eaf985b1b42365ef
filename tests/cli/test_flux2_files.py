"""FLUX.2's files through the console script: a file that is not a FLUX.2 transformer, and a text-encoder file that
is not [dev]'s Mistral 3, each refused with what to do, exit 1, no traceback, nothing left beside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_sets


@pytest.fixture(scope="module")
def flux1_like(tmp_path_factory):
    """A FLUX.1 transformer's names (each double block with its own modulation): not FLUX.2's."""
    f = tmp_path_factory.mktemp("flux1") / "flux1-dev.safetensors"
    names = [
        "double_blocks.0.img_mod.lin.weight",
        "double_blocks.0.img_attn.qkv.weight",
        "single_blocks.0.linear1.weight",
    ]
    save_file({k: torch.zeros(4, 4) for k in names}, f)
    return f


def test_a_flux1_file_is_not_taken_for_flux2_through_the_console_script(flux1_like, dataset, tmp_path):
    sets = tiny_sets(flux1_like, dataset, tmp_path, **{"model.config": "flux2-tiny"})
    p = subprocess.run(
        [sys.executable, "-m", "difftrain", "precompute", "--recipe", "tiny-flux2-lora"]
        + [a for s in sets for a in ("--set", s)],
        capture_output=True,
        text=True,
        env=dict(os.environ, DIFFTRAIN_DEBUG="0"),
        timeout=300,
    )
    err = " ".join(p.stderr.split())
    assert p.returncode == 1, p.stderr
    assert "does not look like a FLUX.2 transformer" in err and "family" in err  # another model needs its family
    assert "Traceback" not in p.stderr
    assert not list((tmp_path / "cache").glob("**/*.safetensors"))


def test_a_text_encoder_file_that_is_not_devs_mistral3_is_refused(cli, dataset, tmp_path):
    from difftrain.families.flux2 import Flux2

    model = Flux2().build_tiny(tmp_path / "dev", seed=0, config="flux2-tiny-dev")
    models = tmp_path / "models"
    models.mkdir()
    own = models / "mistral_3_small_flux2_bf16.safetensors"
    save_file({"model.language_model.norm.weight": torch.ones(32)}, own)  # a norm, no layers
    sets = tiny_sets(model, dataset, tmp_path, **{"model.config": "flux2-tiny-dev", "model.text_encoder": own})
    r = cli("precompute", "--recipe", "tiny-flux2-lora", *[a for s in sets for a in ("--set", s)])
    err = " ".join(r.err.split())
    assert r.code == 1, r
    assert "does not look like FLUX.2 [dev]'s Mistral 3" in err and "mistral_3_small_flux2_bf16" in err
    assert "Traceback" not in r.err
    assert [p.name for p in models.iterdir()] == [own.name]  # no folder left beside it
