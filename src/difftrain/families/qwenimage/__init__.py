"""The Qwen-Image families: ``family`` (Qwen-Image, the ModelFamily: loading, encoding, denoising, saving, its LoRA
names and tiny builder), ``edit`` (Qwen-Image-Edit, Edit-2509 and Edit-2511: trained with reference images) and ``v21``
(Qwen-Image 2.1: diffusers' classes differ, its own VAE and a Qwen3-VL encoder; text-to-image). Their transformer files
and LoRAs use diffusers' module names (ComfyUI's too, but for 2.1's fused SwiGLU ``gate_up``, which v21 fuses and
splits itself), so they have no layout module."""

from .edit import QwenImageEdit
from .family import QwenImage
from .v21 import QwenImage21
from .v21_edit import QwenImage21Edit

__all__ = ["QwenImage", "QwenImage21", "QwenImage21Edit", "QwenImageEdit"]
