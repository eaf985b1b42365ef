"""Z-Image's attention with its rotary embedding in real arithmetic.

diffusers' ``ZSingleStreamAttnProcessor`` rotates q and k as complex numbers (``view_as_complex``, a complex
multiply, ``view_as_real``). torch.compile's inductor does not generate code for complex operators ("Torchinductor
does not support code generation for complex operators. Performance may be worse than eager."): each of those runs
as its own eager kernel between the compiled ones, in every block's forward, recomputed forward and backward. Here
the same rotation is written with the real and imaginary parts apart: the same products and sums the complex
multiply computes ((a + bi)(c + di) = (ac - bd) + (ad + bc)i), in float32 as diffusers does, which inductor fuses.
The rest of the call is diffusers' own (its attention dispatch, so ``set_attention_backend`` still applies).
"""

from __future__ import annotations

import functools

import torch


def rotate(x_in: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x_in [B, S, H, D] rotated by freqs_cis [B, S, D/2] (complex), as diffusers' ``apply_rotary_emb`` in its Z-Image
    processor: pairs (x[2i], x[2i+1]) are the complex numbers multiplied, in float32, returned in x_in's dtype."""
    with torch.autocast(x_in.device.type, enabled=False):
        x = x_in.float().unflatten(-1, (-1, 2))
        f = torch.view_as_real(freqs_cis).unsqueeze(2)  # [B, S, 1, D/2, 2]: a view, no complex arithmetic
        a, b = x[..., 0], x[..., 1]
        c, d = f[..., 0], f[..., 1]
        return torch.stack((a * c - b * d, a * d + b * c), dim=-1).flatten(3).type_as(x_in)


def real_rope_processor():
    """A processor of the installed diffusers' Z-Image attention with :func:`rotate` as its rotary embedding."""
    return _processor_class()()


@functools.cache
def _processor_class() -> type:
    """The processor's class, made once (diffusers is imported late): torch.compile guards on the processor's type,
    so a class made per attention was a type of its own in every block, and each of Z-Image's 34 blocks compiled
    again (34 graphs, 304 s before the first step on an H200, 2026-11-28) where one graph serves them all."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    class RealRopeZImageAttnProcessor(ZSingleStreamAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
            query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
            key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
            value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
            if attn.norm_q is not None:
                query = attn.norm_q(query)
            if attn.norm_k is not None:
                key = attn.norm_k(key)
            if freqs_cis is not None:
                query, key = rotate(query, freqs_cis), rotate(key, freqs_cis)
            dtype = query.dtype
            if attention_mask is not None and attention_mask.ndim == 2:
                attention_mask = attention_mask[:, None, None, :]
            hidden_states = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            output = attn.to_out[0](hidden_states.flatten(2, 3).to(dtype))
            if len(attn.to_out) > 1:  # dropout
                output = attn.to_out[1](output)
            return output

    return RealRopeZImageAttnProcessor


def use_real_rope(transformer: torch.nn.Module) -> int:
    """Every Z-Image attention of ``transformer`` given the real-arithmetic processor (its backend kept); the count.
    An attention whose processor is not diffusers' Z-Image one (a later diffusers' own) is left as it is."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    n = 0
    for m in transformer.modules():
        if isinstance(m, Attention) and type(m.processor) is ZSingleStreamAttnProcessor:
            new = real_rope_processor()
            new._attention_backend, new._parallel_config = m.processor._attention_backend, m.processor._parallel_config
            m.set_processor(new)
            n += 1
    return n
