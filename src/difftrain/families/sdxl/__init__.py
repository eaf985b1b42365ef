"""The SDXL family: ``family`` (the ModelFamily: loading, encoding, denoising, saving, its LoRA names and tiny
builder) and ``single_file`` (Stability's single-file layout <-> diffusers)."""

from .family import SDXL

__all__ = ["SDXL"]
