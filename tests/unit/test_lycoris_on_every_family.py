"""LoHa, LoKr and DoRA on every family's denoiser (issue 54), fast: each adapter goes on the same modules as the
family's LoRA (its tiny recipe's targets on the tiny architecture), one optimizer step moves every adapted layer's
weight, and the layers are written in the family's kohya names (LoKr refused before training where those names fuse
q/k/v, with the reason). tests/integration/test_lycoris_families.py trains each (the two files need different basenames: pytest imports test files by their basename) through the trainer."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from difftrain.config.load import resolve
from difftrain.config.schema import LoraConfig, ModelConfig
from difftrain.errors import ConfigError
from difftrain.families.registry import get_family
from difftrain.flows.quickstart import _flow_sets, quickstart_families
from difftrain.lora import files as lora_files
from difftrain.lora.adapters import adapter_metadata, add_lora, export_layers

KINDS = {"loha": {"type": "loha"}, "lokr": {"type": "lokr"}, "dora": {"use_dora": True}}


def _cfg(name: str, tmp_path):
    recipe, sets = _flow_sets(name)
    return resolve(recipe=recipe, sets=[*sets, f"train.output_dir={tmp_path}", "lora.rank=2"]).config


def _with(cfg, **lora):
    return cfg.model_copy(update={"lora": LoraConfig(**{**cfg.lora.model_dump(), **lora})})


def _denoiser(fam, cfg) -> torch.nn.Module:
    with torch.device("meta"):
        m = fam.empty_part(ModelConfig(config=cfg.model.config), fam.denoiser)
    m = m.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.05
    return m


def _adapted_layers(m: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n: x for n, x in m.named_modules() if isinstance(x, BaseTunerLayer)}


def _weight(layer) -> torch.Tensor:
    """The layer's effective weight (peft's own merge of a copy)."""
    c = copy.deepcopy(layer)
    c.merge()
    return c.get_base_layer().weight.detach()


# SDXL's UNet takes seconds to build and adapt here: slow (tests/integration/test_lycoris_training.py trains it)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "sdxl" else n for n in quickstart_families()]
)
def test_each_adapter_goes_on_the_loras_modules_and_one_step_moves_them(name, tmp_path):
    fam = get_family(name)
    plain_cfg = _cfg(name, tmp_path)
    base = _denoiser(fam, plain_cfg)
    plain = copy.deepcopy(base)
    add_lora(plain, plain_cfg.lora, plain_cfg.lora.targets)
    want = set(_adapted_layers(plain))
    assert want
    for kind, extra in KINDS.items():
        cfg = _with(plain_cfg, **extra)
        m = copy.deepcopy(base)
        params = add_lora(m, cfg.lora, cfg.lora.targets)
        layers = _adapted_layers(m)
        assert set(layers) == want, kind  # the same modules as the family's LoRA
        layers = dict(list(layers.items())[::7][:6])  # the step on a few of them (Linears and convs): quick
        before = {n: _weight(x) for n, x in layers.items()}
        opt = torch.optim.AdamW(params, lr=1e-2)
        loss = torch.zeros(())
        for layer in layers.values():
            inner = layer.get_base_layer()
            if isinstance(inner, torch.nn.Conv2d):
                x = torch.randn(1, inner.in_channels, 6, 6)
            else:
                x = torch.randn(2, inner.in_features)
            loss = loss + layer(x).square().mean()
        loss.backward()
        opt.step()
        moved = [n for n, x in layers.items() if not torch.equal(_weight(x), before[n])]
        assert moved == list(layers), (kind, sorted(set(layers) - set(moved))[:3])
        if not fam.kohya_layout:
            with pytest.raises(ConfigError, match="no kohya layout") if kind != "dora" else _nothing():
                lora_files.formats(cfg, fam)
            continue
        fused = any(fam.kohya_fused(cfg.model, fam.denoiser).values()) if fam.kohya_layout else False
        if kind == "lokr" and fused:  # Flux's and Z-Image's q/k/v are one layer in the kohya names
            with pytest.raises(ConfigError, match="rows of several Kronecker products"):
                lora_files.check_kohya_names(cfg, fam, [fam.denoiser])
            continue
        lora_files.check_kohya_names(cfg, fam, [fam.denoiser])
        path = tmp_path / f"{kind}.safetensors"
        meta = {fam.denoiser: adapter_metadata(m)}
        lora_files.write_kohya(path, cfg, fam, {fam.denoiser: export_layers(m)}, meta)
        sd = load_file(path)
        leaves = {k.rpartition(".")[2] for k in sd}
        if kind == "loha":
            assert {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"} == leaves
        elif kind == "lokr":
            assert {"lokr_w1", "alpha"} <= leaves and leaves <= {
                "lokr_w1",
                "lokr_w2",
                "lokr_w2_a",
                "lokr_w2_b",
                "alpha",
            }
        else:
            assert "dora_scale" in leaves
        # read back through the same reader lora merge and lora.init_weights use
        read, _ = lora_files.read_lora_file(path, cfg.model, fam, [fam.denoiser])
        assert len(read[fam.denoiser]) == len(export_layers(m))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_adapters_the_fused_kohya_names_cannot_hold_are_refused_before_training(tmp_path):
    fam = get_family("flux")
    cfg = _cfg("flux", tmp_path)
    lora_files.check_kohya_names(_with(cfg, use_dora=True), fam, [fam.denoiser])  # the recipe's targets: all of each
    with pytest.raises(ConfigError, match="DoRA magnitude needs every one of them adapted") as e:
        lora_files.check_kohya_names(_with(cfg, use_dora=True, targets=["to_q", "to_k"]), fam, [fam.denoiser])
    assert "Add to_v" in e.value.hint
    with pytest.raises(ConfigError, match="rows of several Kronecker products") as e:
        lora_files.check_kohya_names(_with(cfg, type="lokr", targets=["to_v", "to_out.0"]), fam, [fam.denoiser])
    assert "Leave to_v out of lora.targets" in e.value.hint
    lora_files.check_kohya_names(_with(cfg, type="lokr", targets=["to_out.0", "ff.net.2"]), fam, [fam.denoiser])
