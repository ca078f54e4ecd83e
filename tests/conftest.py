"""Shared helpers: run the real ``hal`` command in a subprocess, as a user would."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_hal(*args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m hal ARGS`` in a fresh process; returns the completed process (text mode)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("HAL_BACKEND", "HAL_PRECISION", "HAL_FALLBACK"):
        full_env.pop(key, None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "hal", *args],
        capture_output=True, text=True, env=full_env, cwd=cwd or REPO, timeout=timeout,
    )


def has_cuda() -> bool:
    from hal import get_backend

    return get_backend("cuda").is_available()


@pytest.fixture
def repo() -> Path:
    return REPO
