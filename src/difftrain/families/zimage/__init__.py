"""The Z-Image family: ``family`` (the ModelFamily: loading, encoding, denoising, saving, its LoRA names and tiny
builder) and ``single_file`` (the original file layout <-> diffusers, the fused qkv of its LoRA names)."""

from .family import ZImage

__all__ = ["ZImage"]
