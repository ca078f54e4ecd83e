"""The schedule interface: a per-stage compute order, and the program that adds its communication.

A subclass says only in which order a stage computes (``compute_order``) and which sends share a
batch with the next receive (``fuses``); ``program`` derives the rest the same way for every
schedule: a compute's receive is posted right before it, its send right after it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from hal.parallel.schedules.action import Action, Kind, P2PBatch, Step
from hal.parallel.schedules.placement import last_stage
from hal.parallel.schedules.stage_times import StageTimes


class Schedule(ABC):
    """A pipeline schedule: everything follows from (S, M, stage) and, for a schedule whose order is played
    (``plays_times``), the stage times it is played with (``timed``; unit times when none are given).

    Parsed once (``ParallelPlan`` holds the object, never its name again), a schedule owns its rules and
    everything else asks it: how many model chunks a stage runs (``chunks``), which stage holds the head
    (``head_stage``), whether backwards split into input and weight halves (``splits_backward``), its ideal bubble against 1F1B's
    (``bubble_divisor``), the forward-only program evaluation runs (``forward_only``), the plan shapes it
    cannot run (``problem``) and torch's own class of the same order (``torch_class``, for benchmarks).
    A new schedule is one module with its subclass plus its line in ``registry``.
    """

    name: ClassVar[str]
    splits_backward: ClassVar[bool] = False  # True: backwards are I + W halves (the engine defers weight grads)
    interleaved: ClassVar[bool] = False  # True: each stage runs ``virtual_stages`` model chunks (``program``'s last argument)
    placement: ClassVar[str] = "loop"  # where the chunks sit (``placement``): Megatron's loop, or ZB-V's "v"
    fixed_chunks: ClassVar[int | None] = None  # interleaved schedules that run exactly this many chunks a stage (zbv: 2)
    fills_pipeline: ClassVar[bool] = False  # True: needs micro_batches >= stages to fill the pipeline (1f1b)
    bubble_divisor: ClassVar[float] = 1.0  # the planner's screen: ideal bubble = 1F1B's / this
    torch_class: ClassVar[str | None] = None  # torch.distributed.pipelining's schedule of the same order, if any
    plays_times: ClassVar[bool] = False  # True: its order is found by a play that can take measured stage times

    def __init__(self, times: StageTimes | None = None) -> None:
        if times is not None and not self.plays_times:
            raise ValueError(f"schedule {self.name} has a fixed order; only a played one (zero-bubble, "
                             "interleaved-zero-bubble, zbv) is built from stage times")
        self.times = times  # None: the play's unit times (and the order every earlier release ran)

    def timed(self, times: StageTimes | None) -> Schedule:
        """This schedule with its order played from ``times`` (None: unit times again)."""
        return type(self)(times)

    def __eq__(self, other: object) -> bool:  # a schedule is its class and the times its order was played with
        return type(other) is type(self) and other.times == self.times  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.times))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<schedule {self.name}{' (timed)' if self.times is not None else ''}>"

    def chunks(self) -> int:
        """Model chunks a stage runs unless the plan says otherwise: 1, or for an interleaved schedule its fixed
        count (zbv: 2), else 2 (``parallel.virtual_stages`` may ask more of those)."""
        if not self.interleaved:
            return 1
        return self.fixed_chunks or 2

    def head_stage(self, num_stages: int) -> int:
        """The stage holding the model's last layers, the head and the loss (the first one under the V)."""
        return last_stage(num_stages, self.placement)

    def forward_only(self) -> Schedule:
        """The schedule evaluation runs: every forward in this schedule's order and placement, nothing else."""
        return ForwardOnly()

    def chunk_problem(self, virtual_stages: int) -> str | None:
        """Why ``virtual_stages`` chunks a stage cannot run under this schedule (the fix included), or None."""
        V = virtual_stages
        if self.interleaved and V < 2:
            return (f"schedule {self.name} runs several model chunks per stage; set parallel.virtual_stages ≥ 2 (and "
                    "each stage's layers divisible by it, or a list per chunk)")
        if not self.interleaved and V > 1:
            return (f"parallel.virtual_stages {V} needs an interleaved schedule; set schedule: interleaved-1f1b or "
                    "virtual_stages: 1")
        if self.fixed_chunks is not None and V != self.fixed_chunks:
            return (f"schedule {self.name} places exactly {self.fixed_chunks} chunks on every stage (a V); set "
                    f"parallel.virtual_stages: {self.fixed_chunks} (got {V}), or use interleaved-zero-bubble for {V} chunks")
        return None

    def problem(self, num_stages: int, micro_batches: int) -> str | None:
        """Why S stages and M micro-batches cannot run under this schedule (the fix included), or None."""
        S, M = num_stages, micro_batches
        if self.fills_pipeline and M < S:
            return (f"parallel.micro_batches {M} is fewer than the {S} stages, which schedule {self.name} needs to fill "
                    f"the pipeline; set micro_batches ≥ {S} or use schedule: gpipe")
        if self.interleaved:
            if S < 2:
                return f"schedule {self.name} needs at least 2 stages, the plan has {S}; use 1f1b"
            if self.placement == "loop" and (M < S or M % S):
                return (f"schedule {self.name} runs micro-batches in groups of the {S} stages: parallel.micro_batches "
                        f"{M} must be a multiple of {S}, e.g. {max(S, -(-M // S) * S)}")
        return None

    @abstractmethod
    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int) -> list[Action]:
        """The stage's compute actions in the order it runs them."""

    def pairs(self, num_stages: int, num_micro_batches: int, stage: int) -> frozenset[int]:
        """Positions ``i`` of the compute order whose action and the next one (a forward and a backward of other
        micro-batches) the stage may run at the same time (``action.Overlap``). Default: none."""
        return frozenset()

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


class ForwardOnly(Schedule):
    """Every forward and nothing else: evaluation (not registered: no training step runs it)."""

    name = "forward-only"

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int) -> list[Action]:
        return [Action(Kind.FORWARD, m) for m in range(num_micro_batches)]


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
