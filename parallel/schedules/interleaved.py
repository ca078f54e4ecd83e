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

from .action import Action, Kind, P2PBatch, Step
from .base import Schedule, _check


class Interleaved1F1B(Schedule):
    name = "interleaved-1f1b"
    interleaved = True

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


def virtual_index(stage: int, chunk: int, num_stages: int) -> int:
    """The position of ``stage``'s chunk ``chunk`` in the model's order of virtual stages."""
    return chunk * num_stages + stage


def _consumer(action: Action, stage: int, S: int, V: int) -> tuple[int, int] | None:
    """(stage, chunk) that receives what ``action`` produces (None: nothing leaves, or nobody needs it)."""
    j = virtual_index(stage, action.chunk, S)
    if action.kind is Kind.FORWARD and j < S * V - 1:
        return (j + 1) % S, (j + 1) // S
    if action.kind is Kind.BACKWARD and j > 0:
        return (j - 1) % S, (j - 1) // S
    return None


def _ready(action: Action, stage: int, S: int, V: int, done: dict[tuple[Kind, int, int], int], now: int) -> bool:
    """Whether ``action`` can run in round ``now``: its inputs were made in an earlier round."""
    j = virtual_index(stage, action.chunk, S)

    def before(kind: Kind, vj: int) -> bool:
        return done.get((kind, action.micro_batch, vj), now) < now

    if action.kind is Kind.FORWARD:
        return j == 0 or before(Kind.FORWARD, j - 1)
    return before(Kind.FORWARD, j) and (j == S * V - 1 or before(Kind.BACKWARD, j + 1))


@functools.lru_cache(maxsize=64)
def rounds(schedule: Schedule, S: int, M: int, V: int) -> tuple[tuple[Action | None, ...], ...]:
    """Each stage's compute action per round (None: idle that round), playing the orders in lockstep."""
    orders = [schedule.compute_order(S, M, s, V) for s in range(S)]
    at, done = [0] * S, {}
    played: list[list[Action | None]] = [[] for _ in range(S)]
    now = 0
    while any(at[s] < len(orders[s]) for s in range(S)):
        ran = False
        for s in range(S):
            action = orders[s][at[s]] if at[s] < len(orders[s]) else None
            if action is not None and _ready(action, s, S, V, done, now):
                done[(action.kind, action.micro_batch, virtual_index(s, action.chunk, S))] = now
                at[s] += 1
                ran = True
            else:
                action = None
            played[s].append(action)
        if not ran:
            from .simulator import Deadlock

            stuck = "; ".join(f"stage {s} at {orders[s][at[s]]}" for s in range(S) if at[s] < len(orders[s]))
            raise Deadlock(f"{schedule.name}: no stage can progress ({stuck})")
        now += 1
    return tuple(tuple(p) for p in played)


def _link_order(a: int, b: int, S: int) -> tuple[int, int]:
    """A total order on links: every rank posts a round's batches in it, so no ring of waits can form."""
    return (min(a, b), max(a, b))


@functools.lru_cache(maxsize=64)
def tick_program(schedule: Schedule, S: int, M: int, V: int) -> tuple[tuple[Step, ...], ...]:
    """Every stage's program: its round's compute, then that round's transfers, one batch per link."""
    played = rounds(schedule, S, M, V)
    programs: list[list[Step]] = [[] for _ in range(S)]
    for r in range(len(played[0])):
        by_link: list[dict[int, list[Action]]] = [{} for _ in range(S)]  # stage -> peer stage -> actions
        for s in range(S):
            action = played[s][r]
            if action is None:
                continue
            programs[s].append(action)
            consumer = _consumer(action, s, S, V)
            if consumer is None:
                continue
            to, chunk = consumer
            forward = action.kind is Kind.FORWARD
            by_link[s].setdefault(to, []).append(
                Action(Kind.SEND_FORWARD if forward else Kind.SEND_BACKWARD, action.micro_batch, action.chunk))
            by_link[to].setdefault(s, []).append(
                Action(Kind.RECV_FORWARD if forward else Kind.RECV_BACKWARD, action.micro_batch, chunk))
        for s in range(S):
            for peer in sorted(by_link[s], key=lambda p: _link_order(s, p, S)):
                programs[s].append(P2PBatch(tuple(by_link[s][peer]), peer_stage=peer))
    return tuple(tuple(p) for p in programs)
