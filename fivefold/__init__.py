"""fivefold: five-way parallel training of decoder-only language models."""

__version__ = "0.1.0"
