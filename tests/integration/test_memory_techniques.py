"""Each memory technique, on the tiny SDXL, against the plain run (stated tolerances)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_sets
from difftrain.config.load import resolve
from difftrain.errors import ConfigError
from difftrain.precompute.run import precompute
from difftrain.trainers.loop import Trainer, train

STEPS = 12


def _cfg(tiny_model, data, out, cache, *sets):
    base = tiny_sets(
        tiny_model,
        data,
        out,
        **{
            "train.max_steps": STEPS,
            "train.batch_size": 4,
            "train.checkpoint_every": 1000,
            "data.cache_dir": cache,
            "save.formats": "[]",
        },
    )
    return resolve(recipe="tiny-sdxl-lora", sets=base + list(sets)).config


@pytest.fixture(scope="module")
def runs(tiny_model, _dataset_master, tmp_path_factory):
    """Reference runs: plain bf16 LoRA and plain fp32 full fine-tune, cached once for the module."""
    root = tmp_path_factory.mktemp("mem")
    cache = root / "cache"
    done: dict = {}

    def run(name, *sets):
        if (name, sets) not in done:  # each run folder holds one run
            cfg = _cfg(tiny_model, _dataset_master, root / name, cache, *sets)
            precompute(cfg)
            t = Trainer(cfg)
            done[name, sets] = (t, t.run())
        return done[name, sets]

    return run


LORA_BF16 = ("memory.weights.kind=bf16", "train.mixed_precision=bf16")
FULL = ("train.method=full", "memory.weights.kind=fp32", "train.max_grad_norm=null", "train.learning_rate=1e-4")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,sets,tol",
    [
        ("fp8-tensor", ("memory.weights={kind: fp8}", "train.mixed_precision=bf16"), 0.05),
        ("fp8-channel", ("memory.weights={kind: fp8, scale: channel}", "train.mixed_precision=bf16"), 0.05),
        ("checkpoint-every-2", (*LORA_BF16, "memory.activations={kind: checkpoint, every: 2}"), 0.02),
        ("checkpoint-all", (*LORA_BF16, "memory.activations={kind: checkpoint}"), 0.02),
    ],
)
def test_lora_technique_tracks_plain_bf16(runs, name, sets, tol):
    _, ref = runs("lora-bf16", *LORA_BF16)
    t, r = runs(name, *sets)
    assert r.losses == pytest.approx(ref.losses, rel=tol)
    if name.startswith("fp8"):
        unet = t.parts.comps["unet"]
        n8 = sum(p.numel() for p in unet.parameters() if p.dtype == torch.float8_e4m3fn)
        frozen = sum(p.numel() for p in unet.parameters() if not p.requires_grad)
        assert n8 > 0.9 * frozen  # nearly all frozen weights are fp8
        assert unet.conv_in.weight.dtype == torch.bfloat16  # the family's high-precision layers stay


@pytest.mark.slow
@pytest.mark.parametrize(
    "ref_name,ref_sets",
    [
        ("checkpoint-all", (*LORA_BF16, "memory.activations={kind: checkpoint}")),
        (
            "fp8-checkpoint",
            ("memory.weights={kind: fp8}", "train.mixed_precision=bf16", "memory.activations={kind: checkpoint}"),
        ),
    ],
)
def test_block_swap_changes_nothing_but_where_weights_live(runs, ref_name, ref_sets):
    _, ref = runs(ref_name, *ref_sets)
    t, r = runs(ref_name + "-swap", *ref_sets, "memory.offload={kind: block_swap, blocks_to_swap: 6}")
    assert r.losses == ref.losses  # the same arithmetic, only copies in between
    swap = t.parts.block_swap
    assert len(swap.swapped) == 6 and not swap.resident  # all swapped blocks back home after the run
    assert all(p.device.type == "cpu" for i in swap.swapped for p in swap.params[i])
    lora = [p for p in t.parts.comps["unet"].parameters() if p.requires_grad]
    assert lora and all(p.dtype == torch.float32 for p in lora)


@pytest.mark.slow
def test_checkpoint_every_k_checkpoints_fewer_blocks(runs):
    t_all, _ = runs("checkpoint-all", *LORA_BF16, "memory.activations={kind: checkpoint}")
    t_two, _ = runs("checkpoint-every-2", *LORA_BF16, "memory.activations={kind: checkpoint, every: 2}")
    flags = lambda t: [
        m.gradient_checkpointing
        for m in t.parts.comps["unet"].modules()
        if m is not t.parts.comps["unet"] and hasattr(m, "gradient_checkpointing")
    ]
    assert all(flags(t_all)) and 0 < sum(flags(t_two)) < len(flags(t_two))


@pytest.mark.slow
def test_fused_backward_equals_plain_full_finetune(runs):
    _, plain = runs("full-plain", *FULL)
    t, fused = runs("full-fused", *FULL, "memory.fused_backward=true")
    assert type(t.parts.optimizer).__name__ == "FusedBackward"
    assert fused.losses == pytest.approx(plain.losses, rel=1e-5)
    assert all(p.grad is None for p in t.parts.params)  # gradients were freed inside backward


@pytest.mark.slow
@pytest.mark.parametrize("fixed", [False, True], ids=["fresh-buffers", "fixed-slots"])
def test_block_swap_with_fused_adafactor_steps_swapped_weights_and_writes_them_home(runs, monkeypatch, fixed):
    """Full fine-tune, block swap + fused backward + Adafactor (sdxl-full-8gb's plan): the swapped units' weights are
    stepped while resident and copied home, so the run is the one without block swap, weight for weight. With fixed
    slots (what CUDA graphs get; asked for directly, as nothing records graphs on the CPU) each unit is also written
    home before another takes its slot."""
    if fixed:
        from difftrain.memory import plan
        from difftrain.trainers import setup

        real = plan.apply_offload
        monkeypatch.setattr(setup, "apply_offload", lambda *a, **k: real(*a, **{**k, "fixed": True}))
    sets = (
        *FULL,
        "memory.fused_backward=true",
        "memory.optimizer.kind=adafactor",
        "memory.activations.kind=checkpoint",
    )
    t0, ref = runs("full-fused-adafactor", *sets)
    swapped_run = "full-fused-adafactor-swap" + "-fixed" * fixed
    t1, r = runs(swapped_run, *sets, "memory.offload={kind: block_swap, blocks_to_swap: 6}")
    swap = t1.parts.block_swap
    assert swap.write_back and len(swap.swapped) == 6 and not swap.resident
    assert len(swap.slots) == 3 * fixed and swap.slot_conflicts == 0
    assert r.losses == ref.losses
    w0 = dict(t0.parts.comps["unet"].named_parameters())
    w1 = dict(t1.parts.comps["unet"].named_parameters())
    swapped = {id(p) for i in swap.swapped for p in swap.params[i]}
    assert any(id(p) in swapped and p.device.type == "cpu" for p in w1.values())
    for n, p in w1.items():
        assert torch.equal(p.detach(), w0[n].detach()), n


SWAP_ADAFACTOR = (
    "memory.optimizer.kind=adafactor",
    "memory.activations.kind=checkpoint",
    "memory.offload={kind: block_swap, blocks_to_swap: 6}",
)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), SWAP_ADAFACTOR], ids=["adamw", "adafactor-block-swap"])
def test_fused_backward_resumes_exactly(tiny_model, dataset, tmp_path, extra):
    sets = (*FULL, "memory.fused_backward=true", "memory.weights.kind=bf16", "train.mixed_precision=bf16", *extra)
    a = _cfg(tiny_model, dataset, tmp_path / "a", tmp_path / "cache", *sets, "train.max_steps=6")
    precompute(a)
    ref = train(a)
    b = _cfg(
        tiny_model, dataset, tmp_path / "b", tmp_path / "cache", *sets, "train.max_steps=6", "train.checkpoint_every=3"
    )
    train(b, stop_at=3)
    assert train(b, resume="latest").losses == pytest.approx(ref.losses[3:], rel=1e-6)


@pytest.mark.parametrize(
    "sets,needle",
    [
        (("train.method=full", "memory.weights={kind: fp8}"), "fp8 rounds a weight once"),
        (("train.method=full", "memory.weights={kind: nf4}"), "nf4 rounds a weight once"),
        (
            ("train.method=full", "memory.fused_backward=true", "train.grad_accum=2", "train.max_grad_norm=null"),
            "cannot accumulate",
        ),
        (("train.method=full", "memory.fused_backward=true"), "set train.max_grad_norm: null"),
        (
            (
                "train.method=full",
                "memory.fused_backward=true",
                "train.max_grad_norm=null",
                "train.mixed_precision=fp16",
                "memory.weights.kind=fp32",
            ),
            "fp16 overflow",
        ),
        (("memory.fused_backward=true",), "for train.method full"),
        (("memory.optimizer.kind=cpu_offload",), "does not clip gradients"),
        (("memory.offload={kind: block_swap, blocks_to_swap: 4}",), "set memory.activations.kind: checkpoint"),
        (
            (
                "memory.offload={kind: block_swap, blocks_to_swap: 4}",
                "memory.activations.kind=checkpoint",
                "memory.weights={kind: nf4}",
            ),
            "block_swap with memory.weights nf4",
        ),
        (
            (
                "memory.offload={kind: block_swap, blocks_to_swap: 4}",
                "memory.activations.kind=checkpoint",
                "train.method=full",
            ),
            "optimizer must step there",
        ),
        (
            (
                "memory.offload={kind: block_swap, blocks_to_swap: 4}",
                "memory.activations.kind=checkpoint",
                "train.method=full",
                "memory.fused_backward=true",
                "train.max_grad_norm=null",
            ),
            "memory.fused_backward: true with memory.optimizer.kind: adafactor",
        ),
        (
            (
                "memory.optimizer={kind: cpu_offload, offload_gradients: true}",
                "train.max_grad_norm=null",
                "train.grad_accum=2",
            ),
            "cannot accumulate",
        ),
    ],
)
def test_incompatible_pairs_name_both_options(sets, needle):
    with pytest.raises(ConfigError) as e:
        resolve(recipe="tiny-sdxl-lora", sets=list(sets))
    assert needle in str(e.value)


def test_bitsandbytes_weights_need_cuda(tiny_model, dataset, tmp_path):
    from difftrain.errors import BackendUnavailable

    cfg = _cfg(tiny_model, dataset, tmp_path, tmp_path / "cache", "memory.weights={kind: nf4}", "train.device=cpu")
    precompute(cfg)
    with pytest.raises(BackendUnavailable) as e:
        train(cfg)
    assert "fp8" in e.value.hint  # names what works here


@pytest.mark.slow
def test_fp8_matmul_trains_the_tiny_flux_close_to_the_dequantized_fp8_base(_dataset_master, tmp_path):
    """speed.fp8_matmul through the trainer: every fp8 Linear of the denoiser whose sizes allow it computes as fp8
    matmuls (the trainer sets them after storing the weights), and the LoRA run tracks the one without it."""
    from difftrain.families.registry import get_family
    from difftrain.memory.fp8 import Fp8Linear

    model = get_family("flux").build_tiny(tmp_path / "model", seed=0)
    losses, fast = {}, []
    for name, extra in (("fp8", {}), ("fp8-mm", {"speed.fp8_matmul": "true"})):
        sets = {"memory.weights": "{kind: fp8}", "train.max_steps": 3, "report.to": "[]", "save.formats": "[]",
                "data.cache_dir": tmp_path / "cache", "train.mixed_precision": "bf16", **extra}  # fmt: skip
        cfg = resolve(recipe="tiny-flux-lora", sets=tiny_sets(model, _dataset_master, tmp_path / name, **sets)).config
        precompute(cfg)
        t = Trainer(cfg)
        losses[name] = t.run().losses
        fast = [m.fp8_matmul for m in t.parts.comps["transformer"].modules() if isinstance(m, Fp8Linear)]
    assert sum(fast) > 20
    assert losses["fp8-mm"] == pytest.approx(losses["fp8"], rel=0.02) and losses["fp8-mm"] != losses["fp8"]
