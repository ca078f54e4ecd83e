"""``rows: auto``: each replica's share of the step set from its measured speed, by a short calibration at start.

Every replica with ``rows: auto`` times a few forward/backward steps of its own plan on random tokens (gradients
dropped, weights untouched; the first step is a warm-up), and reports rows per second; every rank gathers the
figures (one small gather over the world) and computes the same shares (``parallel.config.replicas.shares_by_speed``:
whole micro-batches each replica's schedule runs, adding up to the global batch; the config's check proved a split
exists). A replica with fixed rows keeps them.

During the run (``rebalanced_rows``), the auto replicas' shares follow their measured step times: every
``replica_sync.rebalance_every`` steps, within bounds, each change said on screen and in the log. With every-step sync the
training does not depend on the shares (the step's gradient is the token-weighted mean over all rows), so a
rebalance changes the speed, not the numbers.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.replicas import ReplicatedPlan, shares_by_speed

CALIBRATION_STEPS = 3  # timed steps after one warm-up


def rows_per_second(engine: Any, plan: ParallelPlan, seq: int, vocab: int, steps: int = CALIBRATION_STEPS) -> float:
    """This replica's training speed in rows a second: the median of ``steps`` timed forward/backward steps (after one
    warm-up) of ``engine`` on random tokens. Every rank of the replica calls it; the gradients are dropped."""
    generator = torch.Generator().manual_seed(12345)
    tokens = torch.randint(0, vocab, (plan.micro_batches, plan.micro_batch_size, seq + 1), generator=generator)
    times = []
    for index in range(steps + 1):
        began = time.perf_counter()
        engine.step(tokens)
        engine.backend.synchronize()
        if index:
            times.append(time.perf_counter() - began)
        for p in engine.module.parameters():
            p.grad = None
    engine.module.take_moe_tally()  # the calibration's routing is not the first step's load
    return plan.global_batch_size / statistics.median(times)


def resolve_shares(replicas: ReplicatedPlan, replica: int, measure: Callable[[], float], speaks: bool,
                   say: Callable[[str], None] | None = None) -> ReplicatedPlan:
    """The replicas with every ``auto`` replaced by rows from measured speed. Collective over the world: every rank
    calls it; ``measure()`` runs on the ranks of auto replicas (all of a replica's ranks: it steps the engine);
    ``speaks``: this rank reports its replica's figure (one rank a replica). ``say``: where the shares are told."""
    mine = measure() if replicas.replicas[replica].rows is None else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (replica, mine) if speaks else None)
    speeds = [0.0] * len(replicas.replicas)
    for entry in everyone:
        if entry is not None and entry[1] is not None:
            speeds[entry[0]] = float(entry[1])
    rows = shares_by_speed(replicas, speeds)
    if say is not None:
        parts = [f"replica {i}: {n} rows" + (f" ({speeds[i]:.1f} rows/s measured)" if r.rows is None else " (fixed)")
                 for i, (n, r) in enumerate(zip(rows, replicas.replicas))]
        say(f"replica shares by measured speed ({CALIBRATION_STEPS} calibration steps each): " + "; ".join(parts))
    return replicas.with_rows(rows)


# --- speed drift: the shares re-balanced from measured step times --------------------------------------------

MAX_CHANGE = 0.25  # a look moves at most this share of a replica's rows (at least one granule)
MIN_GAIN = 0.05  # and only when the slowest replica's predicted time drops by this much (no flapping on noise)


def rebalanced_rows(rows: Sequence[int], seconds: Sequence[float], granules: Sequence[int], movable: Sequence[bool],
                    valid: Callable[[int, int], bool], *, max_change: float = MAX_CHANGE,
                    min_gain: float = MIN_GAIN) -> list[int] | None:
    """New rows from each replica's measured seconds a step at ``rows`` (speed = rows / seconds), or None to keep them.

    Rows move whole granules at a time (the lcm of the two replicas' micro_batch_sizes) from the replica predicted
    slowest to the one predicted fastest, while that shortens the slowest; only ``movable`` replicas (``rows:
    auto``) change, each by at most ``max_change`` of its rows (one granule at least), never below one granule,
    and only to rows ``valid(replica, rows)`` accepts (its schedule runs that many micro-batches). None unless the
    slowest replica's predicted time drops by ``min_gain``."""
    if len(rows) < 2 or any(s <= 0 or not math.isfinite(s) for s in seconds):
        return None
    speed = [n / s for n, s in zip(rows, seconds)]
    new = list(rows)
    bound = [max(g, int(max_change * n)) for n, g in zip(rows, granules)]

    def slowest(candidate: Sequence[int]) -> float:
        return max(n / v for n, v in zip(candidate, speed))

    while True:
        times = [n / v for n, v in zip(new, speed)]
        best: tuple[float, list[int]] | None = None
        for slow in sorted(range(len(new)), key=lambda i: -times[i]):
            for fast in sorted(range(len(new)), key=lambda i: times[i]):
                if slow == fast or not (movable[slow] and movable[fast]):
                    continue
                step = math.lcm(granules[slow], granules[fast])
                trial = list(new)
                trial[slow] -= step
                trial[fast] += step
                if (trial[slow] < granules[slow] or abs(trial[slow] - rows[slow]) > bound[slow]
                        or abs(trial[fast] - rows[fast]) > bound[fast]
                        or not valid(slow, trial[slow]) or not valid(fast, trial[fast])):
                    continue
                after = slowest(trial)
                if after < slowest(new) - 1e-12 and (best is None or after < best[0]):
                    best = (after, trial)
            if best is not None:
                break
        if best is None:
            break
        new = best[1]
    if new == list(rows) or slowest(new) > (1.0 - min_gain) * slowest(rows):
        return None
    return new


