"""lit_gspo: reinforcement learning of language models on PyTorch Lightning, with pluggable objectives."""

__version__ = "0.1.0"
