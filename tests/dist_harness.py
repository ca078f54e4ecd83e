"""Run a function on N real processes (gloo, file:// rendezvous) and collect each rank's result.

The ranks are processes of their own, forked from the tests' server that imported torch and hal once
(``tests/hal_child.py``: a world of 4 then starts in a fraction of a second, not 4 interpreters' imports);
``HAL_TEST_FORK=0`` starts them as hal.launch's local ranks instead (fresh interpreters). Either way the whole
run is bounded by ``deadline_s``, every rank is stopped and reaped on a crash or at the deadline, so a test
never leaves a process behind, and a rank's exception is its result (``("error", ...)``), not a crash.
"""
from __future__ import annotations

import datetime
import importlib
import os
import traceback
from typing import Any, Sequence


def _rank(module: str, fn: str, islands: Sequence[int] | None, timeout_s: float, backend: str | Sequence[str],
          kwargs: dict[str, Any]) -> tuple:
    """One rank (run by hal.launch.entry): join the world, run ``module.fn(rank, world, **kwargs)``; the outcome."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        import torch

        from hal.collectives import init_distributed

        # hal train's rule (parallel.loop.job_runner): the ranks share the host's cores. More compute threads than
        # cores make every rank's OpenMP workers spin against the others' (a tiny model's step 1.6x slower).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

        mine = backend if isinstance(backend, str) else backend[rank]
        init_distributed(mine, init_method=os.environ["HAL_INIT_METHOD"], rank=rank, world_size=world,
                         timeout=datetime.timedelta(seconds=timeout_s), islands=islands)
        value = getattr(importlib.import_module(module), fn)(rank, world, **kwargs)
        from hal.collectives import shutdown

        # the rank leaves with os._exit: its last transfers, waited on by the stream only, must be done first (a
        # receive still running when the process goes strands the peer's send until its CCL timeout)
        shutdown(drain=True)
        return ("ok", value)
    except BaseException as exc:  # report, never hang
        return ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def run_world(module: str, fn: str, world: int, *, deadline_s: float = 120, islands: Sequence[int] | None = None,
              collective_timeout_s: float = 30, backend: str | Sequence[str] = "cpu", **kwargs: Any) -> dict[int, tuple]:
    """``module.fn(rank, world, **kwargs)`` on ``world`` processes; {rank: ("ok", value) | ("error", msg, tb)}.

    ``backend``: one hal backend for every rank, or one per rank (a mixed, multi-island world).
    A rank that dies (signal, exit) or a run past ``deadline_s`` fails with the launcher's report.
    """
    args = {"module": module, "fn": fn, "islands": list(islands) if islands is not None else None,
            "timeout_s": collective_timeout_s, "backend": backend if isinstance(backend, str) else list(backend),
            "kwargs": kwargs}
    what = f"{module}.{fn} on {world} rank(s)"
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        from hal.launch import LaunchFailed, run_function

        try:
            run = run_function("tests.dist_harness:_rank", world, args, deadline_s=deadline_s, what=what)
        except LaunchFailed as exc:
            raise AssertionError(str(exc)) from None
        return dict(enumerate(run.values))
    return _forked_world(world, args, deadline_s, what)


def _forked_world(world: int, args: dict[str, Any], deadline_s: float, what: str) -> dict[int, tuple]:
    """``_rank(**args)`` on ``world`` children of the fork server; AssertionError naming each rank's fate on a
    crash (the others are killed at once) or past the deadline (all are killed)."""
    import tempfile
    import time

    from hal.launch import free_port, rank_env

    from .conftest import fork_server

    with tempfile.TemporaryDirectory(prefix="hal-world-") as tmp:
        base = {**os.environ, "HAL_INIT_METHOD": f"file://{os.path.join(tmp, 'store')}"}
        port = free_port()
        ranks = [fork_server().Process(target=_forked_rank, args=(rank_env(r, world, port, base=base), args,
                                                                 os.path.join(tmp, f"rank{r}.pkl")), daemon=False)
                 for r in range(world)]
        for rank in ranks:
            rank.start()
        end, failed = time.monotonic() + deadline_s, False
        while any(r.is_alive() for r in ranks) and time.monotonic() < end and not failed:
            time.sleep(0.02)
            failed = any(r.exitcode not in (None, 0) for r in ranks)
        late = [i for i, r in enumerate(ranks) if r.is_alive()]
        for rank in ranks:
            if rank.is_alive():
                rank.kill()
            rank.join()
        fates = [_fate(i, r.exitcode, i in late, failed) for i, r in enumerate(ranks)]
        if failed or late:
            why = "a rank failed" if failed else f"still running at the {deadline_s:g} s deadline"
            raise AssertionError(f"{what}: {why}: " + "; ".join(fates))
        return {r: _read(os.path.join(tmp, f"rank{r}.pkl")) for r in range(world)}


def _fate(rank: int, code: int | None, late: bool, failed: bool) -> str:
    if late:
        return f"rank {rank} stopped ({'after another failed' if failed else 'deadline'})"
    if code is not None and code < 0:
        return f"rank {rank} killed by signal {-code}"
    return f"rank {rank} exited with {code}"


def _read(path: str) -> tuple:
    import pickle

    with open(path, "rb") as fh:
        return pickle.load(fh)


def _forked_rank(env: dict[str, str], args: dict[str, Any], out: str) -> None:
    """One forked rank: its environment, ``_rank``'s outcome pickled to ``out`` (written aside, then renamed)."""
    import pickle
    import sys

    os.environ.clear()
    os.environ.update(env)
    code = 1
    try:
        outcome = _rank(**args)
        with open(out + ".tmp", "wb") as fh:
            pickle.dump(outcome, fh)
        os.replace(out + ".tmp", out)
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as hal.launch.entry: a broken collective must not hang interpreter teardown


