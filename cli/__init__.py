"""The ``hal`` command, top floor: one small module per sub-command, each with ``add_parser`` (argparse
only — no torch, so ``hal --help`` answers at once) and a ``run`` that imports the library lazily."""
if __name__ != "hal.cli":
    raise ImportError(f"this folder installs as 'hal.cli', not {__name__!r}: pip install -e . and import hal.cli")

from .main import build_parser, main

__all__ = ["build_parser", "main"]
