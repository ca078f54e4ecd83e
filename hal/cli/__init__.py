"""The ``hal`` command, top floor: one small module per sub-command, each with ``add_parser`` (argparse
only — no torch, so ``hal --help`` answers at once) and a ``run`` that imports the library lazily."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
