"""nf4 / int8 base weights through bitsandbytes (QLoRA-style), LoRA only.

Frozen nn.Linear layers become bitsandbytes Linear4bit (nf4, double-quantized
scales) or Linear8bitLt (LLM.int8) before the LoRA adapters are added, so peft
wraps them with its bitsandbytes LoRA layers. Convolutions and the layers the
family names stay in the compute dtype (bitsandbytes quantizes Linear only).
Each layer is quantized as it moves to the GPU, so the high-precision model is
never on the GPU whole. CUDA only.
"""

from __future__ import annotations

import fnmatch

import torch

from ..errors import BackendUnavailable


def convert(
    module: torch.nn.Module,
    device,
    kind: str,
    compute_dtype: torch.dtype,
    skip: tuple[str, ...] = (),
    threshold: float = 0.0,
) -> int:
    """Replace frozen Linear layers of ``module`` with bitsandbytes ones on ``device``; return the count."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise BackendUnavailable(
            f"memory.weights {kind} needs bitsandbytes, which is not installed.",
            hint="pip install 'difftrain[bnb]', or use memory.weights {kind: fp8}",
        ) from None
    if torch.device(device).type != "cuda":
        raise BackendUnavailable(
            f"memory.weights {kind} runs on a CUDA GPU only.", hint="Use memory.weights {kind: fp8} here."
        )
    n = 0
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (
                type(child) is not torch.nn.Linear
                or child.weight.requires_grad
                or any(fnmatch.fnmatch(full, p) for p in skip)
            ):
                continue
            bias = child.bias is not None
            if kind == "nf4":
                new = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=bias,
                    compute_dtype=compute_dtype,
                    quant_type="nf4",
                    compress_statistics=True,
                )
                new.weight = bnb.nn.Params4bit(
                    child.weight.data.to("cpu"), requires_grad=False, quant_type="nf4", compress_statistics=True
                )
            else:
                new = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=bias, has_fp16_weights=False, threshold=threshold
                )
                new.weight = bnb.nn.Int8Params(child.weight.data.to("cpu"), requires_grad=False, has_fp16_weights=False)
            if bias:
                new.bias = torch.nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            new = new.to(device)  # bitsandbytes quantizes on the move to the GPU
            setattr(parent, child_name, new)
            n += 1
    return n