def drag_note(rows: Sequence[int], own_s: Sequence[float], step_s: float) -> str | None:
    """A line when the fastest replica alone would step faster than all of them together (the slower islands and the
    cross-island sync cost more than their rows save), else None. ``own_s``: each replica's own time a step at
    ``rows`` (before the exchange); ``step_s``: the whole step's."""
    if len(rows) < 2 or not all(s > 0 and math.isfinite(s) for s in (*own_s, step_s)):
        return None
    speeds = [n / s for n, s in zip(rows, own_s)]
    fast = max(range(len(rows)), key=lambda i: speeds[i])
    alone_s = sum(rows) / speeds[fast]
    if alone_s >= 0.95 * step_s:
        return None
    others = ", ".join(str(i) for i in range(len(rows)) if i != fast)
    return (f"replica {fast} alone would step in about {alone_s:.3g} s (its measured speed, no cross-island sync) "
            f"against {step_s:.3g} s with replica(s) {others}: they slow this job; drop them from the plan "
            "(hal plan --search prices both)")


class ShareTracker:
    """A rank's side of the mid-run rebalance: its replica's step times over the window, and the collective look."""

    def __init__(self, movable: Sequence[bool], every: int) -> None:
        self.movable, self.every = list(movable), every
        self.window: list[tuple[float, float]] = []
        self.warned = False  # the drag note is said once

    def record(self, own_s: float, step_s: float) -> None:
        """This rank's own time of a step (its engine's forward/backward, before the cross-replica exchange) and the
        whole step's."""
        self.window.append((own_s, step_s))

    def due(self, done: int, steps: int) -> bool:
        return self.every > 0 and done % self.every == 0 and done < steps

    def look(self, replicas: ReplicatedPlan, replica: int) -> tuple[ReplicatedPlan | None, str | None]:
        """The replicas with re-balanced rows (None to keep them), and a note the first time the fastest replica alone
        would be faster (``drag_note``). Collective over the world: each replica's time is its slowest rank's median
        over the window (one small gather)."""
        mine = tuple(statistics.median(x) for x in zip(*self.window)) if self.window else (math.nan, math.nan)
        self.window.clear()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (replica, *mine))
        seconds = [0.0] * len(replicas.replicas)
        step_s = 0.0
        for r, own, whole in everyone:
            seconds[r] = max(seconds[r], own) if math.isfinite(own) and math.isfinite(seconds[r]) else math.nan
            step_s = max(step_s, whole) if math.isfinite(whole) and math.isfinite(step_s) else math.nan
        rows = [r.rows or 0 for r in replicas.replicas]
        granules = [r.plan.micro_batch_size for r in replicas.replicas]

        def valid(i: int, n: int) -> bool:
            plan = replicas.replicas[i].plan
            return n % plan.micro_batch_size == 0 and plan.schedule.problem(plan.num_stages, n // plan.micro_batch_size) is None

        note = None if self.warned else drag_note(rows, seconds, step_s)
        self.warned = self.warned or note is not None
        new = rebalanced_rows(rows, seconds, granules, self.movable, valid)
        return (None if new is None else replicas.with_rows(new)), note


def rebalance_text(before: ReplicatedPlan, after: ReplicatedPlan, step: int) -> str:
    """One line saying a rebalance: each replica's rows before and after."""
    parts = [f"replica {i}: {a.rows} → {b.rows} rows" for i, (a, b) in enumerate(zip(before.replicas, after.replicas))]
    return f"step {step}: replica shares re-balanced from measured step times: " + "; ".join(parts)
