"""The Qwen-Image families: ``family`` (Qwen-Image, the ModelFamily: loading, encoding, denoising, saving, its LoRA
names and tiny builder) and ``edit`` (Qwen-Image-Edit, Edit-2509 and Edit-2511: trained with reference images). Their
transformer files and LoRAs use diffusers' module names (ComfyUI's too), so they have no layout module."""

from .edit import QwenImageEdit
from .family import QwenImage

__all__ = ["QwenImage", "QwenImageEdit"]
