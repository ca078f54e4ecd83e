"""Per-phase step times: host clock reads, or device events when the phases must be measured on a device.

Why events: an accelerator runs the step asynchronously, so a host clock read only says when work was
*queued*. Synchronizing the device around every phase (the old ``--profile``) makes the clock honest but
drains the queue between phases, so the profiled step is slower than the one it describes. Device events
recorded on the current stream at each phase boundary are timestamped when the device reaches them; one
synchronization at the end of the step reads them all (``totals``).

Modes: ``host`` (the host's own clock: exact on the CPU, where work is synchronous, and the lean step's
cheap default on an accelerator, whose phases are then reported as unmeasured) and ``events``.
Intervals may overlap (the schedule contains its compute phases); each is summed under its own name.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from hal.backend import Backend

MODES = ("host", "events")


class PhaseTimer:
    """Collects (phase, start, end) intervals of one step and sums them per phase in seconds."""

    def __init__(self, backend: Backend, mode: str = "host") -> None:
        if mode not in MODES:
            raise ValueError(f"phase timer mode {mode!r}: use one of {', '.join(MODES)}")
        self.backend = backend
        self.mode = mode
        self._intervals: list[tuple[str, Any, Any]] = []
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

    def add(self, phase: str, start: Any, end: Any) -> None:
        """Count the interval between two marks under ``phase``."""
        self._intervals.append((phase, start, end))
        self.counts[phase] = self.counts.get(phase, 0) + 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the enclosed region under ``name``."""
        start = self.mark()
        try:
            yield
        finally:
            self.add(name, start, self.mark())

    def totals(self) -> dict[str, float]:
        """Seconds per phase; with events this waits (once) for the device to reach the last mark."""
        out: dict[str, float] = {}
        if not self._intervals:
            return out
        if self.mode == "events":
            latest = self.mark()
            latest.synchronize()
        for phase, start, end in self._intervals:
            seconds = end - start if self.mode == "host" else start.elapsed_time(end) / 1e3
            out[phase] = out.get(phase, 0.0) + seconds
        return out
