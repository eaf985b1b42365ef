"""What a tiny SDXL transformer block with LoRA saves for backward when it is checkpointed inside its compiled region
(regional_compile.checkpoint_inside, as the checkpointed tier recipes run): peft's LoRA Linear against difftrain's fused one
(speed.lora_kernel), counted with torch.autograd.graph.saved_tensors_hooks on the CPU under bf16 autocast.

    python3 benchmarks/lora_checkpoint_saved.py [inductor|aot_eager]
"""

import sys

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.attention import BasicTransformerBlock

from difftrain.config.schema import LoraConfig
from difftrain.lora.adapters import add_lora
from difftrain.speed import lora_kernel as fused
from difftrain.speed import regional_compile


def build(kind: str, backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    b = BasicTransformerBlock(64, 2, 32, cross_attention_dim=32, activation_fn="geglu", attention_bias=False)
    b = b.to(torch.bfloat16).requires_grad_(False)
    b.__class__ = type("LoraBlock", (type(b), PeftAdapterMixin), {})
    add_lora(b, LoraConfig(rank=4, alpha=4), ["to_q", "to_k", "to_v", "to_out.0"])
    if kind == "fused":
        fused.use_fused(b)
    regional_compile.checkpoint_inside(torch.nn.ModuleDict({"block": b}), [b])
    b.compile(backend=backend)
    return b


def saved_by(block: torch.nn.Module) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of each tensor one forward saves for backward."""
    x = torch.randn(2, 256, 64, dtype=torch.bfloat16, requires_grad=True)
    ctx = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    saved: list[tuple[tuple[int, ...], int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.numel() * t.element_size()))
        return t

    with torch.autocast("cpu", torch.bfloat16):
        block(x, encoder_hidden_states=ctx)  # compiled here, not counted
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x, encoder_hidden_states=ctx)
    y.float().sum().backward()
    return saved


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "inductor"
    for kind in ("peft", "fused"):
        saved = saved_by(build(kind, backend))
        big = [s for s in saved if s[1] >= 2 * 256 * 64]
        print(f"{kind}: {sum(s[1] for s in saved)} bytes in {len(saved)} tensors; activation-sized: {big}")


if __name__ == "__main__":
    main()
