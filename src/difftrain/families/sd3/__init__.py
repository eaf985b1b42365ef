"""The SD3 family (SD3 and SD3.5): ``family`` (the ModelFamily: loading, encoding, denoising, saving, its LoRA names
and tiny builder) and ``single_file`` (Stability's single-file layout <-> diffusers)."""

from .family import SD3

__all__ = ["SD3"]
