"""LoHa, LoKr and DoRA (issue 54): the tensors difftrain writes in the kohya/LyCORIS names make, through ComfyUI's
own formulas (written out below from comfy/weight_adapter/lora.py, loha.py, lokr.py and base.py's weight_decompose),
the weights peft trains; the same file read back gives peft the same adapter; Flux's and Z-Image's fused q/k/v hold
LoHa and DoRA exactly and refuse LoKr with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.loaders.peft import PeftAdapterMixin

from difftrain.config.schema import LoraConfig
from difftrain.lora import files, kohya, lycoris
from difftrain.lora.adapters import adapter_metadata, add_lora, export_layers, peft_config


# ------------------------------------------------------------ ComfyUI's formulas (comfy/weight_adapter, 2025-2026)
def comfy_weight_decompose(dora_scale, weight, lora_diff, alpha, strength):
    """base.py weight_decompose (function = identity, fp32). ComfyUI's output-axis branch divides by the norm of
    ``weight`` (W), not of ``weight_calc`` (W + ΔW): Comfy-Org/ComfyUI#15458 fixes that to LyCORIS' and peft's
    W + ΔW, which is what is written here (the one changed line is marked)."""
    lora_diff = lora_diff * alpha
    weight_calc = weight + lora_diff
    wd_on_output_axis = dora_scale.shape[0] == weight_calc.shape[0]
    if wd_on_output_axis:
        weight_norm = (
            weight_calc.reshape(weight_calc.shape[0], -1)  # ComfyUI today: weight.reshape(weight.shape[0], -1)
            .norm(dim=1, keepdim=True)
            .reshape(weight_calc.shape[0], *[1] * (weight_calc.dim() - 1))
        )
    else:
        weight_norm = (
            weight_calc.transpose(0, 1)
            .reshape(weight_calc.shape[1], -1)
            .norm(dim=1, keepdim=True)
            .reshape(weight_calc.shape[1], *[1] * (weight_calc.dim() - 1))
            .transpose(0, 1)
        )
    weight_norm = weight_norm + torch.finfo(weight.dtype).eps
    weight_calc = weight_calc * (dora_scale / weight_norm)
    if strength != 1.0:
        return weight + strength * (weight_calc - weight)
    return weight_calc


def comfy_lora(weight, up, down, alpha, dora_scale, strength=1.0):
    """lora.py LoRAAdapter.calculate_weight (no mid, no reshape)."""
    alpha = alpha / down.shape[0] if alpha is not None else 1.0
    lora_diff = torch.mm(up.flatten(start_dim=1), down.flatten(start_dim=1)).reshape(weight.shape)
    if dora_scale is not None:
        return comfy_weight_decompose(dora_scale, weight, lora_diff, alpha, strength)
    return weight + (strength * alpha) * lora_diff


def comfy_loha(weight, w1a, w1b, alpha, w2a, w2b, t1=None, t2=None, strength=1.0):
    """loha.py LoHaAdapter.calculate_weight."""
    alpha = alpha / w1b.shape[0] if alpha is not None else 1.0
    if t1 is not None:  # cp decomposition
        m1 = torch.einsum("i j k l, j r, i p -> p r k l", t1, w1b, w1a)
        m2 = torch.einsum("i j k l, j r, i p -> p r k l", t2, w2b, w2a)
    else:
        m1, m2 = torch.mm(w1a, w1b), torch.mm(w2a, w2b)
    return weight + (strength * alpha) * (m1 * m2).reshape(weight.shape)


def comfy_lokr(weight, w1, w2, alpha, w1_a, w1_b, w2_a, w2_b, t2=None, strength=1.0):
    """lokr.py LoKrAdapter.calculate_weight."""
    dim = None
    if w1 is None:
        dim = w1_b.shape[0]
        w1 = torch.mm(w1_a, w1_b)
    if w2 is None:
        dim = w2_b.shape[0]
        if t2 is None:
            w2 = torch.mm(w2_a, w2_b)
        else:
            w2 = torch.einsum("i j k l, j r, i p -> p r k l", t2, w2_b, w2_a)
    if len(w2.shape) == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    alpha = alpha / dim if (alpha is not None and dim is not None) else 1.0
    return weight + (strength * alpha) * torch.kron(w1, w2).reshape(weight.shape)


def comfy_apply(sd: dict[str, torch.Tensor], x: str, weight: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
    """comfy/lora.py load_lora's dispatch for one key name ``x``, then the adapter's calculate_weight."""
    alpha = sd[x + ".alpha"].item() if x + ".alpha" in sd else None
    dora_scale = sd.get(x + ".dora_scale")
    if x + ".lora_up.weight" in sd:
        return comfy_lora(weight, sd[x + ".lora_up.weight"], sd[x + ".lora_down.weight"], alpha, dora_scale, strength)
    if x + ".hada_w1_a" in sd:
        assert dora_scale is None
        return comfy_loha(weight, *(sd[x + k] for k in (".hada_w1_a", ".hada_w1_b")), alpha,
                          *(sd[x + k] for k in (".hada_w2_a", ".hada_w2_b")), sd.get(x + ".hada_t1"),
                          sd.get(x + ".hada_t2"), strength=strength)  # fmt: skip
    get = lambda k: sd.get(x + k)
    return comfy_lokr(weight, get(".lokr_w1"), get(".lokr_w2"), alpha, get(".lokr_w1_a"), get(".lokr_w1_b"),
                      get(".lokr_w2_a"), get(".lokr_w2_b"), get(".lokr_t2"), strength=strength)  # fmt: skip


# ------------------------------------------------------------ a toy model with peft's adapters
class Toy(torch.nn.Module, PeftAdapterMixin):
    """Linear q/k/v, a 3x3 and a 1x1 conv: the layers the families adapt (add_adapter as diffusers' models have it)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.to_q = torch.nn.Linear(24, 36)
        self.to_k = torch.nn.Linear(24, 36)
        self.to_v = torch.nn.Linear(24, 36)
        self.conv = torch.nn.Conv2d(8, 24, 3)
        self.proj = torch.nn.Conv2d(24, 12, 1)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)


