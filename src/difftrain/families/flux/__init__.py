"""The Flux.1 family: ``family`` (the ModelFamily: loading, encoding, denoising, saving, its LoRA names and tiny
builder) and ``single_file`` (Black Forest Labs' file layout <-> diffusers, and sd-scripts' LoRA groups)."""

from .family import Flux

__all__ = ["Flux"]
