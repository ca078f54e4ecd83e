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
# `pytest -m "not multiprocess and not slow"` runs the in-process tests alone (about two minutes on two
# cores); the README's plain `pytest` runs everything. A test module that starts processes (ranks, the hal
# command, pip) is listed here; a listed module's tests are all marked. The guard below fails any unmarked
# test that starts a process, so the fast lane cannot silently grow slow.
MULTIPROCESS_MODULES = frozenset({
    "test_bench", "test_bridge", "test_checkpointing", "test_cli", "test_collective_failures", "test_collectives",
    "test_collectives_cuda",
    "test_checkpoint_validation", "test_config", "test_job", "test_conformance_cli", "test_conformance_collectives", "test_conformance_report",
    "test_conformance_training", "test_contract", "test_cuda", "test_engine", "test_engine_cuda",
    "test_fused_head", "test_moe_dispatch", "test_moe_pipeline", "test_moe_pipeline_cuda", "test_hf_export", "test_hf_weights_ranks", "test_kernel_plugins", "test_launch", "test_loss_scale", "test_train_loop", "test_layout", "test_migration", "test_migration_corpus", "test_ops", "test_parallel_model",
    "test_pipeline_bench", "test_plan", "test_planner_calibrate", "test_cpu_binding", "test_planner_cli", "test_plugin_backend", "test_reshard", "test_topology", "test_train",
    "test_tensorboard", "test_timeline_run", "test_tiny_example", "test_token_data", "test_vendor_backends", "test_zero",
})


platform.platform()  # the stdlib runs `uname -p` once and caches it: run it here, not inside a guarded test


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in MULTIPROCESS_MODULES:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(autouse=True)
def _processes_only_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unmarked test that starts a process fails, naming the list to add its module to."""
    if request.node.get_closest_marker("multiprocess") is not None:
        return
    import multiprocessing.process

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: add its module to MULTIPROCESS_MODULES "
                             "in tests/conftest.py (or mark the test multiprocess)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
