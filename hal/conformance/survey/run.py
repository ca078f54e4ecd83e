"""The survey's driver: every op of the cohort on the backend's device, in ``jobs`` worker processes, with progress.

A worker surveys whole ops (every dtype of one op), the slowest ops first so the last minute is not one long op. It
says which pair it starts before it starts it, so a pair that kills its process (a device runtime's abort, a
segmentation fault) or outlasts ``pair_timeout`` is recorded as ``raised`` with how the process ended, the op's
remaining dtypes as ``untested``, and a fresh worker carries on: a bring-up device that crashes on one operator
still gets its census. Workers on the host or a host-backed stand-in are forked (``op_db`` is imported once, and
what the parent planted in the stand-in is inherited); on an accelerator they are spawned, as a device runtime does
not survive a fork.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import torch

from hal.conformance.verdicts.host_watch import watcher

from . import cohort as C
from .pair import Finding, Settings, survey_pair

# ops that take seconds where the rest take milliseconds: started first
_SLOW_FIRST = ("grid_sampler_3d", "masked.norm", "masked.log_softmax", "nn.functional.ctc_loss", "stft")
PAIR_TIMEOUT_S = 300.0


@dataclass
class _Worker:
    op_db: list[Any]
    device: torch.device
    settings: Settings
    watch: Callable[[int], Any]
    pairs: dict[int, list[C.Pair]]


def _serve(conn: Any, backend_name: str, settings: Settings, pairs: dict[int, list[C.Pair]], threads: int) -> None:
    """A worker: load the backend and ``op_db``, then survey each op index received until None."""
    from hal.backend_registry import get_backend

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")  # op_db's deprecated ops warn on every call; the watch records its own
    backend = get_backend(backend_name)
    backend.set_device(0)
    w = _Worker(C.load_op_db(), backend.device(0), settings, watcher(backend.host_transfer_bytes), pairs)
    golden = {torch.float64, torch.complex128}  # the references run on the host, which computes in both
    conn.send(("ready", None))
    while (op_index := conn.recv()) is not None:
        op = w.op_db[op_index]
        for p in w.pairs[op_index]:
            conn.send(("start", p.dtype))
            try:
                f = survey_pair(op, C.DTYPES[p.dtype], w.device, w.settings, p.family, w.watch, golden)
            except Exception as exc:  # noqa: BLE001 - the survey's own bug for one pair must not end the census
                f = Finding(p.name, p.family, p.dtype, "untested",
                            detail=f"the survey itself raised: {type(exc).__name__}: {exc}"[:300])
            conn.send(("done", f.to_dict()))
        conn.send(("op", op_index))


class Progress:
    """One line on stderr at most every ``every`` seconds: pairs done, time, and the findings that are not passes."""

    def __init__(self, total: int, stream: TextIO | None = None, every: float = 2.0) -> None:
        self.total, self.done, self.stream, self.every = total, 0, stream or sys.stderr, every
        self.started = self.last = time.monotonic()
        self.counts: dict[str, int] = {}

    def add(self, finding: dict[str, Any]) -> None:
        self.done += 1
        self.counts[finding["status"]] = self.counts.get(finding["status"], 0) + 1
        now = time.monotonic()
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            others = " · ".join(f"{k} {v}" for k, v in sorted(self.counts.items()) if k != "pass")
            print(f"survey: {self.done}/{self.total} (op, dtype) pairs · {now - self.started:.0f} s"
                  + (f" · {others}" if others else ""), file=self.stream, flush=True)


class _Slot:
    """One worker process and what it is doing: the op it holds, the pair it started and when."""

    def __init__(self, ctx: Any, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, *args), daemon=True)
        self.process.start()
        child.close()
        self.op: int | None = None
        self.pair: str | None = None
        self.since = time.monotonic()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def _ended(process: Any) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def survey(backend_name: str, cohort: C.Cohort, jobs: int, *, progress: Progress | None = None,
           host_device: bool = True, pair_timeout: float = PAIR_TIMEOUT_S) -> list[dict[str, Any]]:
    """The findings of every pair of ``cohort`` (in the cohort's order), surveyed by ``jobs`` processes."""
    by_op: dict[int, list[C.Pair]] = {}
    for p in cohort.pairs:
        by_op.setdefault(p.op_index, []).append(p)
    queue = sorted(by_op, key=lambda i: (by_op[i][0].name not in _SLOW_FIRST, i))
    found: dict[int, list[dict[str, Any]]] = {i: [] for i in by_op}
    ctx = multiprocessing.get_context("fork" if host_device else "spawn")
    args = (backend_name, cohort.settings, by_op, 1 if jobs > 1 else torch.get_num_threads())
    slots = [_Slot(ctx, args) for _ in range(min(jobs, len(queue)) or 1)]

    def record(op: int, finding: dict[str, Any]) -> None:
        found[op].append(finding)
        if progress:
            progress.add(finding)

    def give(slot: _Slot) -> None:
        slot.op = queue.pop(0) if queue else None
        slot.pair, slot.since = None, time.monotonic()
        if slot.op is not None:
            slot.conn.send(slot.op)

    def lost(slot: _Slot, how: str) -> _Slot:
        """The worker died or hung on ``slot.op``: the pair it was on raised, the op's other dtypes untested."""
        op = slot.op
        assert op is not None
        done = {f["dtype"] for f in found[op]}
        for p in by_op[op]:
            if p.dtype in done:
                continue
            if p.dtype == slot.pair:
                record(op, Finding(p.name, p.family, p.dtype, "raised", detail=how).to_dict())
            else:
                record(op, Finding(p.name, p.family, p.dtype, "untested",
                                   detail=f"not run: the process surveying this op ended on {slot.pair} ({how})").to_dict())
        slot.stop()
        fresh = _Slot(ctx, args)
        fresh.op = None
        return fresh

    every = list(slots)
    busy = list(slots)

    def handle(slot: _Slot, kind: str, value: Any) -> None:
        if kind == "ready" or kind == "op":
            give(slot)
            if slot.op is None:  # nothing left: the worker is told to end
                slot.conn.send(None)
                slot.process.join(timeout=30)
                busy.remove(slot)
        elif kind == "start":
            slot.pair, slot.since = value, time.monotonic()
        elif kind == "done":
            assert slot.op is not None
            record(slot.op, value)
            slot.pair = None

    def replace(slot: _Slot, how: str) -> None:
        if slot.op is None:
            raise RuntimeError(f"a survey worker ended before taking work ({how})")
        fresh = lost(slot, how)
        every.append(fresh)
        busy[busy.index(slot)] = fresh

    try:
        while busy:
            waiting: dict[Any, _Slot] = {s.conn: s for s in busy}
            waiting.update({s.process.sentinel: s for s in busy})
            for handle_ in multiprocessing.connection.wait(list(waiting), timeout=5.0):
                slot = waiting[handle_]
                if slot not in busy:
                    continue
                try:
                    while slot in busy and slot.conn.poll():  # every message it sent, before judging its end
                        handle(slot, *slot.conn.recv())
                except (EOFError, OSError):
                    pass
                if slot in busy and not slot.process.is_alive():
                    slot.process.join(timeout=5)
                    replace(slot, f"the process died while running it ({_ended(slot.process)})")
            now = time.monotonic()
            for slot in list(busy):
                if slot.pair is not None and now - slot.since > pair_timeout:
                    replace(slot, f"did not finish within {pair_timeout:.0f} s (killed)")
    finally:
        for slot in every:
            slot.stop()
    return [f for i in sorted(found) for f in sorted(found[i], key=lambda f: [p.dtype for p in by_op[i]].index(f["dtype"]))]
