"""``speed``: how fast a step runs, not what it computes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from .base import Strict


class SpeedConfig(Strict):
    """How fast a step runs, not what it computes: compilation, attention and optimizer kernels, host syncs.
    Each option is measured in docs/benchmarks.md ("Speed"); `difftrain bench speed` measures a config."""

    compile: bool | Literal["auto"] = Field(
        default="auto",
        description="torch.compile each repeated block of the denoiser (regional compilation: one compiled "
        "block serves every repeat, so compiling takes seconds to a minute, not many); auto: on where it pays "
        "(a CUDA GPU with a working Triton, no debugger, enough planned steps to earn the compile time back), "
        "the reason printed at start",
    )
    compile_regions: list[str] | None = Field(
        default=None,
        description="class names of the denoiser's submodules compiled one by one (each a region of its own, "
        "what runs between them stays eager); null: the family's repeated blocks (SDXL: BasicTransformerBlock, "
        "ResnetBlock2D; SD3, Flux, CogVideoX: their transformer blocks). Larger regions (SDXL: Transformer2DModel) "
        "leave less eager work between them and take longer to compile",
    )
    compile_mode: Literal["default", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        default="default",
        description="max-autotune: inductor benchmarks more kernels (Triton matmul and convolution "
        "templates) for each block: a much longer first step (CogVideoX-2b 300 s, SDXL over 9 minutes on an H100) "
        "and measured no faster, since cuBLAS/cuDNN win the large shapes; CUDA graphs still follow "
        "speed.cuda_graphs (max-autotune-no-cudagraphs is the same choice, kept for torch's name)",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        default="auto",
        description="replay each compiled block as a CUDA graph (torch.compile's reduce-overhead): fewer "
        "launches; one graph per block and bucket shape, each shape recorded on its second step. auto: on with "
        "compile unless block swap, DeepSpeed, several processes or more than 16 bucket shapes stand in the way, "
        "or the recordings would not pay back in the planned steps",
    )
    dynamic: bool | None = Field(
        default=None,
        description="null: a dimension becomes dynamic once a second size is seen "
        "(a second bucket), so buckets do not each recompile; false: compile every shape",
    )
    compile_cache_dir: Path | None = Field(
        default=None,
        description="where compiled kernels are kept between runs (torch "
        "inductor's cache); default ~/.cache/difftrain/torch-compile",
    )
    attention: Literal["auto", "flash", "cudnn", "efficient", "math", "fa4"] = Field(
        default="auto",
        description="scaled-dot-product attention kernel; fa4: FlashAttention-4 (pip install flash-attn-4; "
        "compute capability 9.x or 10.x) for attention over 4,096 keys or more, torch's choice for the rest "
        "(measured on an H100: CogVideoX-2b LoRA steps 1.20x faster than with cuDNN's attention, SDXL LoRA at "
        "batch 4 1.04x); auto: fa4 where flash-attn-4 is installed and runs, else torch's choice for the device "
        "(cuDNN or flash on Hopper)",
    )
    geglu: Literal["auto", "triton", "torch"] = Field(
        default="auto",
        description="the backward of the GEGLU gates in SDXL's feed-forwards; triton: one difftrain kernel per "
        "gate (CUDA and Triton; 2x faster than inductor's fused kernel on an H100, the same numbers within bf16 "
        "rounding); torch: diffusers' ops as they are; auto: triton where CUDA and Triton are there",
    )
    optimizer_kernels: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        default="auto", description="torch AdamW's implementation; auto: fused on CUDA, foreach elsewhere"
    )
    channels_last: bool | Literal["auto"] = Field(
        default="auto",
        description="UNet convolutions in channels-last memory format (SDXL); auto: on for a compiled LoRA on a "
        "CUDA GPU (single process or DDP, not fp8 weights), where it was measured faster on an H100 (sdxl-lora-8gb "
        "1.11x, LoRA batch 1 without checkpointing 1.29x, batch 4 1.04x), off elsewhere",
    )
    lora_kernel: Literal["auto", "fused", "peft"] = Field(
        default="auto",
        description="how a LoRA Linear of the denoiser computes: fused: difftrain's forward and backward in fewer "
        "passes over the activations, an attention's q, k and v of one input as one call (difftrain.speed.lora_kernel; "
        "the same weights and files, bf16/fp16 autocast, one adapter without dropout, else peft's own); peft: "
        "peft's op by op; auto: fused on CUDA without gradient checkpointing (with it, sdxl-lora-8gb measured "
        "0.66 GiB more memory), peft elsewhere",
    )
    pin_memory: bool = Field(
        default=True, description="batches copied to the GPU from pinned host memory without waiting"
    )
    sync_seconds: float = Field(
        default=2.0,
        ge=0,
        description="the host reads losses back from the GPU at most this often "
        "(and before every checkpoint, validation and export), so it never waits on the GPU "
        "inside a step; 0: every step",
    )
    fp8_matmul: bool = Field(
        default=False,
        description="LoRA over memory.weights fp8 (one scale a tensor): the frozen Linear layers' forward and "
        "input gradient run as fp8 matmuls (torch._scaled_mm; the activations and gradients cast to e4m3 per "
        "row), as musubi-tuner's --fp8_fast does in its forward; CUDA compute capability 8.9+ (Ada, Hopper). "
        "Activations lose precision (3 % relative error in a layer's output, CPU test): opt-in, speed not "
        "measured yet",
    )
    float8: bool = Field(
        default=False,
        description="full fine-tuning: the denoiser's Linear layers compute in fp8 through "
        "torchao's float8 training (CUDA, compute capability 8.9+: Ada, Hopper); with compile and "
        "cuda_graphs. Measured on an H100: SD3-medium 1.05x and 27 % less memory, SDXL 0.52x "
        "(its matmuls are too small for the scaling kernels to pay)",
    )
