"""The one table of schedules by name: the plan validates against it and the engine runs from it."""
from __future__ import annotations

from hal.parallel.schedules.base import Schedule
from hal.parallel.schedules.dualpipev import DualPipeV
from hal.parallel.schedules.gpipe import GPipe
from hal.parallel.schedules.interleaved import Interleaved1F1B, InterleavedZeroBubble
from hal.parallel.schedules.one_f_one_b import OneFOneB
from hal.parallel.schedules.zbv import ZeroBubbleV
from hal.parallel.schedules.zero_bubble import ZeroBubbleH1

_SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1, InterleavedZeroBubble,
                                                                  ZeroBubbleV, DualPipeV)}


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule's name, in registration order (the order error messages list them)."""
    return tuple(_SCHEDULES)


def get_schedule(name: str) -> Schedule:
    """The schedule called ``name``; ValueError naming the known ones otherwise."""
    if name not in _SCHEDULES:
        raise ValueError(f"schedule {name!r} is unknown; use one of {', '.join(_SCHEDULES)}")
    return _SCHEDULES[name]()
