"""difftrain: fine-tune diffusion models on the GPU you own."""

__version__ = "0.1.0"
