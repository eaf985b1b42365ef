"""The FLUX.2 family (klein 4B / 9B, [dev]): ``family`` (the ModelFamily: loading, encoding, denoising, saving, its
LoRA names and tiny builder) and ``single_file`` (Black Forest Labs' file layout <-> diffusers)."""

from .family import Flux2

__all__ = ["Flux2"]
