"""Pipeline schedules as data: per-stage action lists, one registry by name, and a simulator to check them."""
from __future__ import annotations

from .action import Action, Kind, P2PBatch, Step
from .base import Schedule
from .gpipe import GPipe
from .interleaved import Interleaved1F1B
from .one_f_one_b import OneFOneB
from .registry import get_schedule, schedule_names
from .simulator import Deadlock, Simulation, Span, simulate
from .zero_bubble import ZeroBubbleH1

__all__ = [
    "Action", "Deadlock", "GPipe", "Interleaved1F1B", "Kind", "OneFOneB", "P2PBatch", "Schedule", "Simulation", "Span", "Step",
    "ZeroBubbleH1", "get_schedule", "schedule_names", "simulate",
]
