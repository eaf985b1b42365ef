"""The Krea 2 family: ``family`` (the ModelFamily: loading, encoding, denoising, saving, its LoRA names and tiny
builder) and ``single_file`` (Krea's original file layout <-> diffusers)."""

from .family import Krea2

__all__ = ["Krea2"]
