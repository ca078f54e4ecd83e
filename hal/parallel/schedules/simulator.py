"""Play a schedule in one process: timeline, makespan, bubbles and live activations, or the deadlock.

Each stage runs its compute actions in its program's order, one at a time, each as soon as the
stage is free and its inputs exist: forward m at stage s needs forward m at s-1 (plus ``p2p_s``),
backward m at s needs backward m at s+1 (plus ``p2p_s``) and forward m at s. A split backward's
input half ``I`` needs what a backward needs (the next stage's ``I``); its weight half ``W`` only
its own ``I``. A micro-batch counts as in flight from its forward to its last backward action. Sends never block
(the engine keeps pure sends in flight), so communication costs only its latency on the receiver.
This checks a schedule before it runs on a cluster and says what its bubble should be.

Interleaved schedules (``virtual_stages`` V > 1): the dependencies run along the virtual stages
(chunk v of stage s is virtual stage ``v * S + s``, or for ZB-V's V the ``placement`` module's map;
forward m of virtual stage j needs it at j-1, backward at j+1; a hand-over within one stage costs
no ``p2p_s``), a stage's time is split over its chunks by ``chunk_share`` (default equal), and a
micro-batch counts as in flight once per chunk it is held for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from hal.parallel.schedules.action import Action, Kind, Overlap, P2PBatch, Step, compute_actions
from hal.parallel.schedules.base import Schedule
from hal.parallel.schedules.placement import position, virtual_index
from hal.parallel.schedules.stage_times import StageTimes

Times = float | Sequence[float]  # one value for every stage, or one per stage


class Deadlock(RuntimeError):
    """The action lists cannot all finish: every unfinished stage waits on something that never comes."""


@dataclass(frozen=True)
class Span:
    """One compute action's run on one stage."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    timeline: tuple[Span, ...]  # in the order they were played; filter by ``stage`` for one stage's
    makespan: float
    bubble: tuple[float, ...]  # per stage: the share of the makespan it was idle
    bubble_overall: float  # idle share of all stages' time together
    peak_in_flight: tuple[int, ...]  # per stage: most micro-batches forwarded but not yet backwarded


