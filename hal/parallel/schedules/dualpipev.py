"""DualPipeV (DeepSeek-V3's DualPipe cut in half; arXiv 2412.19437 §3.2.1): ZB-V's placement, a fixed phase order.

Stage r of S holds virtual stages ``r`` and ``2S - 1 - r`` (the V: chunk 0 going down, chunk 1 coming back up;
the first stage computes the loss). Where ZB-V plays the pipeline to find its order, DualPipeV writes it down in
eight phases, and in its steady state pairs a forward of one chunk with a whole backward of the other, which the
stage runs at the same time (``action.Overlap``; ``schedules.pairs`` says where it can):

1. ``2(S - r - 1)`` forwards of chunk 0 (the warm-up, longest on the first stage);
2. ``r + 1`` pairs: a forward of chunk 0, a forward of chunk 1;
3. ``S - r - 1`` times: chunk 1's input gradient (``I``), its weight gradient (``W``), a forward of chunk 1;
4. ``M - 2S + r + 1`` times the steady state: forward chunk 0 with backward chunk 1, forward chunk 1 with
   backward chunk 0 (each pair overlapped on a GPU);
5. ``S - r - 1`` times: backward chunk 1, then forward chunk 1 with backward chunk 0;
6. ``r + 1`` times: backward chunk 1, backward chunk 0 — split into ``I`` and a deferred ``W`` from the
   middle on (the zero-bubble half fills the cool-down);
7. ``S - r - 1`` times: a deferred ``W``, then chunk 0's ``I``;
8. the remaining ``W``s.

Each chunk forwards and backwards every micro-batch once (the counts add up to M in every phase sum), and
``tests/unit/test_schedules.py`` plays every order through the simulator. It needs M >= 2S micro-batches and
holds at most 2S + 1 chunk activations a stage (ZB-V: 2S; the steady state's pair keeps one more in flight). With
unit times and free transfers, its pairs played in turn, it is ZB-V's makespan or half a unit over: its gain is what
running the pairs at once saves (the simulator's ``pair_share``, measured by a profiled run). A pair whose
two halves are not both ready when the stage reaches it (the round play, ``interleaved.rounds``) runs one after the
other.
"""
from __future__ import annotations

import collections
import functools

from hal.parallel.schedules.action import Action, Kind
from hal.parallel.schedules.zbv import ZeroBubbleV, ZeroBubbleVForwardOnly


class DualPipeV(ZeroBubbleV):
    name = "dualpipev"
    bubble_divisor = 12.0  # as ZB-V's: the same V, the cool-down filled by weight halves
    torch_class = "ScheduleDualPipeV"
    plays_times = False  # a fixed eight-phase order, not a play

    def problem(self, num_stages: int, micro_batches: int) -> str | None:
        S, M = num_stages, micro_batches
        if S >= 2 and M < 2 * S:
            return (f"schedule dualpipev needs at least 2 x the {S} stages = {2 * S} micro-batches, the plan has {M}; "
                    f"set parallel.micro_batches ≥ {2 * S} or use schedule: zbv")
        return super().problem(num_stages, micro_batches)

    def forward_only(self) -> ZeroBubbleVForwardOnly:
        return ZeroBubbleVForwardOnly()  # evaluation: every forward through the V, in ZB-V's order

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2,
                      ) -> list[Action]:
        check_dualpipev(num_stages, num_micro_batches, virtual_stages)
        return list(_order(num_stages, num_micro_batches, stage)[0])

    def pairs(self, num_stages: int, num_micro_batches: int, stage: int) -> frozenset[int]:
        """The steady state's pairs (phases 4 and 5): a forward of one chunk with the other chunk's backward."""
        return _order(num_stages, num_micro_batches, stage)[1]

    def program(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2) -> list:
        check_dualpipev(num_stages, num_micro_batches, virtual_stages)
        return super().program(num_stages, num_micro_batches, stage, virtual_stages)


def check_dualpipev(S: int, M: int, V: int) -> None:
    """What DualPipeV needs: ZB-V's V on two or more stages, and micro-batches enough to reach its steady state."""
    if V != 2:
        raise ValueError(f"dualpipev places exactly 2 chunks on every stage (a V); set parallel.virtual_stages: 2, got {V}")
    if S < 2:
        raise ValueError(f"dualpipev needs at least 2 stages, got {S}; use 1f1b for one stage")
    if M < 2 * S:
        raise ValueError(f"dualpipev needs at least 2 x stages = {2 * S} micro-batches, got {M}; raise "
                         f"parallel.micro_batches or use zbv")


@functools.lru_cache(maxsize=256)
def _order(S: int, M: int, r: int) -> tuple[tuple[Action, ...], frozenset[int]]:
    """Stage ``r``'s compute order, phase by phase (the module docstring), and where its pairs start in it."""
    order: list[Action] = []
    pairs: set[int] = set()
    forwarded, backwarded = [0, 0], [0, 0]  # per chunk: the next micro-batch to forward / to backward
    weights: collections.deque[Action] = collections.deque()  # I done, W pending, oldest first

    def forward(chunk: int) -> None:
        order.append(Action(Kind.FORWARD, forwarded[chunk], chunk))
        forwarded[chunk] += 1

    def backward(chunk: int, split: bool = False) -> None:
        m = backwarded[chunk]
        backwarded[chunk] += 1
        if split:
            order.append(Action(Kind.BACKWARD_INPUT, m, chunk))
            weights.append(Action(Kind.BACKWARD_WEIGHT, m, chunk))
        else:
            order.append(Action(Kind.BACKWARD, m, chunk))

    def weight() -> None:
        order.append(weights.popleft())

    for _ in range(2 * (S - r - 1)):  # 1
        forward(0)
    for _ in range(r + 1):  # 2
        forward(0)
        forward(1)
    for _ in range(S - r - 1):  # 3
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(M - 2 * S + r + 1):  # 4: the steady state, two overlapped pairs
        pairs.add(len(order))
        forward(0)
        backward(1)
        pairs.add(len(order))
        forward(1)
        backward(0)
    for _ in range(S - r - 1):  # 5
        backward(1)
        pairs.add(len(order))
        forward(1)
        backward(0)
    for i in range(r + 1):  # 6
        split = i >= (r + 1) // 2
        backward(1, split)
        backward(0, split)
    for _ in range(S - r - 1):  # 7
        weight()
        backward(0, split=True)
    while weights:  # 8
        weight()
    return tuple(order), frozenset(pairs)
