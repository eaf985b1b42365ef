"""Model families by name. Adding a family is one module plus one row here."""

from __future__ import annotations

from ..errors import UsageError
from .base import ModelFamily


def _sdxl():
    from .sdxl import SDXL

    return SDXL()


FAMILIES = {"sdxl": _sdxl}


def get_family(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]()
    except KeyError:
        raise UsageError(f"Unknown model family {name!r}.", hint=f"Known families: {', '.join(sorted(FAMILIES))}.") from None
