"""Gradient checkpointing that keeps the attentions' outputs (memory.activations.save_attention).

Plain checkpointing keeps a block's input and runs its whole forward again in backward. At the token counts of video
(Wan at 81 frames of 480x832: 32 760 tokens) the attention is most of that forward's time (Wan 1.3B: about 70 % of
its FLOPs), while its output is one tensor of the block's width. Here the attention ops' outputs (and the log-sum-exp
their backward reads) are kept, and the rest of the block is recomputed: the recompute skips the attentions for one
more tensor of the block input's size per attention call. Attentions over few keys (a cross-attention to the
caption) cost little to recompute and are recomputed. torchtitan's "selective" activation checkpointing does
this by op; torch provides the mechanism (torch.utils.checkpoint.create_selective_checkpoint_contexts, which
torch.compile traces too), the policy of which ops is ours.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

#: the attention kernels SDPA dispatches to (CUDA: flash, memory-efficient, cuDNN; the CPU's flash), and difftrain's
#: FlashAttention-4 forward (speed/fa4.py)
_ATEN = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


#: an attention over fewer keys than this is recomputed: its cost (queries x keys) is small against its output's
#: bytes (queries): a cross-attention to 512 text tokens (Wan's UMT5) or to 257 image tokens (Wan I2V's CLIP)
MIN_KEYS = 1024


@functools.cache
def attention_ops() -> dict:
    """The attention ops whose outputs are kept (those this torch build has), each with the dimension of its key
    tensor (its second input) that counts the keys: SDPA's kernels take [batch, heads, keys, dim], FA4 [batch, keys,
    heads, dim]."""
    ops = {getattr(torch.ops.aten, name).default: -2 for name in _ATEN if hasattr(torch.ops.aten, name)}
    difftrain_ops = getattr(torch.ops, "difftrain", None)
    if difftrain_ops is not None and hasattr(difftrain_ops, "fa4_forward"):
        ops[difftrain_ops.fa4_forward.default] = 1
    return ops


def keeps(op, args) -> bool:
    """Whether ``op`` called with ``args`` is an attention whose output is kept: one over ``MIN_KEYS`` keys or more."""
    dim = attention_ops().get(op)
    return dim is not None and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].shape[dim] >= MIN_KEYS


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if keeps(op, args) else CheckpointPolicy.PREFER_RECOMPUTE


def save_attention_context():
    """A ``context_fn`` for torch.utils.checkpoint (non-reentrant): the attentions' outputs kept, the rest
    recomputed."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    attention_ops.cache_clear()  # once a block: FA4's op registers when speed.attention takes it, maybe after the last
    return create_selective_checkpoint_contexts(_policy)


def checkpoint_function(save_attention: bool) -> Callable:
    """What a checkpointed block is called through: torch's non-reentrant checkpoint (diffusers' own choice), with
    the attentions' outputs kept where ``save_attention``."""
    from torch.utils.checkpoint import checkpoint

    if save_attention:
        return functools.partial(checkpoint, use_reentrant=False, context_fn=save_attention_context)
    return functools.partial(checkpoint, use_reentrant=False)
