"""Run a function on N real processes (gloo, file:// rendezvous) and collect each rank's result.

The ranks are hal.launch's local ranks (each in its own process group, the whole run bounded by
``deadline_s``, every rank stopped and reaped on a crash or at the deadline), so a test never
leaves a process behind. A rank's exception is its result (``("error", ...)``), not a crash.
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
        from hal.collectives import init_distributed

        mine = backend if isinstance(backend, str) else backend[rank]
        init_distributed(mine, init_method=os.environ["HAL_INIT_METHOD"], rank=rank, world_size=world,
                         timeout=datetime.timedelta(seconds=timeout_s), islands=islands)
        return ("ok", getattr(importlib.import_module(module), fn)(rank, world, **kwargs))
    except BaseException as exc:  # report, never hang
        return ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def run_world(module: str, fn: str, world: int, *, deadline_s: float = 120, islands: Sequence[int] | None = None,
              collective_timeout_s: float = 30, backend: str | Sequence[str] = "cpu", **kwargs: Any) -> dict[int, tuple]:
    """``module.fn(rank, world, **kwargs)`` on ``world`` processes; {rank: ("ok", value) | ("error", msg, tb)}.

    ``backend``: one hal backend for every rank, or one per rank (a mixed, multi-island world).
    A rank that dies (signal, exit) or a run past ``deadline_s`` fails with the launcher's report.
    """
    from hal.launch import LaunchFailed, run_function

    args = {"module": module, "fn": fn, "islands": list(islands) if islands is not None else None,
            "timeout_s": collective_timeout_s, "backend": backend if isinstance(backend, str) else list(backend),
            "kwargs": kwargs}
    try:
        run = run_function("tests.dist_harness:_rank", world, args, deadline_s=deadline_s, what=f"{module}.{fn} on {world} rank(s)")
    except LaunchFailed as exc:
        raise AssertionError(str(exc)) from None
    return dict(enumerate(run.values))


def ok_values(results: dict[int, tuple], world: int) -> dict[int, Any]:
    """Every rank reported and none failed: {rank: value}; otherwise fail with that rank's traceback."""
    assert sorted(results) == list(range(world)), results
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    return {rank: outcome[1] for rank, outcome in results.items()}
