"""Interleaved 1F1B (Megatron's virtual pipeline): each stage holds V model chunks, the bubble shrinks V-fold.

The model's layers are cut into ``S * V`` virtual stages in order; virtual stage ``j`` is chunk
``j // S`` of stage ``j % S``, so a micro-batch passes every stage V times, coming back from the
last stage to the first over the wrap-around link. With equal chunks the idle share drops from
1F1B's ``(S-1)/(M+S-1)`` to ``(S-1)/(V*M+S-1)``, for V times the boundary traffic.

Compute order (Megatron's): forwards walk the chunks in groups of S micro-batches — S forwards of
chunk 0, then S of chunk 1, ... — backwards the same with the chunks reversed; stage s runs
``2*(S-s-1) + (V-1)*S`` forwards before its first backward (capped at M*V), then alternates.
Megatron needs ``M`` to be a multiple of ``S`` for this grouping; so does this schedule.

Communication (``tick_program``) is derived, not hand-written: the compute orders are played in
rounds (each stage runs its next action when its inputs were made in an earlier round), and
every transfer of round r is posted by both ends right after their round-r compute, one batch per
link in one global link order. The two ends of a link therefore post mirror batches in the same
order — the pairing NCCL's per-communicator queues need — and the fixed link order keeps the ring
(the wrap-around link closes it) free of waiting cycles even where a link's batch is blocking (a
bridge between islands). Batches are posted without waiting; a compute waits only for its own input.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from hal.parallel.schedules.action import Action, Kind, Overlap, P2PBatch, Step
from hal.parallel.schedules.base import Schedule, _check
from hal.parallel.schedules.fastest import fastest
from hal.parallel.schedules.placement import position, virtual_index
from hal.parallel.schedules.simulator import Deadlock
from hal.parallel.schedules.stage_times import StageTimes, fit_variants, unit_times


class Interleaved1F1B(Schedule):
    name = "interleaved-1f1b"
    interleaved = True
    bubble_divisor = 2.0
    torch_class = "ScheduleInterleaved1F1B"

    def forward_only(self) -> Schedule:
        return InterleavedForwardOnly()

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2,
                      ) -> list[Action]:
        S, M, V = num_stages, num_micro_batches, virtual_stages
        check_interleaved(S, M, V)
        total = M * V
        warm = min(2 * (S - stage - 1) + (V - 1) * S, total)

        def nth(i: int, kind: Kind) -> Action:
            group, in_group = divmod(i, S * V)
            chunk = in_group // S
            return Action(kind, group * S + i % S, chunk if kind is Kind.FORWARD else V - 1 - chunk)

        order = [nth(i, Kind.FORWARD) for i in range(warm)]
        for i in range(total - warm):
            order += [nth(warm + i, Kind.FORWARD), nth(i, Kind.BACKWARD)]
        return order + [nth(i, Kind.BACKWARD) for i in range(total - warm, total)]

    def program(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2) -> list[Step]:
        _check(num_stages, num_micro_batches, stage)
        return list(tick_program(self, num_stages, num_micro_batches, virtual_stages)[stage])


class InterleavedForwardOnly(Interleaved1F1B):
    """Every forward through every chunk, in the interleaved order, nothing else: evaluation (not registered)."""

    name = "interleaved-forward-only"

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2,
                      ) -> list[Action]:
        return [a for a in super().compute_order(num_stages, num_micro_batches, stage, virtual_stages)
                if a.kind is Kind.FORWARD]


def check_interleaved(S: int, M: int, V: int) -> None:
    """What the interleaved order needs: several stages and chunks, and whole groups of S micro-batches."""
    if V < 2:
        raise ValueError(f"interleaved-1f1b needs virtual_stages ≥ 2 (chunks per stage), got {V}; use 1f1b for one chunk")
    if S < 2:
        raise ValueError(f"interleaved-1f1b needs at least 2 stages, got {S}")
    if M < S or M % S:
        raise ValueError(f"interleaved-1f1b runs micro-batches in groups of the {S} stages: micro_batches {M} must be "
                         f"a multiple of {S}")


_GRADIENT = (Kind.BACKWARD, Kind.BACKWARD_INPUT)  # the actions that hand a gradient to the previous virtual stage


def _consumer(action: Action, stage: int, S: int, V: int, placement: str = "loop") -> tuple[int, int] | None:
    """(stage, chunk) that receives what ``action`` produces (None: nothing leaves, or nobody needs it)."""
    j = virtual_index(stage, action.chunk, S, placement)
    if action.kind is Kind.FORWARD and j < S * V - 1:
        return position(j + 1, S, V, placement)
    if action.kind in _GRADIENT and j > 0:
        return position(j - 1, S, V, placement)
    return None


def _ready(action: Action, stage: int, S: int, V: int, done: dict[tuple[Kind, int, int], int], now: int,
           placement: str = "loop") -> bool:
    """Whether ``action`` can run in round ``now``: its inputs were made in an earlier round.

    A split backward's ``I`` needs what a backward needs; its ``W`` only its own ``I``.
    """
    j = virtual_index(stage, action.chunk, S, placement)

    def before(kinds: tuple[Kind, ...], vj: int) -> bool:
        return any(done.get((k, action.micro_batch, vj), now) < now for k in kinds)

    if action.kind is Kind.FORWARD:
        return j == 0 or before((Kind.FORWARD,), j - 1)
    if action.kind is Kind.BACKWARD_WEIGHT:
        return before((Kind.BACKWARD_INPUT,), j)
    return before((Kind.FORWARD,), j) and (j == S * V - 1 or before(_GRADIENT, j + 1))


@functools.lru_cache(maxsize=64)
def rounds(schedule: Schedule, S: int, M: int, V: int) -> tuple[tuple[Action | Overlap | None, ...], ...]:
    """Each stage's compute per round (None: idle that round), playing the orders in lockstep.

    A pair the schedule overlaps (``Schedule.pairs``) takes one round when both its actions are ready at its start
    (neither then needs the other); otherwise its actions take a round each, as any other."""
    orders = [schedule.compute_order(S, M, s, V) for s in range(S)]
    paired = [schedule.pairs(S, M, s) for s in range(S)]
    placement = schedule.placement
    at, done = [0] * S, {}
    played: list[list[Action | Overlap | None]] = [[] for _ in range(S)]
    now = 0
    while any(at[s] < len(orders[s]) for s in range(S)):
        ran = False
        for s in range(S):
            action = orders[s][at[s]] if at[s] < len(orders[s]) else None
            entry: Action | Overlap | None = None
            if action is not None and _ready(action, s, S, V, done, now, placement):
                entry = action
                partner = orders[s][at[s] + 1] if at[s] in paired[s] else None
                if partner is not None and _ready(partner, s, S, V, done, now, placement):
                    entry = Overlap(action, partner)
                for a in ((action,) if isinstance(entry, Action) else entry.actions):
                    done[(a.kind, a.micro_batch, virtual_index(s, a.chunk, S, placement))] = now
                    at[s] += 1
                ran = True
            played[s].append(entry)
        if not ran:
            stuck = "; ".join(f"stage {s} at {orders[s][at[s]]}" for s in range(S) if at[s] < len(orders[s]))
            raise Deadlock(f"{schedule.name}: no stage can progress ({stuck})")
        now += 1
    return tuple(tuple(p) for p in played)


def _link_order(a: int, b: int) -> tuple[int, int]:
    """A total order on links: every rank posts a round's batches in it, so no ring of waits can form."""
    return (min(a, b), max(a, b))


