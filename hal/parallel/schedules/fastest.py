"""Pick, among candidate orders of one schedule, the one the simulator plays fastest with the measured times.

Why: a list scheduler decides greedily, one free stage at a time, and a greedy rule that helps one plan (wait
for a late input instead of starting a ``W``) hurts another (the busiest stage then idles). The zero-bubble
paper tries several warm-up variants and keeps the best; here every candidate — the unit-time order among them
— is played through the simulator with the same times, so a measured order is never predicted slower than
the unit one.
"""
from __future__ import annotations

from typing import Sequence

from hal.parallel.schedules.action import Action
from hal.parallel.schedules.base import Schedule
from hal.parallel.schedules.simulator import simulate
from hal.parallel.schedules.stage_times import StageTimes

Orders = tuple[tuple[Action, ...], ...]


def fastest(candidates: Sequence[Orders], times: StageTimes, virtual_stages: int, placement: str) -> Orders:
    """The candidate with the shortest simulated step (the first on a tie: list the unit order first)."""
    S, M = times.num_stages, 0
    best: tuple[float, Orders] | None = None
    for orders in candidates:
        M = max(a.micro_batch for o in orders for a in o) + 1
        span = simulate({s: list(orders[s]) for s in range(S)}, S, M, times=times, virtual_stages=virtual_stages,
                        placement=placement).makespan
        if best is None or span < best[0] - 1e-12:
            best = (span, orders)
    assert best is not None, "fastest: no candidate orders"
    return best[1]


def measured_or_unit(schedule: Schedule, times: StageTimes, micro_batches: int) -> tuple[Schedule, float, float]:
    """``schedule`` played from ``times`` where the simulator finds that order faster on those times, else the unit
    order: (the schedule to run, unit order's simulated step, measured order's). What ``hal train`` runs after its
    calibration and what the planner predicts for a plan that will calibrate."""
    S, V = times.num_stages, times.chunks
    unit = schedule.timed(None)
    timed = unit.timed(times)
    unit_s = simulate(unit, S, micro_batches, times=times, virtual_stages=V).makespan
    measured_s = simulate(timed, S, micro_batches, times=times, virtual_stages=V).makespan
    same = all(unit.compute_order(S, micro_batches, s, V) == timed.compute_order(S, micro_batches, s, V) for s in range(S))
    return (timed if measured_s < unit_s and not same else unit), unit_s, measured_s
