"""Run a function on N real processes (gloo, file:// rendezvous) and collect each rank's result.

Children report through a queue and leave with ``os._exit`` so a broken collective cannot hang
interpreter teardown; the parent kills anything still alive at the deadline, so a test never
leaves a process behind.
"""
from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Sequence


def _child(module: str, fn: str, rank: int, world: int, store: str, islands: Sequence[int] | None,
           timeout_s: float, kwargs: dict[str, Any], results: Any, backend: str | Sequence[str] = "cpu") -> None:
    try:
        from hal.collectives import init_distributed

        os.environ["LOCAL_RANK"] = str(rank)  # one device per rank, as torchrun would set it
        mine = backend if isinstance(backend, str) else backend[rank]
        init_distributed(mine, init_method=f"file://{store}", rank=rank, world_size=world,
                         timeout=datetime.timedelta(seconds=timeout_s), islands=islands)
        value = getattr(importlib.import_module(module), fn)(rank, world, **kwargs)
        results.put((rank, "ok", value))
    except BaseException as exc:  # report, never hang
        results.put((rank, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the queue's feeder thread: os._exit would drop the result
        os._exit(0)


def run_world(module: str, fn: str, world: int, *, deadline_s: float = 120, islands: Sequence[int] | None = None,
              collective_timeout_s: float = 30, backend: str | Sequence[str] = "cpu", **kwargs: Any) -> dict[int, tuple]:
    """``module.fn(rank, world, **kwargs)`` on ``world`` processes; {rank: ("ok", value) | ("error", msg, tb)}.

    ``backend``: one hal backend for every rank, or one per rank (a mixed, multi-island world).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(module, fn, r, world, store, islands, collective_timeout_s, kwargs, results, backend))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, tuple] = {}
        end = time.monotonic() + deadline_s
        while len(out) < world and time.monotonic() < end:
            try:
                rank, *rest = results.get(timeout=0.5)
                out[rank] = tuple(rest)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        if alive:
            raise AssertionError(f"{len(alive)} rank(s) still running after {deadline_s} s (killed); results so far: {out}")
    return out


def ok_values(results: dict[int, tuple], world: int) -> dict[int, Any]:
    """Every rank reported and none failed: {rank: value}; otherwise fail with that rank's traceback."""
    assert sorted(results) == list(range(world)), results
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    return {rank: outcome[1] for rank, outcome in results.items()}