@functools.lru_cache(maxsize=64)
def tick_program(schedule: Schedule, S: int, M: int, V: int) -> tuple[tuple[Step, ...], ...]:
    """Every stage's program: its round's compute, then that round's transfers, one batch per link.

    A consumer on the producing stage itself (the V placement's turn at the last stage) needs no
    transfer: the engine hands the tensor from one chunk to the other in memory."""
    played = rounds(schedule, S, M, V)
    programs: list[list[Step]] = [[] for _ in range(S)]
    for r in range(len(played[0])):
        by_link: list[dict[int, list[Action]]] = [{} for _ in range(S)]  # stage -> peer stage -> actions
        for s in range(S):
            entry = played[s][r]
            if entry is None:
                continue
            programs[s].append(entry)
            for action in ((entry,) if isinstance(entry, Action) else entry.actions):
                consumer = _consumer(action, s, S, V, schedule.placement)
                if consumer is None or consumer[0] == s:
                    continue
                to, chunk = consumer
                forward = action.kind is Kind.FORWARD  # else a gradient (B, or the I half of a split backward)
                by_link[s].setdefault(to, []).append(
                    Action(Kind.SEND_FORWARD if forward else Kind.SEND_BACKWARD, action.micro_batch, action.chunk))
                by_link[to].setdefault(s, []).append(
                    Action(Kind.RECV_FORWARD if forward else Kind.RECV_BACKWARD, action.micro_batch, chunk))
        for s in range(S):
            for peer in sorted(by_link[s], key=lambda p: _link_order(s, p)):
                programs[s].append(P2PBatch(tuple(by_link[s][peer]), peer_stage=peer))
    return tuple(tuple(p) for p in programs)


