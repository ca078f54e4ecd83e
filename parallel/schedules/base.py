"""The schedule interface: a per-stage compute order, and the program that adds its communication.

A subclass says only in which order a stage computes (``compute_order``) and which sends share a
batch with the next receive (``fuses``); ``program`` derives the rest the same way for every
schedule: a compute's receive is posted right before it, its send right after it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from hal.parallel.schedules.action import Action, Kind, P2PBatch, Step


class Schedule(ABC):
    """A pipeline schedule without parameters of its own: everything follows from (S, M, stage)."""

    name: ClassVar[str]
    splits_backward: ClassVar[bool] = False  # True: backwards are I + W halves (the engine defers weight grads)
    interleaved: ClassVar[bool] = False  # True: each stage runs ``virtual_stages`` model chunks (``program``'s last argument)
    placement: ClassVar[str] = "loop"  # where the chunks sit (``placement``): Megatron's loop, or ZB-V's "v"

    def __eq__(self, other: object) -> bool:  # no parameters: every instance of a class is the same schedule
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    @abstractmethod
    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int) -> list[Action]:
        """The stage's compute actions in the order it runs them."""

    def fuses(self, num_stages: int, num_micro_batches: int, stage: int, index: int) -> bool:
        """True when the send after compute ``index`` is posted in one batch with the receive of compute
        ``index + 1`` (the opposite direction over the same boundary). Default: never."""
        return False

    def program(self, num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 1) -> list[Step]:
        """The stage's compute actions with their communication, in execution order."""
        _check(num_stages, num_micro_batches, stage)
        if virtual_stages != 1:
            raise ValueError(f"schedule {self.name!r} runs one chunk per stage; virtual_stages {virtual_stages} needs "
                             "an interleaved schedule (interleaved-1f1b)")
        order = self.compute_order(num_stages, num_micro_batches, stage)
        first, last = stage == 0, stage == num_stages - 1
        steps: list[Step] = []
        received_early = False  # the receive of order[i] went out with the previous send
        for i, action in enumerate(order):
            recv = _recv(action, first, last)
            if recv is not None and not received_early:
                steps.append(P2PBatch((recv,)))
            steps.append(action)
            batch = [a for a in (_send(action, first, last),) if a is not None]
            received_early = False
            if i + 1 < len(order) and self.fuses(num_stages, num_micro_batches, stage, i):
                nxt = _recv(order[i + 1], first, last)
                if nxt is not None and batch and nxt.kind.to_next_stage == batch[0].kind.to_next_stage:
                    batch.append(nxt)
                    received_early = True
            if batch:
                steps.append(P2PBatch(tuple(batch)))
        return steps


def _recv(action: Action, first: bool, last: bool) -> Action | None:
    """What ``action`` needs from a neighbour before it can run (None at the pipeline's ends).

    A split backward's input half (``I``) talks to the neighbours as a whole backward does; its
    weight half (``W``) needs nothing and sends nothing.
    """
    if action.kind is Kind.FORWARD and not first:
        return Action(Kind.RECV_FORWARD, action.micro_batch)
    if action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and not last:
        return Action(Kind.RECV_BACKWARD, action.micro_batch)
    return None


def _send(action: Action, first: bool, last: bool) -> Action | None:
    """What ``action`` hands to a neighbour when it is done (None at the pipeline's ends)."""
    if action.kind is Kind.FORWARD and not last:
        return Action(Kind.SEND_FORWARD, action.micro_batch)
    if action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and not first:
        return Action(Kind.SEND_BACKWARD, action.micro_batch)
    return None


def _check(num_stages: int, num_micro_batches: int, stage: int) -> None:
    if num_stages < 1 or num_micro_batches < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} of {num_stages} stages with {num_micro_batches} micro-batches: "
                         "need at least one stage and one micro-batch, and 0 <= stage < stages")
