"""Per-phase step times: host clock reads, or device events when the phases must be measured on a device.

Why events: an accelerator runs the step asynchronously, so a host clock read only says when work was
*queued*. Synchronizing the device around every phase (the old ``--profile``) makes the clock honest but
drains the queue between phases, so the profiled step is slower than the one it describes. Device events
recorded on the current stream at each phase boundary are timestamped when the device reaches them; one
synchronization at the end of the step reads them all (``totals``).

Modes: ``host`` (the host's own clock: exact on the CPU, where work is synchronous, and the lean step's
cheap default on an accelerator, whose phases are then reported as unmeasured) and ``events``.
Intervals may overlap (the schedule contains its compute phases); each is summed under its own name.
An interval may carry a label (the engine hands in the schedule action it runs, a reference it holds
anyway): ``spans`` lists the labelled intervals against one mark, read with the same single wait,
which is what the profiled step's timeline (``parallel.observe.timeline``) is drawn from.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, NamedTuple

from hal.backend import Backend

MODES = ("host", "events")


class TimedSpan(NamedTuple):
    """One labelled interval, in seconds after the mark ``spans`` was given."""

    phase: str
    label: Any
    start: float
    end: float


class PhaseTimer:
    """Collects (phase, start, end) intervals of one step and sums them per phase in seconds."""

    def __init__(self, backend: Backend, mode: str = "host") -> None:
        if mode not in MODES:
            raise ValueError(f"phase timer mode {mode!r}: use one of {', '.join(MODES)}")
        self.backend = backend
        self.mode = mode
        self._intervals: list[tuple[str, Any, Any, Any]] = []
        self.counts: dict[str, int] = {}

    def reset(self) -> None:
        """Forget the intervals collected so far (marks already handed out stay valid)."""
        self._intervals.clear()
        self.counts = {}

    def mark(self) -> Any:
        """A point in the step: an event recorded on the current stream, or the host clock."""
        if self.mode == "host":
            return time.perf_counter()
        event = self.backend.Event(enable_timing=True)
        event.record(self.backend.current_stream())
        return event

    def add(self, phase: str, start: Any, end: Any, label: Any = None) -> None:
        """Count the interval between two marks under ``phase`` (``label``: what ran, for ``spans``)."""
        self._intervals.append((phase, start, end, label))
        self.counts[phase] = self.counts.get(phase, 0) + 1

    @contextlib.contextmanager
    def phase(self, name: str, label: Any = None) -> Iterator[None]:
        """Count the enclosed region under ``name``."""
        start = self.mark()
        try:
            yield
        finally:
            self.add(name, start, self.mark(), label)

    def totals(self) -> dict[str, float]:
        """Seconds per phase; with events this waits (once) for the device to reach the last mark."""
        out: dict[str, float] = {}
        if not self._intervals:
            return out
        self._wait()
        for phase, start, end, _ in self._intervals:
            out[phase] = out.get(phase, 0.0) + self._seconds(start, end)
        return out

    def spans(self, origin: Any, labelled_only: bool = True) -> list[TimedSpan]:
        """The intervals (by default the labelled ones) in the order they began, as seconds after ``origin``.

        ``origin`` is a mark of this step (the engine's schedule start); with events this waits once,
        as ``totals`` does, and reads each event's time against it, so no phase was synchronized.
        """
        chosen = [i for i in self._intervals if i[3] is not None or not labelled_only]
        if not chosen:
            return []
        self._wait()
        out = [TimedSpan(phase, label, self._seconds(origin, start), self._seconds(origin, end))
               for phase, start, end, label in chosen]
        return sorted(out, key=lambda span: span.start)

    def _wait(self) -> None:
        """With events: wait until the device reached every mark handed out so far (one synchronization)."""
        if self.mode == "events":
            self.mark().synchronize()

    def _seconds(self, start: Any, end: Any) -> float:
        return float(end - start) if self.mode == "host" else start.elapsed_time(end) / 1e3
