"""Model families by name. Adding a family is one module plus one row here."""

from __future__ import annotations

from ..errors import UsageError
from .base import ModelFamily


def _sdxl():
    from .sdxl import SDXL

    return SDXL()


def _sd3():
    from .sd3 import SD3

    return SD3()


def _cogvideox():
    from .cogvideox import CogVideoX

    return CogVideoX()


def _cogvideox_i2v():
    from .cogvideox import CogVideoXI2V

    return CogVideoXI2V()


FAMILIES = {"sdxl": _sdxl, "sd3": _sd3, "cogvideox": _cogvideox, "cogvideox-i2v": _cogvideox_i2v}


def get_family(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]()
    except KeyError:
        raise UsageError(
            f"Unknown model family {name!r}.", hint=f"Known families: {', '.join(sorted(FAMILIES))}."
        ) from None