def simulate(schedule: Schedule | Mapping[int, Sequence[Step]], num_stages: int, num_micro_batches: int, *,
             forward_s: Times = 1.0, backward_s: Times = 2.0, p2p_s: float = 0.0,
             weight_share: Times = 0.5, virtual_stages: int = 1,
             chunk_share: Sequence[Sequence[float]] | None = None, placement: str | None = None,
             host_forward_s: Times | None = None, host_backward_s: Times | None = None,
             host_action_s: Times = 0.0, action_s: Times = 0.0, times: StageTimes | None = None,
             pair_share: Times = 1.0) -> Simulation:
    """Play every stage's actions (a registered ``Schedule``, or {stage: program or compute list}).

    ``forward_s`` / ``backward_s``: a stage's time for one micro-batch through all its chunks; chunk v
    takes ``chunk_share[s][v]`` of it (equal shares by default). A split backward's ``W`` takes
    ``weight_share`` of the backward (one fraction, or one a stage: a profile measures it per device type) and its
    ``I`` the rest. ``placement``: where the chunks sit
    (default: the schedule's own, "loop" for a mapping of programs).

    ``host_forward_s`` / ``host_backward_s`` (an accelerator's host, split like the device times) and
    ``host_action_s`` (the host's own work per compute action): each stage's host enqueues its actions
    one after another and never waits (a receive waits on the device); an action starts on the device
    no sooner than its host began enqueuing it and ends no sooner than its host finished. A host slower
    than its device then sets the pace, and what its device still has to run after it — the pipeline's
    drain — is on top.

    ``action_s``: seconds every compute action of a stage takes beyond its share of the compute, whatever its
    size (cpu ranks outnumbering their cores wait that long for a hand-off's partner to be scheduled).

    ``times``: per (stage, chunk) F, I and W seconds and per-link transfers (``StageTimes``, what a measured
    order was played with); when given they replace ``forward_s``, ``backward_s``, ``weight_share``,
    ``chunk_share`` and ``p2p_s``.

    ``pair_share``: what a pair run at once (``action.Overlap``, DualPipeV's) takes of its two actions in turn (one
    fraction, or one a stage; 1.0: in turn, as a stage that cannot overlap runs it). The pair starts when both are
    ready and both end together: its forward's output leaves with the backward's gradient.
    """
    S, M, V = num_stages, num_micro_batches, virtual_stages
    if placement is None:
        placement = schedule.placement if isinstance(schedule, Schedule) else "loop"
    if times is not None and (times.num_stages != S or times.chunks != V):
        raise ValueError(f"times: for {times.num_stages} stages x {times.chunks} chunks; the play has {S} x {V}")
    place = _Place(S, V, placement, times)
    pair = _per_stage(pair_share, S, "pair_share")
    if not all(0.0 < f <= 1.0 for f in pair):
        raise ValueError(f"pair_share: a pair's time over its two actions' in turn, in (0, 1] (or one a stage); got {pair_share!r}")
    orders = [_units(schedule.program(S, M, s, V) if isinstance(schedule, Schedule) else schedule[s], pair[s] < 1.0)
              for s in range(S)]
    fwd, bwd = _per_stage(forward_s, S, "forward_s"), _per_stage(backward_s, S, "backward_s")
    w_share = _per_stage(weight_share, S, "weight_share")
    if not all(0.0 <= w <= 1.0 for w in w_share):
        raise ValueError(f"weight_share: a fraction of the backward between 0 and 1 (or one a stage); got {weight_share!r}")
    shares = _shares(chunk_share, S, V)
    per_kind = {Kind.FORWARD: fwd, Kind.BACKWARD: bwd, Kind.BACKWARD_INPUT: [b * (1.0 - w) for b, w in zip(bwd, w_share)],
                Kind.BACKWARD_WEIGHT: [b * w for b, w in zip(bwd, w_share)]}

    fixed = _per_stage(action_s, S, "action_s")

    def cost(action: Action, s: int) -> float:
        if times is not None:
            return times.cost(action.kind, s, action.chunk) + fixed[s]
        return per_kind[action.kind][s] * shares[s][action.chunk] + fixed[s]

    hf = _per_stage(0.0 if host_forward_s is None else host_forward_s, S, "host_forward_s")
    hb = _per_stage(0.0 if host_backward_s is None else host_backward_s, S, "host_backward_s")
    ha = _per_stage(host_action_s, S, "host_action_s")
    hosted = host_forward_s is not None or host_backward_s is not None or any(ha)
    host_kind = {Kind.FORWARD: hf, Kind.BACKWARD: hb, Kind.BACKWARD_INPUT: [b * (1.0 - w) for b, w in zip(hb, w_share)],
                 Kind.BACKWARD_WEIGHT: [b * w for b, w in zip(hb, w_share)]}

    def host_cost(action: Action, s: int) -> float:
        return host_kind[action.kind][s] * shares[s][action.chunk] + ha[s]

    queued = [0.0] * S  # each host's enqueue clock
    splits = {s: any(a.kind is Kind.BACKWARD_WEIGHT for a in compute_actions(orders[s])) for s in range(S)}
    done: dict[tuple[Kind, int, int], float] = {}  # (kind, micro-batch, stage) -> end time
    at = [0] * S  # next action per stage
    free = [0.0] * S
    live, peak = [0] * S, [0] * S
    timeline: list[Span] = []
    progressed = True
    while progressed:
        progressed = False
        for s in range(S):
            while at[s] < len(orders[s]):
                unit = orders[s][at[s]]
                actions = _actions(unit)
                readies = [_ready(a, s, place, done, p2p_s) for a in actions]
                if any(r is None for r in readies):
                    break
                factor = pair[s] if len(actions) > 1 else 1.0
                costs = [cost(a, s) for a in actions]
                start = max(free[s], *readies)  # type: ignore[type-var]
                work = factor * sum(costs)
                end = start + work
                if hosted:
                    begun = queued[s]
                    queued[s] += factor * sum(host_cost(a, s) for a in actions)
                    start = max(start, begun)
                    end = max(start + work, queued[s])
                cursor = start
                for a, c in zip(actions, costs):  # a pair's bar is cut in its actions' proportions
                    done[(a.kind, a.micro_batch, place.index(s, a.chunk))] = end
                    until = end if a is actions[-1] else cursor + (end - start) * c / sum(costs)
                    timeline.append(Span(s, a, cursor, until))
                    cursor = until
                    # a whole backward frees a micro-batch's activations, a split one with its W (DualPipeV mixes both)
                    last_of_backward = a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT) or (
                        a.kind is Kind.BACKWARD_INPUT and not splits[s])
                    live[s] += 1 if a.kind is Kind.FORWARD else -1 if last_of_backward else 0
                    peak[s] = max(peak[s], live[s])
                free[s] = end
                at[s] += 1
                progressed = True
    stuck = [s for s in range(S) if at[s] < len(orders[s])]
    if stuck:
        waits = "; ".join(f"stage {s} at {orders[s][at[s]]} waits for "
                          + " and ".join(_needs(a, s, place) for a in _actions(orders[s][at[s]])) for s in stuck)
        raise Deadlock(f"the schedule cannot progress: {waits}")
    makespan = max(max(free), max(queued))
    busy = [sum(sp.end - sp.start for sp in timeline if sp.stage == s) for s in range(S)]
    bubble = tuple(1.0 - b / makespan for b in busy) if makespan > 0 else tuple(0.0 for _ in busy)
    overall = 1.0 - sum(busy) / (S * makespan) if makespan > 0 else 0.0
    return Simulation(tuple(timeline), makespan, bubble, overall, tuple(peak))


