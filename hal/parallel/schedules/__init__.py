"""Pipeline schedules as data: per-stage action lists, one registry by name, and a simulator to check them."""
from __future__ import annotations

from hal.parallel.schedules.action import Action, Kind, Overlap, P2PBatch, Step, compute_actions
from hal.parallel.schedules.base import Schedule
from hal.parallel.schedules.gpipe import GPipe
from hal.parallel.schedules.interleaved import Interleaved1F1B
from hal.parallel.schedules.one_f_one_b import OneFOneB
from hal.parallel.schedules.registry import get_schedule, schedule_names
from hal.parallel.schedules.simulator import Deadlock, Simulation, Span, simulate
from hal.parallel.schedules.zero_bubble import ZeroBubbleH1

__all__ = [
    "Action", "Deadlock", "GPipe", "Interleaved1F1B", "Kind", "OneFOneB", "Overlap", "P2PBatch", "Schedule", "Simulation", "Span", "Step",
    "ZeroBubbleH1", "compute_actions", "get_schedule", "schedule_names", "simulate",
]
