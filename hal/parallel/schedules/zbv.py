"""ZB-V (arXiv 2401.10241 §6): two chunks a stage in a V, every backward split into I and W.

Stage s holds virtual stages ``s`` and ``2S - 1 - s`` (``placement``: "v"): a micro-batch goes down
the stages through their first chunks and comes back up through their second ones, so the first
stage computes the loss, the last stage turns round in memory, and every transfer is between
neighbours. The paper's point: with the backward split, the V lets every stage start its backwards
early, and the weight halves fill what is left, at 1F1B's peak activation memory.

The order is found by playing the pipeline with unit F, I and W times (the paper's assumption), and
at each moment a stage is free it runs:

1. the oldest ``I`` whose gradient has arrived (it unblocks a neighbour);
2. else the next forward of its second chunk, then of its first, once its input has arrived — the
   first chunk only while fewer than ``2S - 1`` chunk activations are held here (forwarded, ``W``
   not done), the second while fewer than ``2S``: at most 2S half-stage activations, which is S
   whole-stage ones, 1F1B's peak on its first stage (the second chunk's extra slot lets a full stage
   still turn a micro-batch round, so the play cannot stall);
3. else the oldest pending ``W``.

The play is the proof the orders finish; the engine derives the transfers the way it does for every
chunked schedule (``interleaved.tick_program``). Played with measured times (``timed``), arrivals include
each link's transfer and rule 3 runs a ``W`` only where it ends before the next input arrives.
"""
from __future__ import annotations

import functools
from typing import Any

from hal.parallel.schedules.action import Action, Kind
from hal.parallel.schedules.fastest import fastest
from hal.parallel.schedules.interleaved import Interleaved1F1B, arrival, checked_times, choose, earliest, tick_program
from hal.parallel.schedules.placement import virtual_index
from hal.parallel.schedules.stage_times import StageTimes, fit_variants


class ZeroBubbleV(Interleaved1F1B):
    name = "zbv"
    interleaved = True
    splits_backward = True
    placement = "v"
    fixed_chunks = 2
    bubble_divisor = 12.0  # the simulator's bubble at S=4, M=8 is half interleaved zero-bubble's
    torch_class = "ScheduleZBVZeroBubble"
    plays_times = True

    def forward_only(self) -> ZeroBubbleV:
        return ZeroBubbleVForwardOnly()

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2,
                      ) -> list[Action]:
        check_zbv(num_stages, num_micro_batches, virtual_stages)
        return list(_orders(num_stages, num_micro_batches, self.times)[stage])

    def program(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2) -> list:
        check_zbv(num_stages, num_micro_batches, virtual_stages)
        return list(tick_program(self, num_stages, num_micro_batches, virtual_stages)[stage])


class ZeroBubbleVForwardOnly(ZeroBubbleV):
    """Every forward through both chunks in ZB-V's order and placement, nothing else: evaluation (not registered)."""

    name = "zbv-forward-only"
    splits_backward = False

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2,
                      ) -> list[Action]:
        return [a for a in super().compute_order(num_stages, num_micro_batches, stage, virtual_stages)
                if a.kind is Kind.FORWARD]


def check_zbv(S: int, M: int, V: int) -> None:
    """What the V needs: two chunks a stage and at least two stages."""
    if V != 2:
        raise ValueError(f"zbv places exactly 2 chunks on every stage (a V); set parallel.virtual_stages: 2, got {V}")
    if S < 2:
        raise ValueError(f"zbv needs at least 2 stages, got {S}; use 1f1b for one stage")
    if M < 1:
        raise ValueError(f"zbv needs at least one micro-batch, got {M}")


def peak_chunk_activations(num_stages: int) -> int:
    """The most chunk activations a stage holds under ZB-V's rules (see the module docstring)."""
    return 2 * num_stages


@functools.lru_cache(maxsize=64)
def _orders(S: int, M: int, times: StageTimes | None = None) -> tuple[tuple[Action, ...], ...]:
    """Every stage's compute order: the unit-time play under the module's rules, or with ``times`` the fastest in
    simulation of it and the plays with those times (``fastest``, over ``fit_variants``)."""
    cost = checked_times(times, S, 2, "zbv")
    if times is None:
        return _play(S, M, cost, (False,) * S)
    return fastest([_orders(S, M)] + [_play(S, M, cost, fit) for fit in fit_variants(cost)], cost, 2, "v")


def _play(S: int, M: int, cost: StageTimes, fit: tuple[bool, ...]) -> tuple[tuple[Action, ...], ...]:
    """The play with ``cost``'s times; ``fit[s]``: stage s runs a ``W`` only where it ends before its next input."""
    last = 2 * S - 1
    done: dict[tuple[Kind, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> end time
    free = [0.0] * S
    f_next = [[0, 0] for _ in range(S)]  # per stage, per chunk: the next micro-batch to forward
    i_next = [[0, 0] for _ in range(S)]
    weights: list[list[Action]] = [[] for _ in range(S)]  # I done, W pending, oldest first
    orders: list[list[Action]] = [[] for _ in range(S)]

    def pick_of(s: int) -> tuple[float, tuple[int, int], Action] | None:
        """Stage s's most urgent action now (``choose``), from its state and what its neighbours made."""
        held = sum(f_next[s]) - sum(i_next[s]) + len(weights[s])
        options: list[tuple[float, tuple[int, int], Action]] = []
        for c in (1, 0):
            m, j = i_next[s][c], virtual_index(s, c, S, "v")
            if m < f_next[s][c]:
                grad = (done[(Kind.FORWARD, m, j)] if j == last
                        else arrival(done.get((Kind.BACKWARD_INPUT, m, j + 1)), j + 1, j, S, 2, "v", cost))
                if grad is not None:
                    options.append((max(free[s], done[(Kind.FORWARD, m, j)], grad), (1, m), Action(Kind.BACKWARD_INPUT, m, c)))
            m = f_next[s][c]
            if m < M and held < 2 * S - 1 + c:
                arrives = 0.0 if j == 0 else arrival(done.get((Kind.FORWARD, m, j - 1)), j - 1, j, S, 2, "v", cost)
                if arrives is not None:
                    options.append((max(free[s], arrives), (3 - c, m), Action(Kind.FORWARD, m, c)))
        oldest = weights[s][0] if weights[s] else None
        return choose(options, free[s], oldest, (4, 0), None if not fit[s] or oldest is None
                      else cost.cost(Kind.BACKWARD_WEIGHT, s, oldest.chunk))

    # only the acting stage and its neighbours (virtual stages j - 1 and j + 1 live there) pick again after an action
    picks: list[tuple[float, Any, Action] | None] = [None] * S
    stale = set(range(S))
    while sum(len(o) for o in orders) < S * 2 * 3 * M:
        start, s, a = earliest(picks, stale, pick_of, "zbv")
        stale.update(t for t in (s - 1, s, s + 1) if 0 <= t < S)
        done[(a.kind, a.micro_batch, virtual_index(s, a.chunk, S, "v"))] = free[s] = start + cost.cost(a.kind, s, a.chunk)
        if a.kind is Kind.FORWARD:
            f_next[s][a.chunk] += 1
        elif a.kind is Kind.BACKWARD_INPUT:
            i_next[s][a.chunk] += 1
            weights[s].append(Action(Kind.BACKWARD_WEIGHT, a.micro_batch, a.chunk))
        else:
            weights[s].pop(0)
        orders[s].append(a)
    return tuple(tuple(o) for o in orders)
