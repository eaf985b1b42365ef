"""The FLUX.2 families (klein 4B / 9B, [dev]): ``family`` (flux2, the ModelFamily: loading, encoding, denoising,
saving, its LoRA names and tiny builder), ``edit`` (flux2-edit: trained with reference images) and ``single_file``
(Black Forest Labs' file layout <-> diffusers)."""

from .edit import Flux2Edit
from .family import Flux2

__all__ = ["Flux2", "Flux2Edit"]
