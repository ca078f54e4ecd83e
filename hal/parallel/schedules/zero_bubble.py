"""Zero-bubble ZB-H1 (arXiv 2401.10241): 1F1B's memory, every backward split into I and W, W filling the bubbles.

The input-gradient half ``I`` is what the previous stage waits for; the weight-gradient half ``W``
is waited for by nobody, so a stage can run it whenever it would otherwise idle. The order is
found by playing the pipeline with equal F, I and W times (the paper's assumption; the engine's
layers are close to it) under three rules, at each moment a stage is free:

1. run the earliest ``I`` whose gradient has arrived (it unblocks the previous stage);
2. else the next ``F`` whose input has arrived, if fewer than S - s micro-batches are in flight here
   (forwarded, W not done): 1F1B's bound, so peak activation memory stays 1F1B's;
3. else a pending ``W`` (instead of idling).

At S = 4, M = 8 that is 30 time units against 1F1B's 33 (bubble 0.20 against 0.27); the paper's
hand-made ZB-H1 reaches 27 by holding more W halves back, which costs memory this rule refuses.
The orders are fixed per (S, M), deadlock-free by construction (the play is the proof), and the
sends and receives are 1F1B's: a compute's send shares a batch with the next compute's receive when
they cross the same boundary (F then I; I then F), the neighbour posting the mirror batch.

Played with measured times instead (``timed``: per-stage F, I, W and per-link transfer seconds), the same
rules see when each input really arrives, and rule 3 may run a ``W`` only where it fits before the next input
(or nothing else is coming), so the stage's own ``W`` does not delay an ``I`` a slower neighbour waits for;
which stages wait so is chosen by simulating the variants and the unit order with the times (``fastest``).
Such an order's transfers are derived by playing it in rounds (``interleaved.tick_program``), which pairs
any order's sends and receives safely, where the fused batches above hold only for the unit order's shape.
"""
from __future__ import annotations

import functools
import math

from hal.parallel.schedules.action import Action, Kind, Step
from hal.parallel.schedules.base import Schedule, _check
from hal.parallel.schedules.fastest import fastest
from hal.parallel.schedules.stage_times import StageTimes, fit_variants, unit_times


class ZeroBubbleH1(Schedule):
    name = "zero-bubble"
    splits_backward = True
    bubble_divisor = 3.0
    torch_class = "ScheduleInterleavedZeroBubble"  # torch has no flat ZB-H1: its interleaved one at one chunk
    plays_times = True

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 1,
                      ) -> list[Action]:
        return list(_orders(num_stages, num_micro_batches, self.times)[stage])

    def program(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 1) -> list[Step]:
        if self.times is None:
            return super().program(num_stages, num_micro_batches, stage, virtual_stages)
        from hal.parallel.schedules.interleaved import tick_program  # interleaved imports this module's base

        _check(num_stages, num_micro_batches, stage)
        if virtual_stages != 1:
            raise ValueError(f"schedule {self.name!r} runs one chunk per stage; virtual_stages {virtual_stages} needs "
                             "an interleaved schedule (interleaved-zero-bubble)")
        return list(tick_program(self, num_stages, num_micro_batches, 1)[stage])

    def fuses(self, num_stages: int, num_micro_batches: int, stage: int, index: int) -> bool:
        order = _orders(num_stages, num_micro_batches, self.times)[stage]
        pair = (order[index].kind, order[index + 1].kind) if index + 1 < len(order) else None
        return pair in ((Kind.FORWARD, Kind.BACKWARD_INPUT), (Kind.BACKWARD_INPUT, Kind.FORWARD))


