"""memory.activations.split for Wan: each block run as checkpointed segments, the feed-forward over chunks of tokens.

Why our own forward: diffusers' ``WanTransformerBlock.forward`` computes its norms, modulation and residuals in fp32
between the attentions and the feed-forward. Checkpointing only the submodules (attn1, attn2, ffn: the generic
``memory.plan.split_checkpoints``) leaves those fp32 tensors saved for the whole recomputed block: measured on an
H200 (docs/benchmarks.md, "Wan 2.1 / 2.2"), a 1.3B block at 81 frames of 480x832 still peaked at 3.3 GiB, the
14B's at 8.0 GiB. Here each segment takes the norm, the modulation and the residual with it, so a block recomputed
in backward keeps only the segments' bf16 inputs, and the feed-forward (13 824 wide for the 14B) runs over token
chunks checkpointed one by one. The arithmetic is diffusers' block's, line for line (tested against it on CPU);
only what is kept for backward changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

#: tokens per feed-forward chunk: at 8 192 tokens the 14B's 13 824-wide hidden layer is 0.21 GiB in bf16
FFN_CHUNK_TOKENS = 8192


def _modulation(block, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The six shift/scale/gate tensors, as diffusers' block computes them (2.1 / 2.2 14B: one per sample; TI2V:
    one per token)."""
    if temb.ndim == 4:
        mods = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple(m.squeeze(2) for m in mods)
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _tokens(m: torch.Tensor, sl: slice) -> torch.Tensor:
    """A per-token modulation's slice of tokens (TI2V); a per-sample one as it is."""
    return m[:, sl] if m.ndim == 3 and m.shape[1] > 1 else m


def _self_attention(block, h, temb, rotary_emb):
    shift, scale, gate, *_ = _modulation(block, temb)
    n = (block.norm1(h.float()) * (1 + scale) + shift).type_as(h)
    a = block.attn1(n, None, None, rotary_emb)
    return (h.float() + a * gate).type_as(h)


def _cross_attention(block, h, encoder_hidden_states):
    n = block.norm2(h.float()).type_as(h)
    return h + block.attn2(n, encoder_hidden_states, None, None)


def _feed_forward(block, h, temb, start: int, stop: int):
    *_, c_shift, c_scale, c_gate = _modulation(block, temb)
    sl = slice(start, stop)
    x = h[:, sl]
    n = (block.norm3(x.float()) * (1 + _tokens(c_scale, sl)) + _tokens(c_shift, sl)).type_as(h)
    return (x.float() + block.ffn(n).float() * _tokens(c_gate, sl)).type_as(h)


def segmented_forward(block, chunk_tokens: int = FFN_CHUNK_TOKENS) -> Callable[..., torch.Tensor]:
    """A forward for ``block`` (a diffusers WanTransformerBlock) equal to its own, checkpointed in segments while
    autograd records (in the block's recompute under checkpointing); without grad it runs the segments plainly."""

    def forward(hidden_states, encoder_hidden_states, temb, rotary_emb):
        grad = torch.is_grad_enabled()

        def run(fn, *args):
            return checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)

        h = run(_self_attention, block, hidden_states, temb, rotary_emb)
        h = run(_cross_attention, block, h, encoder_hidden_states)
        n = h.shape[1]
        k = max(1, math.ceil(n / chunk_tokens))
        step = math.ceil(n / k)
        outs = [run(_feed_forward, block, h, temb, i, min(i + step, n)) for i in range(0, n, step)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    return forward


def split_blocks(blocks: list[torch.nn.Module], chunk_tokens: int = FFN_CHUNK_TOKENS) -> int:
    """Give each block the segmented forward; returns how many blocks took it."""
    for block in blocks:
        block.forward = segmented_forward(block, chunk_tokens)
    return len(blocks)
