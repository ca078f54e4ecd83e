"""What a launcher and its function ranks agree on: how a function is named, and where a rank's result goes."""
from __future__ import annotations

import os

from hal.plugins import resolve

__all__ = ["resolve", "result_path"]


def result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pkl")
