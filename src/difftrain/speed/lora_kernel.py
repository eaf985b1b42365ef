"""peft's LoRA Linear with its forward and backward written as few passes over the activations (speed.lora_kernel).

Why our own: peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` op by op, and first casts ``x`` to
the adapter's dtype (fp32 here, where the adapter is trained) for autocast to cast it back. Under torch.compile
each of those ops reads or writes an activation-sized tensor: the casts, the up-projection's output, the scaling,
the sum; in the backward the same again. Where the step is bound by memory traffic (SDXL LoRA at batch 4) that
is a measurable share of the step: peft's adapters cost 0.50 ms of a 1.82 ms SDXL transformer block (batch 4,
1280 channels, compiled, H100; benchmarks/lora_block.py). Here the low-rank path reads ``x`` once for the
down-projection, and the base and the up-projection are one matmul over ``[x, x a^T]`` (the backward's input
gradient likewise), with no casts of the activations. Same weights, names and state dict: only the forward of the
layer changes, so checkpoints, exports and peft's own tools see peft's layer. Anything this does not cover
(several active adapters, dropout, DoRA and other variants, a merged or disabled adapter, a base layer that is not
a plain ``nn.Linear``, no autocast) runs peft's own forward.

A self-attention's to_q, to_k and to_v read the same ``x`` (a cross-attention's to_k and to_v the same text):
diffusers' AttnProcessor2_0 runs them one by one, so the fused layer would still read ``x`` three times for three
16-column down-projections. ``use_fused`` gives such an attention a processor of our own that runs them as one
fused call (stacked weights, the up-projections on a block diagonal): SDXL's 1280-channel block 1.547 against
1.629 ms, 640-channel 3.049 against 3.156 (H200, batch 4, benchmarks/lora_block.py); SDXL LoRA b4 as shipped
40.3 % MFU on an H100 (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class _LoraLinear(torch.autograd.Function):
    """``x @ weight.T + bias + scale * (x @ a.T) @ b.T`` with every tensor in one dtype (autocast's)."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, a, b, scale: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        mid = x2 @ a.t()
        # one matmul for the base and the up-projection: [x, x a^T] [w, s b]^T. Measured against adding the
        # up-projection in an addmm (cuBLAS first copies the sum's input into its output: one more pass), SDXL's
        # 1280-channel block at batch 4 on an H100: 1.734 against 1.767 ms, peft's 1.822 (benchmarks/lora_block.py)
        y = torch.cat([x2, mid], 1) @ torch.cat([weight, b * scale], 1).t()
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, mid, weight, a, b)
        ctx.scale, ctx.shape = scale, shape
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad):
        x2, mid, weight, a, b = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])
        gm = g2 @ (b * ctx.scale)  # the down-projection's output gradient (rows x rank)
        gx = gw = gbias = ga = gb = None
        if need_x:  # [g, g s b] [w; a], as the forward (an addmm form measured the same: lora_block.py)
            gx = (torch.cat([g2, gm], 1) @ torch.cat([weight, a], 0)).view(ctx.shape)
        if need_w:  # the base layer trained too: not LoRA's case, kept correct
            gw = g2.t() @ x2
        if need_bias:
            gbias = g2.sum(0)
        if need_a:
            ga = gm.t() @ x2
        if need_b:
            gb = (g2.t() @ mid) * ctx.scale
        return gx, gw, gbias, ga, gb, None


