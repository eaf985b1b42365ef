"""The Qwen-Image family: ``family`` (the ModelFamily: loading, encoding, denoising, saving, its LoRA names and tiny
builder). Its transformer files and LoRAs use diffusers' module names (ComfyUI's too), so it has no layout module."""

from .family import QwenImage

__all__ = ["QwenImage"]
