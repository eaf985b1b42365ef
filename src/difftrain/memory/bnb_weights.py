"""nf4 / int8 base weights through bitsandbytes (QLoRA-style), LoRA only.

Frozen nn.Linear layers become bitsandbytes Linear4bit (nf4, double-quantized
scales) or Linear8bitLt (LLM.int8) before the LoRA adapters are added, so peft
wraps them with its bitsandbytes LoRA layers. Convolutions and the layers the
family names stay in the compute dtype (bitsandbytes quantizes Linear only).
Each layer is quantized as it moves to the GPU, so the high-precision model is
never on the GPU whole. CUDA only. Under the streaming load (memory/placement.py) each layer is
made as its weight is read from the file, so the model is never whole in host RAM either.
"""

from __future__ import annotations

import fnmatch

import torch

from ..errors import BackendUnavailable


def require(kind: str, device) -> None:
    """bitsandbytes is installed and ``device`` is a CUDA GPU, or a clear error (before anything loads)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise BackendUnavailable(
            f"memory.weights {kind} needs bitsandbytes, which is not installed.",
            hint="pip install 'difftrain[bnb]', or use memory.weights {kind: fp8}",
        ) from None
    if torch.device(device).type != "cuda":
        raise BackendUnavailable(
            f"memory.weights {kind} runs on a CUDA GPU only.", hint="Use memory.weights {kind: fp8} here."
        )


def quantizable(name: str, module: torch.nn.Module, skip: tuple[str, ...] = (), frozen: bool = True) -> bool:
    """Whether ``convert`` (and the streaming load) makes ``module`` (at ``name``) a bitsandbytes layer: a plain
    Linear outside the ``skip`` patterns (the family's high-precision modules), frozen unless ``frozen`` is false
    (the streaming load's modules are still on the meta device, their parts not yet frozen; it takes only parts
    that are not trained whole)."""
    return (
        type(module) is torch.nn.Linear
        and not (frozen and module.weight.requires_grad)
        and not any(fnmatch.fnmatch(name, p) for p in skip)
    )


def make_layer(
    kind: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    has_bias: bool,
    device,
    compute_dtype: torch.dtype,
    threshold: float = 0.0,
) -> torch.nn.Module:
    """The bitsandbytes layer of one Linear, quantized on ``device`` from ``weight`` (out x in, any device: it is
    copied to the host first, as bitsandbytes quantizes on the move to the device). ``bias``: the Linear's bias if
    it is known yet (else a bias of the right size is there to be set later, when ``has_bias``)."""
    import bitsandbytes as bnb

    out_f, in_f = weight.shape
    new: torch.nn.Module
    if kind == "nf4":
        new = bnb.nn.Linear4bit(
            in_f, out_f, bias=has_bias, compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=True
        )
        new.weight = bnb.nn.Params4bit(
            weight.data.to("cpu"), requires_grad=False, quant_type="nf4", compress_statistics=True
        )
    else:
        new = bnb.nn.Linear8bitLt(in_f, out_f, bias=has_bias, has_fp16_weights=False, threshold=threshold)
        new.weight = bnb.nn.Int8Params(weight.data.to("cpu"), requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        new.bias = torch.nn.Parameter(bias.data.to(compute_dtype), requires_grad=False)
    elif has_bias:
        new.bias = torch.nn.Parameter(torch.zeros(out_f, dtype=compute_dtype), requires_grad=False)
    return new.to(device)  # bitsandbytes quantizes on the move to the device


def convert(
    module: torch.nn.Module,
    device,
    kind: str,
    compute_dtype: torch.dtype,
    skip: tuple[str, ...] = (),
    threshold: float = 0.0,
) -> int:
    """Replace frozen Linear layers of ``module`` with bitsandbytes ones on ``device``; return the count. Layers
    the streaming load already made (memory/placement.py) are bitsandbytes' already and stay as they are."""
    require(kind, device)
    n = 0
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not quantizable(full, child, skip):
                continue
            bias = child.bias
            new = make_layer(kind, child.weight, bias, bias is not None, device, compute_dtype, threshold)
            setattr(parent, child_name, new)
            n += 1
    return n
