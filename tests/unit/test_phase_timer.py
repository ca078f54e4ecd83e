"""The step's phase timer: intervals summed per phase, by host clock or by (host) device events."""
from __future__ import annotations

import time

import pytest

from hal.backends.cpu import CpuBackend
from hal.parallel.observe.phase_timer import PhaseTimer


@pytest.mark.parametrize("mode", ["host", "events"])
def test_overlapping_phases_are_summed_under_their_own_names(mode: str) -> None:
    timer = PhaseTimer(CpuBackend(), mode)
    outer = timer.mark()
    for _ in range(2):
        with timer.phase("compute"):
            time.sleep(0.02)
    with timer.phase("p2p"):
        pass
    timer.add("schedule", outer, timer.mark())
    totals = timer.totals()
    assert timer.counts == {"compute": 2, "p2p": 1, "schedule": 1}
    assert 0.04 <= totals["compute"] < totals["schedule"]
    assert 0.0 <= totals["p2p"] < 0.02


def test_reset_forgets_intervals_but_keeps_marks_usable() -> None:
    timer = PhaseTimer(CpuBackend(), "events")
    start = timer.mark()
    with timer.phase("compute"):
        time.sleep(0.01)
    timer.reset()
    assert timer.totals() == {} and timer.counts == {}
    timer.add("step", start, timer.mark())
    assert timer.totals()["step"] >= 0.01


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="use one of host, events"):
        PhaseTimer(CpuBackend(), "sync")