class InterleavedZeroBubble(Interleaved1F1B):
    """Interleaved zero-bubble (the paper's ZB with Megatron's chunks, as torch's ScheduleInterleavedZeroBubble):
    interleaved 1F1B's forward and input-gradient orders, every backward split into ``I`` and ``W``, and the
    ``W`` halves run wherever a stage would otherwise wait.

    The order is found by playing the pipeline with unit F, I and W times (or the measured ones, ``timed``, where a
    ``W`` runs only if it ends before the next input arrives); at each moment a stage is free:
    1. the next ``I`` of its interleaved backward order, once its gradient has arrived;
    2. else the next ``F`` of its interleaved forward order, once its input has arrived and while fewer
       chunk activations are held (forwarded, ``W`` not done) than interleaved 1F1B's warm-up plus one —
       so peak activation memory stays interleaved 1F1B's;
    3. else the oldest pending ``W``.
    """

    name = "interleaved-zero-bubble"
    splits_backward = True
    bubble_divisor = 6.0
    torch_class = "ScheduleInterleavedZeroBubble"
    plays_times = True

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2,
                      ) -> list[Action]:
        check_interleaved(num_stages, num_micro_batches, virtual_stages)
        return list(_zb_orders(num_stages, num_micro_batches, virtual_stages, self.times)[stage])


def choose(options: list[tuple[float, Any, Action]], now: float, oldest_weight: Action | None, weight_rank: Any,
           weight_cost: float | None = None) -> tuple[float, Any, Action] | None:
    """A free stage's pick in the plays of the zero-bubble family: the most urgent option that can start
    ``now`` (options are (start, rank, action), lowest rank first), else its oldest pending ``W`` (ranked
    ``weight_rank``), else the option ready soonest; None when it has nothing at all.

    ``weight_cost`` (a play with measured times): the ``W`` runs only if it ends before the soonest option
    can start, or nothing else is coming; otherwise the stage waits for that option, keeping the ``W``."""
    runnable = [o for o in options if o[0] <= now]
    if runnable:
        return min(runnable, key=lambda o: o[1])
    soonest = min(options, key=lambda o: (o[0], o[1])) if options else None
    if oldest_weight is not None and (weight_cost is None or soonest is None or now + weight_cost <= soonest[0]):
        return now, weight_rank, oldest_weight
    return soonest


@functools.lru_cache(maxsize=64)
def _zb_orders(S: int, M: int, V: int, times: StageTimes | None = None) -> tuple[tuple[Action, ...], ...]:
    """Every stage's compute order: the unit-time play under ``InterleavedZeroBubble``'s rules, or with ``times`` the
    fastest in simulation of it and the plays with those times (``fastest``, over ``fit_variants``)."""
    cost = checked_times(times, S, V, "interleaved-zero-bubble")
    if times is None:
        return _zb_play(S, M, V, cost, (False,) * S)
    return fastest([_zb_orders(S, M, V)] + [_zb_play(S, M, V, cost, fit) for fit in fit_variants(cost)], cost, V, "loop")


