"""memory.activations.split for Wan: each block run as checkpointed segments, over chunks of tokens.

Why our own forward: diffusers' ``WanTransformerBlock.forward`` computes its norms, modulation and residuals in fp32
between the attentions and the feed-forward. Checkpointing only the submodules (attn1, attn2, ffn) left those fp32
tensors saved for the whole recomputed block: measured on an H200 (docs/benchmarks.md, "Wan 2.1 / 2.2"), a 1.3B
block at 81 frames of 480x832 still peaked at 3.3 GiB, the 14B's at 8.0 GiB. Here each segment takes the norm, the
modulation and the residual with it, so a block recomputed in backward keeps only the segments' bf16 inputs, and
every part that is per token runs over chunks of tokens checkpointed one by one: the feed-forward (13 824 wide for
the 14B), the cross-attention (each query attends to the text alone: a chunk of queries is exact), and the
self-attention's projections, RMS norms and rotary embedding, so only the bf16 q, k and v that the attention kernel
takes are whole. The arithmetic is diffusers' block's and WanAttnProcessor's, line for line (tested against them on
CPU); only what is kept for backward changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

#: tokens per chunk: at 8 192 tokens the 14B's 13 824-wide feed-forward layer is 0.21 GiB in bf16
CHUNK_TOKENS = 8192


def _modulation(block, temb: torch.Tensor, sl: slice = slice(None)) -> tuple[torch.Tensor, ...]:
    """The six shift/scale/gate tensors of the tokens ``sl``, as diffusers' block computes them: one per sample
    (2.1 / 2.2 14B) or, from TI2V's per-token ``temb``, one per token of the chunk (its slice taken first: the whole
    sequence's six would be 6 x tokens x width in fp32 for every chunk)."""
    if temb.ndim == 4:
        mods = (block.scale_shift_table.unsqueeze(0) + temb[:, sl].float()).chunk(6, dim=2)
        return tuple(m.squeeze(2) for m in mods)
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _chunks(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    k = max(1, math.ceil(n / chunk_tokens))
    step = math.ceil(n / k)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """WanAttnProcessor's rotary embedding (a function inside its __call__, so not importable)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _qkv(block, h, temb, rotary_emb, start: int, stop: int):
    """q, k and v of a chunk of tokens for the self-attention, as the block and WanAttnProcessor make them."""
    sl = slice(start, stop)
    shift, scale = _modulation(block, temb, sl)[:2]
    x = h[:, sl]
    n = (block.norm1(x.float()) * (1 + scale) + shift).type_as(h)
    attn = block.attn1
    q, k, v = attn.norm_q(attn.to_q(n)), attn.norm_k(attn.to_k(n)), attn.to_v(n)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
    if rotary_emb is not None:
        cos, sin = (f[:, sl] for f in rotary_emb)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return q, k, v


def _attention_out(block, h, o, temb, start: int, stop: int):
    """The self-attention's output projection and gated residual for a chunk of tokens."""
    sl = slice(start, stop)
    gate = _modulation(block, temb, sl)[2]
    a = block.attn1.to_out[1](block.attn1.to_out[0](o[:, sl]))
    return (h[:, sl].float() + a * gate).type_as(h)


def _self_attention(block, h, temb, rotary_emb, chunk_tokens: int):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    run = _runner()
    parts = [run(_qkv, block, h, temb, rotary_emb, a, b) for a, b in _chunks(h.shape[1], chunk_tokens)]
    q, k, v = (_join([p[i] for p in parts]) for i in range(3))
    del parts
    proc = block.attn1.processor
    o = dispatch_attention_fn(
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        backend=proc._attention_backend,
        parallel_config=proc._parallel_config,
    )
    o = o.flatten(2, 3).type_as(q)
    return _join([run(_attention_out, block, h, o, temb, a, b) for a, b in _chunks(h.shape[1], chunk_tokens)])


def _cross_attention(block, h, encoder_hidden_states, start: int, stop: int):
    x = h[:, start:stop]
    n = block.norm2(x.float()).type_as(h)
    return x + block.attn2(n, encoder_hidden_states, None, None)


def _feed_forward(block, h, temb, start: int, stop: int):
    sl = slice(start, stop)
    c_shift, c_scale, c_gate = _modulation(block, temb, sl)[3:]
    x = h[:, sl]
    n = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(h)
    return (x.float() + block.ffn(n).float() * c_gate).type_as(h)


def _runner() -> Callable[..., Any]:
    """Calls a segment checkpointed while autograd records (the block's recompute), plainly otherwise."""
    if torch.is_grad_enabled():
        return lambda fn, *args: checkpoint(fn, *args, use_reentrant=False)
    return lambda fn, *args: fn(*args)


def _whole(block) -> bool:
    """Whether the self-attention is one the chunked path reproduces (diffusers' processor, unfused projections)."""
    a = block.attn1
    return type(a.processor).__name__ != "WanAttnProcessor" or a.fused_projections or a.add_k_proj is not None


def segmented_forward(block, chunk_tokens: int = CHUNK_TOKENS) -> Callable[..., torch.Tensor]:
    """A forward for ``block`` (a diffusers WanTransformerBlock) equal to its own, checkpointed in segments while
    autograd records (in the block's recompute under checkpointing); without grad it runs the segments plainly."""

    def forward(hidden_states, encoder_hidden_states, temb, rotary_emb):
        run = _runner()
        n = hidden_states.shape[1]
        if _whole(block):  # a processor or projections of another kind: the attention as one segment
            h = run(_self_attention_whole, block, hidden_states, temb, rotary_emb)
        else:  # the chunks inside are checkpoints of their own: this one keeps only its input until backward
            h = run(_self_attention, block, hidden_states, temb, rotary_emb, chunk_tokens)
        parts = _chunks(n, chunk_tokens)
        h = _join([run(_cross_attention, block, h, encoder_hidden_states, a, b) for a, b in parts])
        return _join([run(_feed_forward, block, h, temb, a, b) for a, b in parts])

    return forward


def _join(outs: list[torch.Tensor]) -> torch.Tensor:
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _self_attention_whole(block, h, temb, rotary_emb):
    shift, scale, gate, *_ = _modulation(block, temb)
    n = (block.norm1(h.float()) * (1 + scale) + shift).type_as(h)
    a = block.attn1(n, None, None, rotary_emb)
    return (h.float() + a * gate).type_as(h)


def split_blocks(blocks: list[torch.nn.Module], chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Give each block the segmented forward; returns how many blocks took it."""
    for block in blocks:
        block.forward = segmented_forward(block, chunk_tokens)
    return len(blocks)
