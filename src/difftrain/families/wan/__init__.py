"""Wan 2.1 / 2.2 (issue 51, in progress): the bundled architectures (families/configs/wan*) and the original
layout's names (single_file.py). Not a registered family yet: loading, encoding, training and export follow."""
