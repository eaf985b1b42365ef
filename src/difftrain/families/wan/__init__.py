"""Wan 2.1 / 2.2 (issue 51): the family (family.py), its bundled architectures (families/configs/wan*) and the
original layout's names (single_file.py)."""

from .family import Wan
from .i2v import WanI2V

__all__ = ["Wan", "WanI2V"]
