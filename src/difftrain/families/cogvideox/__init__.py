"""The CogVideoX families: ``family`` (text-to-video: the ModelFamily, with loading, encoding, denoising, saving,
its LoRA names and tiny builder), ``i2v`` (image-to-video: the first frame's latents as conditioning) and
``positions`` (frame counts, and the learned positional table resampled to other sizes)."""

from .family import CogVideoX
from .i2v import CogVideoXI2V

__all__ = ["CogVideoX", "CogVideoXI2V"]
