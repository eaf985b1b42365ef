"""Block swap on CPU: evicted weights are poisoned (empty), so any use while evicted raises;
gradients must equal the run without block swap bit for bit."""

from __future__ import annotations

import pytest
import torch

from difftrain.config.schema import LoraConfig
from difftrain.families.sdxl import SDXL
from difftrain.lora.adapters import add_lora
from difftrain.memory.activation_offload import offloaded_checkpoint
from difftrain.memory.block_swap import BlockSwap


def _unet(tiny_model, lora: bool):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet").requires_grad_(False)
    if lora:
        torch.manual_seed(0)
        add_lora(unet, LoraConfig(rank=4), SDXL.default_lora_targets)
    else:
        unet.requires_grad_(True)
    return unet


def _step(unet, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cfg = unet.config
    x = torch.randn(2, cfg.in_channels, 16, 16, generator=g)
    emb = torch.randn(2, 77, cfg.cross_attention_dim, generator=g)
    n_time = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    added = {"text_embeds": torch.randn(2, n_time, generator=g), "time_ids": torch.rand(2, 6, generator=g) * 64}
    out = unet(x, torch.tensor([10, 500]), encoder_hidden_states=emb, added_cond_kwargs=added).sample
    loss = out.pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in unet.named_parameters() if p.grad is not None}


def _checkpointed(unet, checkpointing) -> None:
    """torch's checkpoint (the forward runs with autograd), or the offloaded one (memory.activations.offload: the
    forward runs without it, so block swap's hooks see each block first in backward's recompute)."""
    if checkpointing == "offloaded":
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=offloaded_checkpoint)
    elif checkpointing:
        unet.enable_gradient_checkpointing()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("checkpointing", [False, True, "offloaded"], ids=["plain", "checkpointing", "offloaded"])
def test_block_swap_gradients_equal_the_plain_run(tiny_model, lora, checkpointing):
    ref = _unet(tiny_model, lora)
    _checkpointed(ref, checkpointing)
    ref_loss, ref_grads = _step(ref)

    unet = _unet(tiny_model, lora)
    _checkpointed(unet, checkpointing)
    units = SDXL().swap_blocks(unet)
    swap = BlockSwap(unet, units, blocks_to_swap=len(units) - 2, device="cpu", swap_trainable=not lora, poison=True)
    assert len(swap.swapped) == len(units) - 2
    # evicted: the swapped weights are empty until a forward needs them
    assert all(p.numel() == 0 for i in swap.swapped for p in swap.params[i])
    loss, grads = _step(unet)
    swap.end_backward()
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and grads
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n
    # after the step every swapped unit is home again; at most prefetch + 1 were ever on the device (with the
    # offloaded checkpoint, each unit recomputed in backward had stayed until the step's end: 30 of Wan 14B's
    # swapped blocks, 9.8 GiB, on the GPU at once; benchmarks/memory_phases.py, 2026-11-27)
    assert not swap.resident
    assert swap.peak_resident == 2
    assert all(p.numel() == 0 for i in swap.swapped for p in swap.params[i])
    # and a second step works the same
    unet.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    assert torch.equal(_step(unet, seed=1)[0], _step(ref, seed=1)[0])


def test_block_swap_picks_the_largest_units_and_keeps_lora_resident(tiny_model):
    unet = _unet(tiny_model, lora=True)
    units = SDXL().swap_blocks(unet)
    sizes = [sum(p.numel() for p in u.parameters() if not p.requires_grad) for u in units]
    swap = BlockSwap(unet, units, blocks_to_swap=3, device="cpu", poison=True)
    assert sorted(sizes[i] for i in swap.swapped) == sorted(sizes)[-3:]
    for i in swap.swapped:
        assert all(p.requires_grad is False for p in swap.params[i])
        lora = [p for p in units[i].parameters() if p.requires_grad]
        assert all(p.numel() > 0 for p in lora)  # LoRA weights never leave
    swap.remove()


def test_a_weight_used_while_evicted_fails_loudly(tiny_model):
    unet = _unet(tiny_model, lora=True)
    units = SDXL().swap_blocks(unet)
    swap = BlockSwap(unet, units, blocks_to_swap=1, device="cpu", poison=True)
    swap.remove()  # hooks gone, weights still evicted
    with pytest.raises(RuntimeError):
        _step(unet)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_fixed_slots_put_each_block_at_the_same_addresses_every_time(tiny_model, lora, checkpointing, prefetch):
    """With CUDA graphs (``fixed``) each swapped block lands in its own slot's views on every fetch (forward,
    backward, the checkpoint's recompute, the next step): a recorded graph reads the addresses it recorded. The
    gradients stay those of the run without block swap, bit for bit."""
    ref = _unet(tiny_model, lora)
    unet = _unet(tiny_model, lora)
    if checkpointing:
        ref.enable_gradient_checkpointing()
        unet.enable_gradient_checkpointing()
    units = SDXL().swap_blocks(unet)
    swap = BlockSwap(
        unet, units, len(units) - 2, device="cpu", prefetch=prefetch, swap_trainable=not lora, poison=True, fixed=True
    )
    assert len(swap.slots) == prefetch + 2
    largest = max(sum(-(-h.numel() * h.element_size() // 256) * 256 for h in swap.home[i]) for i in swap.swapped)
    assert swap.slot_bytes == (prefetch + 2) * largest
    seen: dict[int, set[tuple[int, ...]]] = {}

    def record(i):
        def hook(module, args):  # after block swap's own pre-hook (registered first): the block is resident
            seen.setdefault(i, set()).add(tuple(p.data_ptr() for p in swap.params[i]))

        return hook

    for i in swap.swapped:
        units[i].register_forward_pre_hook(record(i))
    for seed in (0, 1):
        ref.zero_grad(set_to_none=True)
        unet.zero_grad(set_to_none=True)
        ref_loss, ref_grads = _step(ref, seed)
        loss, grads = _step(unet, seed)
        swap.end_backward()
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys() and grads
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
        assert not swap.resident
    assert seen.keys() == set(swap.swapped)
    for i in swap.swapped:  # one set of addresses per block, its slot's views
        assert seen[i] == {tuple(v.data_ptr() for v in swap.slot_views[i])}, i
    # neighbours in the swap order never share a slot, so the hooks' order never evicts a block in use
    assert swap.slot_conflicts == 0
    assert swap.peak_resident <= prefetch + 1
