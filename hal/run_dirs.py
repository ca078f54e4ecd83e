"""Where a run writes when the user names no folder: ``runs/<name>-<date-time>`` (``runs/`` is git-ignored)."""
from __future__ import annotations

import time
from pathlib import Path


def new_run_dir(name: str) -> Path:
    """``runs/<name>-<YYYYmmdd-HHMMSS>``, with a -2, -3 ... suffix if that exists already (not created)."""
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