def ok_values(results: dict[int, tuple], world: int) -> dict[int, Any]:
    """Every rank reported and none failed: {rank: value}; otherwise fail with that rank's traceback."""
    assert sorted(results) == list(range(world)), results
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    return {rank: outcome[1] for rank, outcome in results.items()}


def run_function_forked(target: str, world: int, kwargs: dict[str, Any] | None = None, **options: Any) -> Any:
    """``hal.launch.run_function`` called in a child of the tests' fork server, its run (or the exception it raised)
    handed back: that child imported torch and runs one thread, so its zygote is its own fork — not a fresh
    interpreter importing torch again, as it is from this (multi-threaded) process. For the code under test that
    takes a ``launch`` callable (the planner's calibration, conformance jobs); ``HAL_TEST_FORK=0``: in-process."""
    from hal.launch import run_function

    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        return run_function(target, world, kwargs, **options)
    import pickle
    import tempfile

    from .conftest import fork_server

    if options.get("echo_stderr") is not None:  # a stream cannot travel: the child echoes to its own stderr
        options = {**options, "echo_stderr": True}
    with tempfile.TemporaryDirectory(prefix="hal-run-function-") as tmp:
        out = os.path.join(tmp, "outcome.pkl")
        child = fork_server().Process(target=_call_run_function, args=(target, world, kwargs, options, out))
        child.start()
        child.join()
        if not os.path.exists(out):
            raise AssertionError(f"run_function({target!r}, {world}) in a forked child: it died ({child.exitcode})")
        with open(out, "rb") as fh:
            kind, value = pickle.load(fh)
    if kind == "error":
        raise value
    return value


def _call_run_function(target: str, world: int, kwargs: dict[str, Any] | None, options: dict[str, Any], out: str) -> None:
    import pickle
    import sys

    from hal.launch import run_function

    if options.get("echo_stderr") is True:
        options = {**options, "echo_stderr": sys.stderr}
    try:
        outcome: tuple[str, Any] = ("ok", run_function(target, world, kwargs, **options))
    except BaseException as exc:  # handed back and raised there, as run_function would have
        outcome = ("error", exc)
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # an unpicklable value or exception: said, not lost
        data = pickle.dumps(("error", AssertionError(f"run_function's outcome cannot be pickled back: {exc}: {outcome!r}")))
    with open(out + ".tmp", "wb") as fh:
        fh.write(data)
    os.replace(out + ".tmp", out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