def _units(steps: Sequence[Step], pairs: bool) -> list[Action | Overlap]:
    """What a program computes, in order: its compute actions, and its pairs as one unit where they run at once
    (``pairs``; else a pair's forward, then its backward). Communication is modelled by the dependencies."""
    actions = compute_actions(steps)
    wrong = [str(a) for a in actions if not a.kind.is_compute]
    if wrong:
        raise ValueError(f"the simulator plays compute actions; {wrong[0]} is not one")
    return [step for step in steps if not isinstance(step, P2PBatch)] if pairs else list(actions)


def _actions(unit: Action | Overlap) -> tuple[Action, ...]:
    return unit.actions if isinstance(unit, Overlap) else (unit,)


@dataclass(frozen=True)
class _Place:
    """The plan's chunk placement, for the dependency rules: virtual indices and transfer costs."""

    S: int
    V: int
    placement: str
    times: StageTimes | None = None

    def index(self, stage: int, chunk: int) -> int:
        return virtual_index(stage, chunk, self.S, self.placement)

    def stage(self, j: int) -> int:
        return position(j, self.S, self.V, self.placement)[0]

    def p2p(self, a: int, b: int, p2p_s: float) -> float:
        """The transfer from virtual stage a to b: none when one stage holds both; the link's own with ``times``."""
        if self.times is not None:
            return self.times.hop(self.stage(a), self.stage(b))
        return 0.0 if self.stage(a) == self.stage(b) else p2p_s


def _ready(action: Action, s: int, place: _Place, done: Mapping[tuple[Kind, int, int], float], p2p_s: float,
           ) -> float | None:
    """When ``action``'s inputs are all there (None: not yet). Keys are (kind, micro-batch, virtual stage)."""
    m, j = action.micro_batch, place.index(s, action.chunk)
    if action.kind is Kind.FORWARD:
        if j == 0:
            return 0.0
        upstream = done.get((Kind.FORWARD, m, j - 1))
        return None if upstream is None else upstream + place.p2p(j - 1, j, p2p_s)
    if action.kind is Kind.BACKWARD_WEIGHT:
        return done.get((Kind.BACKWARD_INPUT, m, j))
    own = done.get((Kind.FORWARD, m, j))
    if own is None:
        return None
    if j == place.S * place.V - 1:
        return own
    # The gradient a backward (or input half) needs is sent by the next virtual stage's backward or input half.
    downstream = done.get((Kind.BACKWARD, m, j + 1), done.get((Kind.BACKWARD_INPUT, m, j + 1)))
    return None if downstream is None else max(own, downstream + place.p2p(j + 1, j, p2p_s))


def _needs(action: Action, s: int, place: _Place) -> str:
    m, j = action.micro_batch, place.index(s, action.chunk)
    S, V = place.S, place.V

    def where(vj: int) -> str:
        stage, chunk = position(vj, S, V, place.placement)
        return f"stage {stage}" + (f" chunk {chunk}" if V > 1 else "")

    if action.kind is Kind.FORWARD:
        return f"F{m} on {where(j - 1)}"
    if action.kind is Kind.BACKWARD_WEIGHT:
        return f"I{m} on {where(j)}"
    if j == S * V - 1:
        return f"F{m} on {where(j)}"
    return f"F{m} on {where(j)} and B{m} on {where(j + 1)}"


def _shares(chunk_share: Sequence[Sequence[float]] | None, S: int, V: int) -> list[list[float]]:
    if chunk_share is None:
        return [[1.0 / V] * V for _ in range(S)]
    shares = [[float(x) for x in row] for row in chunk_share]
    if len(shares) != S or any(len(row) != V or any(x < 0 for x in row) for row in shares):
        raise ValueError(f"chunk_share: one row of {V} non-negative shares per stage ({S}); got {chunk_share!r}")
    return shares


def _per_stage(value: Times, S: int, what: str) -> list[float]:
    values = [float(value)] * S if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != S or any(v < 0 for v in values):
        raise ValueError(f"{what}: one non-negative time, or one per stage ({S}); got {value!r}")
    return values
