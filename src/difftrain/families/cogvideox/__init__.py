"""The CogVideoX families (text-to-video and image-to-video): ``family`` (the ModelFamily: loading, encoding,
denoising, saving, its LoRA names and tiny builder)."""

from .family import CogVideoX, CogVideoXI2V

__all__ = ["CogVideoX", "CogVideoXI2V"]
