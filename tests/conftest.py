"""Shared helpers: run the real ``hal`` command in a subprocess, as a user would."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

# Every process the tests start shares two cores with the others: an OpenMP thread done with its work sleeps at once
# instead of spinning for the core another process waits on. Set before torch is first imported here (the OpenMP
# runtime reads it at load); every rank, command and script inherits it. Results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# and one compute thread a process unless a test says otherwise: the workers and the ranks they start already
# outnumber the cores, so a second thread only waits its turn (hal train would give a lone rank both)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cache_bytecode_outside_the_tree() -> None:
    """Where the environment forbids bytecode files (``PYTHONDONTWRITEBYTECODE``, as on our CI host), every one of the
    suite's few thousand processes (ranks, commands, servers) compiled hal from source again: on a clean checkout that
    was about 180 s of CPU, 90 s of a run. The suite's processes then keep their bytecode in a cache of their own in
    the temporary directory (``PYTHONPYCACHEPREFIX``) — the checkout still gets no ``__pycache__``."""
    if not sys.dont_write_bytecode or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    import tempfile

    prefix = os.path.join(tempfile.gettempdir(), f"hetero-hal-test-pycache-{os.getuid()}")
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


_cache_bytecode_outside_the_tree()


def _a_cache_of_our_own() -> None:
    """What hal caches (``hal plan --calibrate``'s profiles) goes to a directory of the suite's: a cached profile of the
    user's would change what hal plan prints, and the suite must not write to the user's cache."""
    import tempfile

    os.environ["HAL_CACHE_DIR"] = tempfile.mkdtemp(prefix="hetero-hal-test-cache-")


_a_cache_of_our_own()


def _interpret_triton_without_a_gpu() -> None:
    """Without an NVIDIA GPU, Triton's interpreter, set before any test module can import triton: Triton picks
    compile or interpret at its first import, and a module collected early may import it indirectly
    (``transformers`` does), which skipped every Triton kernel test of a full run. The kernels run on CPU tensors
    only interpreted, so on such a host nothing else changes."""
    if "triton" in sys.modules or "TRITON_INTERPRET" in os.environ:
        return
    if not _nvidia_visible():
        os.environ["TRITON_INTERPRET"] = "1"


def _nvidia_visible() -> bool:
    from hal import get_backend

    return get_backend("cuda").is_available()


_interpret_triton_without_a_gpu()


def pytest_configure(config: pytest.Config) -> None:
    """On a pytest-xdist worker (the README's ``-n 2``): torch's intra-op threads shared out over the workers. Each
    worker's pool spinning against the other's made an in-process module 5x slower beside another worker (41 s
    alone, 208 s); the ranks and commands the tests start set their own thread counts."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    _build_the_font_cache()


def _build_the_font_cache() -> None:
    """matplotlib runs ``fc-list`` (a process) to list the system's fonts the first time it is used on a machine:
    here, before any test, so a unit test that draws a picture on a fresh machine does not trip the fast lane's guard."""
    try:
        from matplotlib import font_manager  # noqa: F401  (the import builds the cache)
    except ImportError:
        pass


def run_hal(*args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m hal ARGS`` in a process of its own; returns the completed process (text mode).

    The process is forked from a server that imported torch and hal once (``tests/hal_child.py``), unless
    ``env`` changes how an interpreter starts (``PYTHON*``) or ``HAL_TEST_FORK=0``: then a fresh interpreter."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("HAL_BACKEND", "HAL_PRECISION", "HAL_FALLBACK"):
        full_env.pop(key, None)
    full_env.update(env or {})
    where = str(cwd or REPO)
    if os.environ.get("HAL_TEST_FORK", "1") == "0" or any(k.startswith("PYTHON") for k in env or {}):
        return subprocess.run([sys.executable, "-m", "hal", *args], capture_output=True, text=True, env=full_env,
                              cwd=where, timeout=timeout)
    return _forked_hal(list(args), full_env, where, timeout)


_SERVER: Any = None


def fork_server() -> Any:
    """The multiprocessing context whose server imported torch and hal once (``tests/hal_child.py``)."""
    import multiprocessing

    global _SERVER
    if _SERVER is None:
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(["tests.hal_child"])
    return _SERVER


def _forked_hal(argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``hal ARGV`` in a child of the fork server; a TimeoutExpired as subprocess.run raises, the child killed."""
    import tempfile

    from tests.hal_child import run_command

    with tempfile.TemporaryDirectory(prefix="hal-run-") as scratch:
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        child = fork_server().Process(target=run_command, args=(argv, env, cwd, out, err), daemon=False)
        child.start()
        child.join(timeout)
        command = ["hal", *argv]
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(command, timeout)
        read = lambda path: Path(path).read_text(encoding="utf-8", errors="backslashreplace") if os.path.exists(path) else ""
        return subprocess.CompletedProcess(command, child.exitcode if child.exitcode is not None else -1, read(out), read(err))


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


# The longest modules (worker seconds on the 2-core host, 2026-11-29), handed out first: under ``--dist loadfile`` a
# module runs whole on one worker, and one of a minute or more that starts last leaves the other worker idle.
LONGEST_FIRST = ("ranks/test_engine.py", "cli/test_train.py", "ranks/test_moe_pipeline.py", "ranks/test_migration_corpus.py",
                 "ranks/test_planner_calibrate.py", "ranks/test_replicas.py", "ranks/test_bridge.py",
                 "cli/test_pipeline_bench.py", "cli/test_planner_cli.py", "ranks/test_loss_scale.py")


def _longest_first(item: pytest.Item) -> int:
    where = "/".join(Path(str(item.path)).parts[-2:])
    return LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _kind(item) in MULTIPROCESS_FOLDERS:
            item.add_marker(pytest.mark.multiprocess)
    items.sort(key=_longest_first)  # stable: each module keeps its own order, the rest keep theirs


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
