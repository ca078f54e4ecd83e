"""Shared helpers: run the real ``hal`` command in a subprocess, as a user would."""
from __future__ import annotations

import os
import platform
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


# --- the fast lane ------------------------------------------------------------------------------------
# Tests live in folders by kind: unit/ (no process), ranks/ (multi-process worlds), cli/ (whole processes: the
# hal command, scripts, pip) and cuda/ (an NVIDIA GPU); shared cases and probes sit beside the folders.
# `pytest -m "not multiprocess and not slow"` runs unit/ alone; the README's plain `pytest` runs everything.
# Every test outside unit/ is marked multiprocess; the guard below fails a unit test that starts a process,
# so the fast lane cannot silently grow slow.
MULTIPROCESS_FOLDERS = frozenset({"ranks", "cli", "cuda"})


def _kind(item: pytest.Item) -> str | None:
    """The test folder an item's module sits in (unit, ranks, cli, cuda), or None outside them."""
    parts = Path(str(item.path)).parts
    return parts[-2] if len(parts) > 1 else None


platform.platform()  # the stdlib runs `uname -p` once and caches it: run it here, not inside a guarded test


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _kind(item) in MULTIPROCESS_FOLDERS:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(autouse=True)
def _processes_only_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unmarked test that starts a process fails, naming the folders its module belongs in."""
    if request.node.get_closest_marker("multiprocess") is not None:
        return
    import multiprocessing.process

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: move its module to tests/ranks or tests/cli "
                             "(or mark the test multiprocess)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
