"""The speed section: regional compilation, the attention kernel, channels-last, fp8 training, peak FLOP/s.

Nothing here changes what a step computes (within rounding), only how fast.
Regional compilation follows diffusers' ``ModelMixin.compile_repeated_blocks``
(``submodule.compile()`` on every block of a repeated class), with the block
classes given by the family: diffusers lists only the UNet's transformer block
and nothing for SD3's or CogVideoX's transformers.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .config.schema import SpeedConfig
from .errors import BackendUnavailable

_SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def compile_cache_dir(speed: SpeedConfig) -> Path:
    return Path(speed.compile_cache_dir or Path.home() / ".cache" / "difftrain" / "torch-compile").expanduser()


def configure_compile(speed: SpeedConfig) -> None:
    """Point inductor's on-disk caches (FX graphs, AOT autograd) at a lasting folder, so a second run of the same
    config reuses the compiled kernels; allow enough recompiles for every block shape of a model."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir(speed)))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    import torch._dynamo

    cfg = torch._dynamo.config
    # SDXL's ResnetBlock2D comes in ~10 shapes and layouts (with and without a shortcut); torch's default of 8
    # compiled versions per block class would silently leave the rest eager
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(64, getattr(cfg, name)))


def compile_blocks(
    module: torch.nn.Module, block_classes: tuple[str, ...], speed: SpeedConfig, checkpoint_every: int = 0
) -> int:
    """Compile, in place, every submodule whose class is one of ``block_classes``; returns how many.

    ``Module.compile`` keeps the module's parameters and state-dict names (no ``_orig_mod`` wrapper), so
    checkpoints, LoRA export and EMA see the same module. With ``checkpoint_every`` k > 0 (gradient
    checkpointing), every k-th block is checkpointed *inside* its compiled region instead of by diffusers around
    it (see ``checkpoint_inside``).
    """
    configure_compile(speed)
    mode = compile_mode(speed)
    blocks = [sub for sub in module.modules() if type(sub).__name__ in block_classes]
    if checkpoint_every:
        checkpoint_inside(module, blocks[::checkpoint_every])
    for sub in blocks:
        sub.compile(mode=mode, dynamic=speed.dynamic)
    return len(blocks)


def compile_mode(speed: SpeedConfig) -> str | None:
    """torch.compile's mode for the speed section: CUDA graphs (reduce-overhead) and autotuning chosen apart."""
    autotune = speed.compile_mode != "default"
    if speed.cuda_graphs:
        return "max-autotune" if autotune else "reduce-overhead"
    return "max-autotune-no-cudagraphs" if autotune else None


def checkpoint_inside(module: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
    """Gradient checkpointing moved into the compiled blocks (the way torchtitan pairs the two).

    diffusers checkpoints a block by calling it through ``torch.utils.checkpoint`` from its parent, so the
    compiled block's forward runs again, eagerly re-entered, inside backward: twice the launches, and CUDA graphs
    replay over outputs still in use (measured: SDXL fails). Here the checkpoint call sits inside the traced
    forward: dynamo captures it as one region, and AOT autograd's partitioner saves only the block's inputs and
    recomputes the rest inside the compiled backward graph - the same memory as diffusers' checkpointing, one
    forward and one backward graph per block.
    """
    from torch.utils.checkpoint import checkpoint

    for m in module.modules():  # diffusers' own switches off: the blocks checkpoint themselves
        if isinstance(getattr(m, "gradient_checkpointing", None), bool):
            m.gradient_checkpointing = False  # type: ignore[assignment]  # diffusers' bool; torch: Tensor | Module
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def attention_context(speed: SpeedConfig, device: torch.device):
    """A context choosing the scaled-dot-product-attention kernel (held over forward and backward: checkpointed
    blocks recompute their forward inside backward). ``auto`` leaves torch's choice."""
    if speed.attention == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda" and speed.attention in ("cudnn", "efficient"):
        raise BackendUnavailable(
            f"speed.attention {speed.attention} runs on CUDA GPUs only.",
            hint="Use speed.attention: auto (or flash / math) on this device.",
        )
    return sdpa_kernel(getattr(SDPBackend, _SDPA[speed.attention]))


def check_attention(speed: SpeedConfig, device: torch.device) -> None:
    """Run the chosen kernel once on a small input, so an unsupported choice is named before the model loads."""
    if speed.attention == "auto":
        return
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, 64, 64, device=device, dtype=dtype, requires_grad=True)
    try:
        with attention_context(speed, device):
            torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    except RuntimeError as e:
        raise BackendUnavailable(
            f"speed.attention {speed.attention} does not run on this device: {str(e).splitlines()[0][:200]}",
            hint="Use speed.attention: auto.",
        ) from None


def optimizer_kernels(speed: SpeedConfig, params: Sequence[torch.Tensor]) -> dict:
    """torch AdamW's implementation switches for these parameters."""
    kind = speed.optimizer_kernels
    if kind == "auto":
        kind = "fused" if params and all(p.is_cuda for p in params) else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[kind]


def channels_last(module: torch.nn.Module) -> None:
    module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs omit memory_format


def float8_training(module: torch.nn.Module, device: torch.device) -> int:
    """torchao's float8 training on every Linear whose sizes fp8 matmuls take (multiples of 16); returns how many.
    Why torchao: it is the fp8 training recipe PyTorch maintains (dynamic scaling, FSDP-aware), nothing to rewrite."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise BackendUnavailable(
            "speed.float8 needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper).",
            hint="Set speed.float8: false on this device.",
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise BackendUnavailable(
            "speed.float8 needs torchao, which is not installed.",
            hint="pip install 'difftrain[torchao]', or set speed.float8: false",
        ) from None
    before = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
    # pad_inner_dim: a weight gradient's inner dimension is the token count (SDXL's 77 text tokens, SD3's 333),
    # which an fp8 matmul takes only in multiples of 16 (measured: the tiny SDXL's 2 x 77 failed without it)
    convert_to_float8_training(module, config=Float8LinearConfig(pad_inner_dim=True), module_filter_fn=float8_eligible)
    return before - sum(type(m) is torch.nn.Linear for m in module.modules())


def float8_eligible(mod: torch.nn.Module, fqn: str) -> bool:
    """Linear layers over tokens with fp8-sized features. Not the embedding and adaptive-norm layers (``*emb*``,
    ``*norm*``): they take one vector per sample, and an fp8 matmul needs the rows (the batch) in multiples of 16."""
    name = fqn.lower()
    return (
        isinstance(mod, torch.nn.Linear)
        and mod.in_features % 16 == 0
        and mod.out_features % 16 == 0
        and "emb" not in name
        and "norm" not in name
    )


def peak_matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """The measured dense matmul peak in TFLOP/s (bf16 on CUDA, fp32 on the CPU): MFU's denominator, measured
    in the same run so a throttled or shared device is compared with itself."""
    if device.type != "cuda":
        n, reps = 1024, 5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