def _plain(layer: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The adapter's name where this layer and call are the plain case the fused path computes, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged or layer.fan_in_fan_out:
        return None
    if not torch.is_autocast_enabled(x.device.type) or type(layer.base_layer) is not torch.nn.Linear:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    if name not in layer.lora_A or name in layer.lora_variant or layer.lora_bias.get(name, False):
        return None
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return None
    return name


def _forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = _plain(self, x, args, kwargs)
    if name is None:
        return super(type(self), self).forward(x, *args, **kwargs)
    dt = torch.get_autocast_dtype(x.device.type)
    base = self.base_layer
    bias = None if base.bias is None else base.bias.to(dt)
    a, b = self.lora_A[name].weight.to(dt), self.lora_B[name].weight.to(dt)
    return _LoraLinear.apply(x.to(dt), base.weight.to(dt), bias, a, b, float(self.scaling[name]))


def _stacked(layers: tuple[Any, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The outputs of several fused LoRA Linears of the same input from one pass of the fused layer (None where any
    of them is not the plain case): their weights stacked ``[w_q; w_k; w_v]``, the down-projections stacked
    ``[a_q; a_k; a_v]`` and the scaled up-projections on the diagonal of one block matrix, so ``x`` is read once for
    the down-projections and once for the base projections, and the backward has one low-rank gradient matmul for
    each factor instead of one per layer. (The stacked weight is a new tensor, kept for the backward: about 0.6 GiB
    over SDXL's self-attentions.)"""
    # the class's forward, not fused_class(): torch.compile traces through functools.cache (a new class each call)
    if any(getattr(type(m), "forward", None) is not _forward for m in layers):
        return None
    names = [_plain(m, x, (), {}) for m in layers]
    biases = [m.base_layer.bias for m in layers]
    if None in names or len({b is None for b in biases}) != 1:
        return None
    dt = torch.get_autocast_dtype(x.device.type)
    weight = torch.cat([m.base_layer.weight for m in layers]).to(dt)
    bias = None if biases[0] is None else torch.cat(biases).to(dt)
    a = torch.cat([m.lora_A[n].weight for m, n in zip(layers, names, strict=True)]).to(dt)
    b = torch.block_diag(*(m.lora_B[n].weight * m.scaling[n] for m, n in zip(layers, names, strict=True))).to(dt)
    y = _LoraLinear.apply(x.to(dt), weight, bias, a, b, 1.0)
    return y.split([m.out_features for m in layers], -1)


def _attention(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kw):
    """diffusers' AttnProcessor2_0 for an attention without mask or norms of its inputs, with a self-attention's q,
    k and v, or a cross-attention's k and v (both read the text), from one :func:`_stacked` call; every other call,
    and one whose projections are not the plain case, runs diffusers' own."""
    plain = not (args or kw or attention_mask is not None)
    plain = plain and attn.spatial_norm is None and attn.group_norm is None and hidden_states.ndim == 3
    qkv: tuple[torch.Tensor, ...] | None = None
    if plain and encoder_hidden_states is None:
        qkv = _stacked((attn.to_q, attn.to_k, attn.to_v), hidden_states)
    elif plain and not attn.norm_cross:
        kv = _stacked((attn.to_k, attn.to_v), encoder_hidden_states)
        qkv = None if kv is None else (attn.to_q(hidden_states), *kv)
    if qkv is None:
        return super(type(self), self).__call__(
            attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kw
        )
    import torch.nn.functional as F  # looked up at each call: speed.attention fa4 routes it (fa4.routed)

    batch = hidden_states.shape[0]
    query, key, value = qkv
    head_dim = key.shape[-1] // attn.heads
    query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
    out = attn.to_out[1](attn.to_out[0](out))
    if attn.residual_connection:
        out = out + hidden_states
    return out / attn.rescale_output_factor


def use_fused(module: torch.nn.Module) -> int:
    """Gives every peft LoRA Linear under ``module`` the fused forward, and every attention of diffusers'
    AttnProcessor2_0 whose to_q, to_k and to_v are among them the processor that runs those of one input as one
    (:func:`_stacked`); returns how many Linears. Weights, names and the state dict are untouched."""
    from peft.tuners.lora.layer import Linear

    fused, n = fused_class(), 0
    for m in module.modules():
        if type(m) is Linear:
            m.__class__ = fused
            n += 1
    plain = _processor_base()
    for m in module.modules():  # a second pass: an attention comes before its projections in modules()
        qkv = [getattr(m, k, None) for k in ("to_q", "to_k", "to_v")]
        if type(getattr(m, "processor", None)) is plain and all(type(q) is fused for q in qkv):
            m.set_processor(processor_class()())  # type: ignore[operator]  # diffusers' Attention, found by duck type
    return n


def fused_attentions(module: torch.nn.Module) -> int:
    """How many attentions under ``module`` run their projections of one input as one call."""
    cls = processor_class()
    return sum(type(getattr(m, "processor", None)) is cls for m in module.modules())


@functools.cache
def fused_class() -> type:
    """peft's LoRA Linear with the fused forward (built on first use: importing peft is slow)."""
    from peft.tuners.lora.layer import Linear

    return type("FusedLoraLinear", (Linear,), {"forward": _forward, "__module__": __name__})


def _processor_base() -> type:
    from diffusers.models.attention_processor import AttnProcessor2_0

    return AttnProcessor2_0


@functools.cache
def processor_class() -> type:
    """diffusers' AttnProcessor2_0 with q, k and v in one fused pass (built on first use)."""
    return type("FusedQKVAttnProcessor", (_processor_base(),), {"__call__": _attention, "__module__": __name__})


def __getattr__(name: str) -> Any:  # pickle and copy find the classes by their names
    if name == "FusedLoraLinear":
        return fused_class()
    if name == "FusedQKVAttnProcessor":
        return processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