TARGETS = ["to_q", "to_k", "to_v", "conv", "proj"]
SETTINGS = {
    "lora": {},
    "dora": {"use_dora": True},
    "loha": {"type": "loha"},
    "lokr": {"type": "lokr"},
    "lokr-factor-both": {"type": "lokr", "factor": 4, "decompose_both": True},
    "lokr-full": {"type": "lokr", "full_matrix": True},
    "loha-tucker": {"type": "loha", "use_tucker": True},
}


def _adapted(settings: dict, seed: int = 1) -> Toy:
    """The toy with the adapter of ``settings`` (rank 4, alpha 3), every adapter weight random (a trained one)."""
    m = Toy()
    params = add_lora(m, LoraConfig(rank=4, alpha=3, targets=TARGETS, **settings), TARGETS)
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.data = p.data + torch.randn(p.shape, generator=g) * 0.3
    return m


def _merged(m: Toy) -> dict[str, torch.Tensor]:
    """peft's own merge of each adapted layer: the weights it trains (W' = W + ΔW, or DoRA's)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    m = copy.deepcopy(m)
    out = {}
    for name in TARGETS:
        layer = getattr(m, name)
        assert isinstance(layer, BaseTunerLayer)
        layer.merge()
        out[name] = layer.get_base_layer().weight.detach().clone()
    return out


def _kohya(m: Toy, fused=None) -> dict[str, torch.Tensor]:
    layers = export_layers(m)
    meta = adapter_metadata(m)
    names = {"transformer": {t: t for t in TARGETS}}
    alphas = {"transformer": files.alphas(meta, layers)}
    return kohya.to_kohya(
        {"transformer": files.lycoris_layers(meta, layers)}, names, alphas, fused=fused, prefixes=kohya.PREFIXES
    )


@pytest.mark.parametrize("which", list(SETTINGS))
def test_comfyuis_formulas_on_the_written_tensors_give_peft_weights(which):
    m = _adapted(SETTINGS[which])
    want = _merged(m)
    sd = _kohya(m)
    kind = "dora" if which == "dora" else which.partition("-")[0]
    leaves = {k.rpartition(".")[2] for k in sd if not k.endswith((".alpha", ".weight"))}
    assert leaves <= {"dora_scale", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w1_a",
                      "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "hada_t1", "hada_t2", "lokr_t2"}  # fmt: skip
    hada = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}
    own = {"lora": set(), "dora": {"dora_scale"}, "loha": hada, "loha-tucker": hada | {"hada_t1", "hada_t2"}}
    assert own.get(which, leaves) == leaves
    if which == "loha-tucker":
        assert "lora_transformer_conv.hada_t1" in sd and "lora_transformer_proj.hada_t1" not in sd  # 3x3 only
    if which == "lokr-full":
        assert "lora_transformer_to_q.lokr_w1" in sd and "lora_transformer_to_q.lokr_w2_a" not in sd
    if which == "lokr-factor-both":
        assert sd["lora_transformer_to_q.lokr_w1"].shape == (4, 4)  # factor 4: 36 = 4 x 9, 24 = 4 x 6
    back = kohya.from_kohya(sd, {"transformer": {t: t for t in TARGETS}}, prefixes=kohya.PREFIXES)[0]["transformer"]
    for name in TARGETS:
        base = getattr(m, name).get_base_layer().weight.detach()
        x = f"lora_transformer_{name}"
        got = comfy_apply(sd, x, base.clone())
        assert not torch.allclose(got, base, atol=1e-3)  # the adapter changes the layer
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5)
        if kind == "dora":
            assert sd[x + ".dora_scale"].shape == (base.shape[0], *[1] * (base.dim() - 1))  # LyCORIS' wd_on_out
        # difftrain's own formula (lora merge) is the same, also at another strength
        alpha = sd[x + ".alpha"].item()
        leaves_peft = lycoris.modules(back)[name]
        for s in (1.0, 0.6):
            torch.testing.assert_close(
                base + s * lycoris.delta(leaves_peft, alpha, base), comfy_apply(sd, x, base.clone(), s),
                rtol=1e-5, atol=1e-5,
            )  # fmt: skip


@pytest.mark.parametrize("which", list(SETTINGS))
def test_the_file_read_back_gives_peft_the_same_adapter(which):
    m = _adapted(SETTINGS[which])
    sd = _kohya(m)
    layers, alphas = kohya.from_kohya(sd, {"transformer": {t: t for t in TARGETS}}, prefixes=kohya.PREFIXES)
    fresh = _adapted(SETTINGS[which], seed=7)  # another adapter of the same shapes
    files.load_into(fresh, "transformer", layers["transformer"], alphas["transformer"], adapter_metadata(fresh),
                    files.Path("x.safetensors"))  # fmt: skip
    want, got = _merged(m), _merged(fresh)
    for name in TARGETS:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


FUSED = {"transformer": {"qkv": ((("to_q", 36), ("to_k", 36), ("to_v", 36)), False)}}


@pytest.mark.parametrize("which", ["lora", "dora", "loha"])
def test_fused_qkv_holds_loha_and_dora_exactly(which):
    """Flux's and Z-Image's kohya names fuse q, k and v: the fused layer applied by ComfyUI to the fused weight gives
    each member's peft weight in its rows, and reading it back splits it into the members' adapters again."""
    m = _adapted(SETTINGS[which])
    want = _merged(m)
    sd = _kohya(m, fused=FUSED)
    assert not [k for k in sd if "to_q" in k]
    base = torch.cat([getattr(m, t).get_base_layer().weight.detach() for t in ("to_q", "to_k", "to_v")])
    got = comfy_apply(sd, "lora_transformer_qkv", base.clone())
    torch.testing.assert_close(got, torch.cat([want[t] for t in ("to_q", "to_k", "to_v")]), rtol=1e-5, atol=1e-5)
    layers, alphas = kohya.from_kohya(sd, {"transformer": {t: t for t in TARGETS}}, FUSED, prefixes=kohya.PREFIXES)
    fresh = _adapted(SETTINGS[which], seed=7)
    files.load_into(fresh, "transformer", layers["transformer"], alphas["transformer"], adapter_metadata(fresh),
                    files.Path("x.safetensors"))  # fmt: skip
    back = _merged(fresh)
    for t in TARGETS:
        torch.testing.assert_close(back[t], want[t], rtol=1e-5, atol=1e-5)


def test_fused_qkv_refuses_lokr_and_a_partial_dora_with_the_reason():
    with pytest.raises(ValueError, match="rows of several Kronecker products are no Kronecker product"):
        _kohya(_adapted(SETTINGS["lokr"]), fused=FUSED)
    m = Toy()
    add_lora(m, LoraConfig(rank=4, use_dora=True), ["to_q", "to_k"])
    layers, meta = export_layers(m), adapter_metadata(m)
    with pytest.raises(ValueError, match="DoRA on to_q, to_k without to_v"):
        kohya.to_kohya({"transformer": layers}, {"transformer": {t: t for t in TARGETS}},
                       {"transformer": files.alphas(meta, layers)}, FUSED, kohya.PREFIXES)  # fmt: skip


def test_the_settings_that_contradict_or_peft_lacks_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="peft's LoHa and LoKr have no weight decomposition"):
        LoraConfig(type="loha", use_dora=True)
    with pytest.raises(ValueError, match=r"only apply to lora\.type: lokr"):
        LoraConfig(type="loha", factor=4)
    with pytest.raises(ValueError, match="contradict"):
        LoraConfig(type="lokr", full_matrix=True, decompose_both=True)
    with pytest.raises(ValueError, match="no input dropout"):
        LoraConfig(type="lokr", dropout=0.1)
    with pytest.raises(ValueError, match=r"strided tensor that torch\.kron refuses"):
        LoraConfig(type="lokr", use_tucker=True)
    with pytest.raises(ValueError, match="peft's LoRA has no rank or module dropout"):
        LoraConfig(rank_dropout=0.1)
    assert LoraConfig(use_dora=True).plain is False and LoraConfig().plain is True
    cfg = peft_config(Toy(), LoraConfig(type="lokr", rank_dropout=0.2, module_dropout=0.1, factor=4), TARGETS)
    assert (cfg.rank_dropout, cfg.module_dropout, cfg.decompose_factor) == (0.2, 0.1, 4)


def test_adapters_over_weights_peft_cannot_read_are_refused_with_the_reason():
    from difftrain.config.load import resolve
    from difftrain.errors import ConfigError

    def cfg(*sets):
        return resolve(recipe="tiny-sdxl-lora", sets=["model.path=/nowhere", *sets]).config

    with pytest.raises(ConfigError, match="DoRA divides by the norm of each row"):
        cfg("lora.use_dora=true", "memory.weights.kind=fp8")
    with pytest.raises(ConfigError, match="have no bitsandbytes layers"):
        cfg("lora.type=loha", "memory.weights.kind=nf4")
    assert cfg("lora.type=lokr", "memory.weights.kind=fp8").lora.type == "lokr"  # peft's LoKr runs over fp8 layers
