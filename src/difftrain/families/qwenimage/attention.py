"""Qwen-Image's attention with its rotary embedding in real arithmetic.

diffusers' ``QwenDoubleStreamAttnProcessor2_0`` rotates the image's and the text's q and k through
``apply_rotary_emb_qwen(..., use_real=False)``: as complex numbers (``view_as_complex``, a complex multiply,
``view_as_real``), which torch.compile's inductor does not generate code for (each runs as its own eager kernel, in
every block's forward, recomputed forward and backward). ``rotate`` is the same rotation with the real and
imaginary parts apart: the products and sums the complex multiply computes ((a + bi)(c + di) = (ac - bd) +
(ad + bc)i), in float32, which inductor fuses.

The processor is diffusers' own ``__call__`` with ``rotate`` where it looks up ``apply_rotary_emb_qwen``: the same
code object given a copy of its module's globals with that one name replaced. Nothing of diffusers is patched (other
users of the module see its function), no copy of its hundred lines is kept here to drift from it, and a diffusers
whose processor no longer names the function is left as it is.
"""

from __future__ import annotations

import types

import torch

ROPE_NAME = "apply_rotary_emb_qwen"


def rotate(x: torch.Tensor, freqs_cis, use_real: bool = True, use_real_unbind_dim: int = -1) -> torch.Tensor:
    """``apply_rotary_emb_qwen`` with its complex branch (use_real=False: x [B, S, H, D], freqs_cis [S, D/2]
    complex) in real arithmetic; its real branch is diffusers' own."""
    if use_real:
        from diffusers.models.transformers import transformer_qwenimage

        return getattr(transformer_qwenimage, ROPE_NAME)(x, freqs_cis, use_real, use_real_unbind_dim)
    xf = x.float().unflatten(-1, (-1, 2))
    f = torch.view_as_real(freqs_cis).unsqueeze(1)  # [S, 1, D/2, 2]: a view, no complex arithmetic
    a, b = xf[..., 0], xf[..., 1]
    c, d = f[..., 0], f[..., 1]
    return torch.stack((a * c - b * d, a * d + b * c), dim=-1).flatten(3).type_as(x)


def real_rope_class(cls: type) -> type | None:
    """A subclass of the processor class ``cls`` whose ``__call__`` calls :func:`rotate` for the rotary embedding;
    None where its ``__call__`` does not name ``apply_rotary_emb_qwen``."""
    call = cls.__call__
    code = getattr(call, "__code__", None)
    if code is None or ROPE_NAME not in code.co_names:
        return None
    scope = {**call.__globals__, ROPE_NAME: rotate}
    ours = types.FunctionType(code, scope, call.__name__, call.__defaults__, call.__closure__)
    ours.__kwdefaults__ = call.__kwdefaults__
    ours.__doc__ = call.__doc__
    return type(f"RealRope{cls.__name__}", (cls,), {"__call__": ours, "__module__": __name__})


def use_real_rope(transformer: torch.nn.Module) -> int:
    """Every attention of ``transformer`` whose processor is diffusers' Qwen-Image one given the real-arithmetic
    version (its attention backend kept); the count."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    made = real_rope_class(QwenDoubleStreamAttnProcessor2_0)
    if made is None:
        return 0
    n = 0
    for m in transformer.modules():
        proc = getattr(m, "processor", None)
        set_processor = getattr(m, "set_processor", None)
        if type(proc) is QwenDoubleStreamAttnProcessor2_0 and callable(set_processor):
            new = made()
            new.__dict__.update(proc.__dict__)  # what diffusers set on it (set_attention_backend's backend)
            set_processor(new)
            n += 1
    return n
