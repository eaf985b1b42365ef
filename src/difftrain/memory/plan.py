"""The memory plan: techniques applied in a fixed order to the loaded modules.

Order: load (weights dtype) -> adapters (done by the trainer) -> activations
-> offload -> engine -> optimizer. This first version holds the techniques
that need no optional engine: the storage dtype of frozen weights and
gradient checkpointing. Each later technique is one module here.
"""

from __future__ import annotations

import torch

from ..config.schema import MemoryConfig, WeightsInt4
from ..config.schema.memory import QUANTIZED_KINDS, QUANTIZED_WEIGHTS
from .optimizers import make_optimizer  # noqa: F401  (the plan's optimizer step)

WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def weights_dtype(mem: MemoryConfig) -> torch.dtype:
    """The dtype weights are loaded in (for fp8: the compute dtype, before conversion)."""
    w = mem.weights
    # the quantized kinds' classes: isinstance tells mypy they have `compute`
    return WEIGHT_DTYPES[w.compute if isinstance(w, QUANTIZED_WEIGHTS) else w.kind]


def load_device(mem: MemoryConfig, device: torch.device) -> torch.device:
    """Quantized weights are loaded on the CPU and quantized onto the GPU layer by layer;
    with block swap the swapped blocks never go to the GPU whole."""
    return torch.device("cpu") if mem.weights.kind in QUANTIZED_KINDS or mem.offload.kind == "block_swap" else device


def apply_weights_before_adapters(
    mem: MemoryConfig, module: torch.nn.Module, device: torch.device, keep: tuple[str, ...] = ()
) -> None:
    """bitsandbytes layers must exist before peft adds LoRA (peft picks its bnb LoRA layer for them)."""
    if mem.weights.kind in ("nf4", "int8"):
        from .bnb_weights import convert

        convert(
            module,
            device,
            mem.weights.kind,
            weights_dtype(mem),
            skip=keep,
            threshold=getattr(mem.weights, "outlier_threshold", 0.0),
        )


def apply_weights(
    mem: MemoryConfig,
    module: torch.nn.Module,
    device: torch.device,
    keep: tuple[str, ...] = (),
    swapped: bool = False,
    placed: bool = False,
) -> None:
    """Store the frozen weights as the plan says (fp8: quantize layer by layer), after the adapters.

    ``swapped``: the module's blocks will be placed by block swap, so it stays
    where it is (fp8 quantizes on the CPU then). ``placed``: the streaming load already stored and placed every
    weight (memory/placement.py); what it did not read (the adapters, buffers the constructor made) joins them on
    ``device``, or, with block swap, where block swap puts it.
    """
    if placed:
        if not swapped:
            module.to(device)
        return
    target = torch.device("cpu") if swapped else device
    if mem.weights.kind in ("nf4", "int8"):
        module.to(device)  # the bnb layers are already there; the rest follows
    elif mem.weights.kind == "fp8":
        from .fp8 import convert

        convert(module, target, per_channel=mem.weights.scale == "channel", skip=keep)
    elif isinstance(mem.weights, WeightsInt4):
        from .int4 import convert as int4_convert

        int4_convert(module, target, mem.weights.group_size, skip=keep)
    else:
        module.to(target)


def apply_offload(
    mem: MemoryConfig,
    module: torch.nn.Module,
    units: list[torch.nn.Module],
    device: torch.device,
    full: bool,
    fixed: bool = False,
    swapped: list[int] | None = None,
):
    """Block swap over the family's units (returns the BlockSwap, or None when the plan has none). ``fixed``: each
    block lands at the same GPU addresses every time (CUDA graphs replay the addresses they recorded). ``swapped``:
    the units the streaming load put in host RAM (memory/placement.py)."""
    if mem.offload.kind != "block_swap":
        return None
    from .block_swap import BlockSwap

    o = mem.offload
    return BlockSwap(
        module,
        units,
        o.blocks_to_swap,
        device,
        prefetch=o.prefetch,
        swap_trainable=full,
        write_back=full and mem.fused_backward,  # stepped on the GPU inside backward (the validator checks the pair)
        fixed=fixed,
        swapped=swapped,
    )


def apply_activations(mem: MemoryConfig, module: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> None:
    """Gradient checkpointing through the module's own switch (diffusers or transformers); with ``offload``, a
    diffusers model's checkpoints wait in host RAM (transformers' text encoders checkpoint as usual), but for the
    last ``keep_on_gpu`` of ``blocks`` (the family's blocks in forward order).

    With ``every: k`` only every k-th of the blocks that checkpoint (diffusers
    sets a ``gradient_checkpointing`` flag on each) keeps it: less recompute,
    more memory. transformers' text encoders have one switch for all layers.
    """
    if mem.activations.kind != "checkpoint":
        return
    # torch types the attributes nn.Module does not declare as Tensor | Module (its __getattr__): hence the ignores
    if hasattr(module, "enable_gradient_checkpointing"):
        if mem.activations.offload:  # the block inputs wait in host RAM (memory/activation_offload.py)
            from .activation_offload import keep_on_gpu, offloaded_checkpoint

            keep_on_gpu(blocks or [], mem.activations.keep_on_gpu)
            module.enable_gradient_checkpointing(offloaded_checkpoint)  # type: ignore[operator]  # a diffusers method
        elif mem.activations.save_attention:  # the attentions' outputs kept (memory/checkpoint_policy.py)
            from .checkpoint_policy import checkpoint_function

            module.enable_gradient_checkpointing(checkpoint_function(True))  # type: ignore[operator]  # diffusers'
        else:
            module.enable_gradient_checkpointing()  # type: ignore[operator]  # a diffusers method
        k = mem.activations.every
        if k > 1:
            blocks = [m for m in module.modules() if m is not module and getattr(m, "gradient_checkpointing", False)]
            for i, m in enumerate(blocks):
                m.gradient_checkpointing = i % k == 0  # type: ignore[assignment]  # diffusers' bool flag
    elif hasattr(module, "gradient_checkpointing_enable"):
        kwargs: dict = {"use_reentrant": False}
        if mem.activations.save_attention:
            from .checkpoint_policy import save_attention_context

            kwargs["context_fn"] = save_attention_context
        module.gradient_checkpointing_enable(  # type: ignore[operator]  # a transformers method
            gradient_checkpointing_kwargs=kwargs
        )
    else:  # pragma: no cover - every family's trainable module has one of the two
        raise TypeError(f"{type(module).__name__} has no gradient checkpointing switch")
