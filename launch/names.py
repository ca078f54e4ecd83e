"""What a launcher and its function ranks agree on: how a function is named, and where a rank's result goes."""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable


def resolve(path: str, what: str = "callable") -> Callable[..., Any]:
    """``"package.module:attr"`` → the object; one clear line when it cannot be imported."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} {path!r} is not 'module:callable' (e.g. tests.planted_collectives:make)")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r} cannot be imported ({exc}); put its package on PYTHONPATH") from None
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is not callable")
    return obj


def result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pkl")