def _zb_play(S: int, M: int, V: int, cost: StageTimes, fit: tuple[bool, ...]) -> tuple[tuple[Action, ...], ...]:
    """The play with ``cost``'s times; ``fit[s]``: stage s runs a ``W`` only where it ends before its next input."""
    base = Interleaved1F1B()
    forwards = [[a for a in base.compute_order(S, M, s, V) if a.kind is Kind.FORWARD] for s in range(S)]
    inputs = [[Action(Kind.BACKWARD_INPUT, a.micro_batch, a.chunk) for a in base.compute_order(S, M, s, V)
               if a.kind is Kind.BACKWARD] for s in range(S)]
    bound = [min(2 * (S - s - 1) + (V - 1) * S, M * V) + 1 for s in range(S)]
    done: dict[tuple[Kind, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> end time
    free = [0.0] * S
    f_at, i_at = [0] * S, [0] * S
    weights: list[list[Action]] = [[] for _ in range(S)]  # I done, W pending, oldest first
    orders: list[list[Action]] = [[] for _ in range(S)]
    total = 3 * M * V

    def pick_of(s: int) -> tuple[float, int, Action] | None:
        """Stage s's most urgent action now (``choose``), from its state and what its neighbours made."""
        held = f_at[s] - (i_at[s] - len(weights[s]))  # chunk activations forwarded here, W not done
        options: list[tuple[float, int, Action]] = []
        if i_at[s] < len(inputs[s]):
            a = inputs[s][i_at[s]]
            j = virtual_index(s, a.chunk, S)
            own = done.get((Kind.FORWARD, a.micro_batch, j))
            grad = own if j == S * V - 1 else arrival(done.get((Kind.BACKWARD_INPUT, a.micro_batch, j + 1)), j + 1, j, S, V, "loop", cost)
            if own is not None and grad is not None:
                options.append((max(free[s], own, grad), 1, a))
        if f_at[s] < len(forwards[s]) and held < bound[s]:
            a = forwards[s][f_at[s]]
            j = virtual_index(s, a.chunk, S)
            arrives = 0.0 if j == 0 else arrival(done.get((Kind.FORWARD, a.micro_batch, j - 1)), j - 1, j, S, V, "loop", cost)
            if arrives is not None:
                options.append((max(free[s], arrives), 2, a))
        oldest = weights[s][0] if weights[s] else None
        return choose(options, free[s], oldest, 3,
                      None if not fit[s] or oldest is None else cost.cost(Kind.BACKWARD_WEIGHT, s, oldest.chunk))

    # only the acting stage and its neighbours round the loop (the wrap link joins the last and the first) pick again
    picks: list[tuple[float, Any, Action] | None] = [None] * S
    stale = set(range(S))
    while sum(len(o) for o in orders) < S * total:
        start, s, a = earliest(picks, stale, pick_of, "interleaved zero-bubble")
        stale.update({(s - 1) % S, s, (s + 1) % S})
        j = virtual_index(s, a.chunk, S)
        done[(a.kind, a.micro_batch, j)] = free[s] = start + cost.cost(a.kind, s, a.chunk)
        if a.kind is Kind.FORWARD:
            f_at[s] += 1
        elif a.kind is Kind.BACKWARD_INPUT:
            i_at[s] += 1
            weights[s].append(Action(Kind.BACKWARD_WEIGHT, a.micro_batch, a.chunk))
        else:
            weights[s].pop(0)
        orders[s].append(a)
    return tuple(tuple(o) for o in orders)


def earliest(picks: list[tuple[float, Any, Action] | None], stale: set[int],
             pick_of: Callable[[int], tuple[float, Any, Action] | None], what: str) -> tuple[float, int, Action]:
    """The next action of a play: the stale stages pick again (``pick_of``; ``stale`` is emptied), then the pick that
    starts first, the lowest rank then the lowest stage on a tie, as (start, stage, action)."""
    for s in stale:
        picks[s] = pick_of(s)
    stale.clear()
    candidates = [(p[0], p[1], s) for s, p in enumerate(picks) if p is not None]
    assert candidates, f"{what} order: no stage can progress (a bug in the rules)"
    start, _, s = min(candidates)
    return start, s, picks[s][2]  # type: ignore[index]


def checked_times(times: StageTimes | None, S: int, V: int, name: str) -> StageTimes:
    """``times`` for a play of S stages x V chunks (unit times when None); ValueError when their shape differs."""
    if times is None:
        return unit_times(S, V)
    if times.num_stages != S or times.chunks != V:
        raise ValueError(f"{name}: stage times for {times.num_stages} stages x {times.chunks} chunks, the plan has "
                         f"{S} stages x {V} chunks")
    return times


def arrival(made: float | None, from_j: int, to_j: int, S: int, V: int, placement: str, times: StageTimes,
            ) -> float | None:
    """When what virtual stage ``from_j`` made at ``made`` is at virtual stage ``to_j`` (None: not made yet)."""
    if made is None:
        return None
    return made + times.hop(position(from_j, S, V, placement)[0], position(to_j, S, V, placement)[0])
