"""Start one process per rank for a benchmark, collect each rank's report, leave nothing running.

Each rank runs ``rank_main(rank, world_size, store_path, opts)`` and returns a JSON-able dict
(or raises: the traceback comes back as ``{"error": ...}``). Used by the benchmarks that need
their own world (``bridge.py``, ``pipeline.py``); the torch.multiprocessing spawn context keeps
CUDA usable in the children.
"""
from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

RankMain = Callable[[int, int, str, dict[str, Any]], dict[str, Any]]


def _child(rank_main: RankMain, rank: int, world_size: int, store: str, opts: dict[str, Any], results: Any) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # one device per rank, as torchrun would pin it
    try:
        results.put((rank, rank_main(rank, world_size, store, opts)))
    except BaseException:  # noqa: BLE001 - the parent prints it and stops the others
        results.put((rank, {"error": traceback.format_exc()}))


def launch_ranks(rank_main: RankMain, world_size: int, opts: dict[str, Any], timeout_s: float) -> dict[int, dict[str, Any]]:
    """Spawn ``world_size`` ranks; return {rank: report}. Stops all of them on error or timeout."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="hal-bench-")
    store = os.path.join(tmp, "store")
    procs = [ctx.Process(target=_child, args=(rank_main, r, world_size, store, opts, results), daemon=True)
             for r in range(world_size)]
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(reports) < world_size and time.monotonic() < deadline:
            try:
                rank, report = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank died without reporting (killed, segfault)
                continue
            reports[rank] = report
            if "error" in report:
                deadline = min(deadline, time.monotonic() + 5)  # give the others a moment to report theirs
    finally:
        stop(procs)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return reports


def stop(procs: list[Any]) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def failures(reports: dict[int, dict[str, Any]], world_size: int, timeout_s: float) -> list[str]:
    """Lines describing ranks that failed or never reported (empty when every rank succeeded)."""
    lines = [f"--- rank {r} failed:\n{rep['error']}" for r, rep in sorted(reports.items()) if "error" in rep]
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        lines.append(f"ranks {missing} did not report (crashed, or the run passed --timeout {timeout_s:g} s)")
    return lines