@functools.lru_cache(maxsize=64)
def _orders(S: int, M: int, times: StageTimes | None = None) -> tuple[tuple[Action, ...], ...]:
    """Every stage's compute order: the unit-time play, or with ``times`` the fastest in simulation of it and
    the plays with those times (``fastest``, over ``fit_variants``)."""
    if times is None:
        return _play(S, M, unit_times(S), (False,) * S)
    if times.num_stages != S or times.chunks != 1:
        raise ValueError(f"zero-bubble: stage times for {times.num_stages} stages x {times.chunks} chunks, the plan has "
                         f"{S} stages x 1 chunk")
    return fastest([_orders(S, M)] + [_play(S, M, times, fit) for fit in fit_variants(times)], times, 1, "loop")


def _play(S: int, M: int, cost: StageTimes, fit: tuple[bool, ...]) -> tuple[tuple[Action, ...], ...]:
    """The play under the module's rules with ``cost``'s times; ``fit[s]``: stage s runs a ``W`` only where it
    ends before its next input arrives."""
    done: dict[tuple[Kind, int, int], float] = {}
    free = [0.0] * S
    next_f, next_i, next_w = [0] * S, [0] * S, [0] * S
    orders: list[list[Action]] = [[] for _ in range(S)]
    # A stage's pick depends on its own state and on what its neighbours made: after an action only the acting
    # stage and its neighbours pick again (the same orders as re-picking every stage, S / 3 times faster).
    picks: list[tuple[float, Kind, int] | None] = [None] * S
    stale = set(range(S))
    while sum(next_w) < S * M:
        for s in stale:
            picks[s] = _pick(s, S, M, free[s], done, next_f[s], next_i[s], next_w[s], cost, fit[s])
        stale.clear()
        candidates = [(p[0], s) for s, p in enumerate(picks) if p is not None]
        assert candidates, "zero-bubble order: no stage can progress (a bug in the rules)"
        start, s = min(candidates)  # the earliest start; the lowest stage on a tie
        _, kind, m = picks[s]  # type: ignore[misc]
        stale.update(t for t in (s - 1, s, s + 1) if 0 <= t < S)
        done[(kind, m, s)] = free[s] = start + cost.cost(kind, s)
        if kind is Kind.FORWARD:
            next_f[s] += 1
        elif kind is Kind.BACKWARD_INPUT:
            next_i[s] += 1
        else:
            next_w[s] += 1
        orders[s].append(Action(kind, m))
    return tuple(tuple(o) for o in orders)


def _pick(s: int, S: int, M: int, now: float, done: dict[tuple[Kind, int, int], float], f: int, i: int, w: int,
          times: StageTimes, fit: bool) -> tuple[float, Kind, int] | None:
    """Stage s's next action and when it can start (None: nothing it can do is known to become ready)."""
    ready: list[tuple[float, int, Kind, int]] = []  # (start, rule, kind, micro-batch)
    if i < f:  # rule 1: the gradient of micro-batch i from the next stage (own forward done)
        arrives = (done[(Kind.FORWARD, i, s)] if s == S - 1
                   else done.get((Kind.BACKWARD_INPUT, i, s + 1), math.inf) + times.hop(s + 1, s))
        ready.append((max(now, arrives), 1, Kind.BACKWARD_INPUT, i))
    if f < M and f - w < S - s:  # rule 2: 1F1B's in-flight bound
        arrives = 0.0 if s == 0 else done.get((Kind.FORWARD, f, s - 1), math.inf) + times.hop(s - 1, s)
        ready.append((max(now, arrives), 2, Kind.FORWARD, f))
    runnable = [r for r in ready if r[0] <= now]
    if runnable:
        start, _, kind, m = min(runnable, key=lambda r: r[1])
        return start, kind, m
    waiting = [r for r in ready if r[0] < math.inf]
    soonest = min(waiting, key=lambda r: (r[0], r[1])) if waiting else None
    # rule 3: fill the gap with a weight-gradient half (``fit``: only one that ends before the next input is there)
    if w < i and (not fit or soonest is None or now + times.cost(Kind.BACKWARD_WEIGHT, s) <= soonest[0]):
        return now, Kind.BACKWARD_WEIGHT, w
    if soonest is None:
        return None
    start, _, kind, m = soonest
    return start, kind, m
