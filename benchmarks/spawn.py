"""The benchmarks' rank API, on hal.launch: ``launch_ranks(rank_main, world_size, opts, timeout_s)``.

Each rank runs ``rank_main(rank, world_size, store_path, opts)`` and returns a JSON-able dict. The
ranks are hal.launch's local ranks (own process groups, the deadline, every rank stopped on the
first failure); ``rank_main`` travels by name, so it must be a module-level function of an
importable module (a benchmark run as a script is found as ``benchmarks.<script>``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

RankMain = Callable[[int, int, str, dict[str, Any]], dict[str, Any]]


def _name(fn: RankMain) -> str:
    module = fn.__module__
    if module == "__main__":  # ``python benchmarks/x.py``: the ranks import it as benchmarks.x
        path = Path(sys.modules["__main__"].__file__ or "").resolve()
        module = f"{path.parent.name}.{path.stem}"
    return f"{module}:{fn.__qualname__}"


def _rank(target: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank (run by hal.launch.entry): the benchmark's rank function with its place in the world."""
    from hal.launch.names import resolve

    store = os.environ["HAL_INIT_METHOD"].removeprefix("file://")
    return resolve(target, "rank function")(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), store, opts)


def launch_ranks(rank_main: RankMain, world_size: int, opts: dict[str, Any], timeout_s: float,
                 backend: str | None = None) -> dict[int, dict[str, Any]]:
    """Run ``world_size`` ranks; {rank: report}, or {rank: {"error": its fate}} for each rank that did not end ok.

    ``backend``: every rank's backend where they share one (cpu ranks then fork from one interpreter that imported
    torch, as hal train's do, instead of each starting its own)."""
    from hal.launch import LaunchFailed, run_function

    try:
        run = run_function("benchmarks.spawn:_rank", world_size, {"target": _name(rank_main), "opts": opts},
                           deadline_s=timeout_s, what="benchmark", echo_stderr=sys.stderr,
                           env={"HAL_BACKEND": backend} if backend else None)
    except LaunchFailed as exc:
        return {f.rank: {"error": line} for f, line in exc.report.entries()} or {0: {"error": str(exc)}}
    return dict(enumerate(run.values))


def failures(reports: dict[int, dict[str, Any]], world_size: int, timeout_s: float) -> list[str]:
    """Lines describing ranks that failed or never reported (empty when every rank succeeded)."""
    lines = [f"--- rank {r} failed:\n{rep['error']}" for r, rep in sorted(reports.items()) if "error" in rep]
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        lines.append(f"ranks {missing} did not report (crashed, or the run passed --timeout {timeout_s:g} s)")
    return lines
