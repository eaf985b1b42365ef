"""memory.activations.split for Wan (families/wan/segments.py): a block run as checkpointed segments, its
feed-forward over token chunks, computes what diffusers' own block computes - output and every LoRA gradient - for
the per-sample modulation of 2.1 / 2.2 14B and the per-token one of TI2V, with and without the chunks."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from peft import LoraConfig, inject_adapter_in_model

from difftrain.families.wan.segments import split_blocks


def _block(seed: int, i2v: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    b = WanTransformerBlock(
        dim=32, ffn_dim=80, num_heads=2, cross_attn_norm=True, added_kv_proj_dim=32 if i2v else None
    )
    b.requires_grad_(False)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"],
                     init_lora_weights="gaussian")  # fmt: skip
    b = inject_adapter_in_model(cfg, b)
    for n, p in b.named_parameters():
        if "lora_B" in n:  # peft starts B at zero: A's gradients would be zero whatever the forward did
            torch.nn.init.normal_(p, std=0.1)
    return b


@pytest.mark.parametrize(
    "per_token,i2v", [(False, False), (True, False), (False, True)], ids=["per-sample", "per-token (TI2V)", "I2V"]
)
@pytest.mark.parametrize("chunk", [8192, 7], ids=["one chunk", "chunks of 7 tokens"])
def test_segmented_block_equals_diffusers_block(per_token, i2v, chunk):
    tokens = 30
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, tokens, 32, generator=g, requires_grad=True)
    # I2V: the image's tokens before the 512 text tokens (WanAttnProcessor splits them so)
    text = torch.randn(2, 512 + 5 if i2v else 12, 32, generator=g)
    temb = torch.randn(2, tokens, 6, 32, generator=g) if per_token else torch.randn(2, 6, 32, generator=g)
    cos, sin = torch.randn(1, tokens, 1, 16, generator=g), torch.randn(1, tokens, 1, 16, generator=g)
    plain = _block(0, i2v)
    seg = copy.deepcopy(plain)
    assert split_blocks([seg], chunk_tokens=chunk) == 1
    results = []
    for b in (plain, seg):
        x.grad = None
        out = b(x, text, temb, (cos, sin))
        (out.square() * torch.arange(tokens).view(1, -1, 1)).mean().backward()  # every token weighs differently
        grads = {n: p.grad for n, p in b.named_parameters() if p.requires_grad}
        results.append((out.detach(), x.grad.clone(), grads))
    (o1, x1, g1), (o2, x2, g2) = results
    assert len(g1) == 20 and set(g1) == set(g2)  # A and B of 4 Linears in each attention and 2 in the FFN
    assert all(g.abs().sum() > 0 for g in g1.values())
    torch.testing.assert_close(o2, o1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x2, x1, rtol=1e-5, atol=1e-6)
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-6, msg=k)
    with torch.no_grad():  # no autograd: the segments run plainly
        torch.testing.assert_close(seg(x, text, temb, (cos, sin)), o1, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_compiled_segmented_block_under_offloaded_checkpointing_equals_the_eager_block():
    """As the recipes run it: the segmented block compiled (its checkpoints traced inside the compiled region) and
    checkpointed by memory.activations.offload around it, against diffusers' block eager (inductor on CPU)."""
    from difftrain.memory.activation_offload import offloaded_checkpoint

    plain = _block(0)
    seg = copy.deepcopy(plain)
    split_blocks([seg], chunk_tokens=7)
    seg.compile()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 30, 32, generator=g, requires_grad=True)
    args = (torch.randn(2, 12, 32, generator=g), torch.randn(2, 6, 32, generator=g),
            (torch.randn(1, 30, 1, 16, generator=g), torch.randn(1, 30, 1, 16, generator=g)))  # fmt: skip
    results = []
    for b in (plain, seg):
        out = offloaded_checkpoint(b, x, *args)
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in b.named_parameters() if p.requires_grad}))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    assert set(g1) == set(g2) and len(g1) == 20
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-4, atol=1e-6, msg=k)
