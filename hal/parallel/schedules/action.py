"""What a pipeline rank does, as data: compute and point-to-point actions on micro-batches.

A schedule is a list of these per stage (``Schedule.program``); the engine executes it and the
simulator plays it. Like torch.distributed.pipelining's actions, an action names its kind and its
micro-batch; unlike torch's, communication that must be posted together (Megatron's
``send_forward_recv_backward``) is one ``P2PBatch``, so the grouping the runtime relies on to keep
blocking P2P from deadlocking is part of the schedule, not an accident of the executor.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    """An action's kind; the value is its short name in printed schedules (``F0``, ``SEND_F0``)."""

    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    BACKWARD_INPUT = "I"  # the input-gradient half of a split backward (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"  # the weight-gradient half: needs only its own I, sends nothing
    SEND_FORWARD = "SEND_F"  # this stage's output of a micro-batch, to the next stage
    RECV_FORWARD = "RECV_F"  # a micro-batch's input, from the previous stage
    SEND_BACKWARD = "SEND_B"  # the gradient of a micro-batch's input, to the previous stage
    RECV_BACKWARD = "RECV_B"  # the gradient of a micro-batch's output, from the next stage

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def to_next_stage(self) -> bool:
        """True for the traffic over the boundary with the next stage (forward sends, gradient receives)."""
        return self in (Kind.SEND_FORWARD, Kind.RECV_BACKWARD)


_COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})


@dataclass(frozen=True)
class Action:
    """One kind of work on one micro-batch of this stage (of one of its chunks, under interleaving).

    ``chunk``: which of the stage's virtual stages (model chunks) it runs; 0 unless the plan has
    ``virtual_stages`` > 1. Chunk v of stage s is virtual stage ``v * S + s`` of the model's order.
    """

    kind: Kind
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}{self.micro_batch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class P2PBatch:
    """Communication actions posted together over one link (one batched P2P call).

    ``peer_stage`` None: the link is the boundary with the previous or the next stage, which the
    actions' direction says (``to_next_stage``), and a batch that receives is waited on at once.
    ``peer_stage`` set (interleaved schedules, whose chunks also talk over the wrap-around link from the
    last stage to the first): the link is the one shared with that stage, the batch is posted without
    waiting, and a received tensor is waited for only by the compute that needs it.
    """

    actions: tuple[Action, ...]
    peer_stage: int | None = None

    def __post_init__(self) -> None:
        if not self.actions or any(a.kind.is_compute for a in self.actions):
            raise ValueError(f"a P2P batch holds one or more communication actions, got {[str(a) for a in self.actions]}")
        if self.peer_stage is None and len({a.kind.to_next_stage for a in self.actions}) != 1:
            raise ValueError(f"a P2P batch crosses one boundary; {[str(a) for a in self.actions]} cross two")

    @property
    def to_next_stage(self) -> bool:
        return self.actions[0].kind.to_next_stage

    def __str__(self) -> str:
        text = "+".join(str(a) for a in self.actions)
        return text if self.peer_stage is None else f"{text}@{self.peer_stage}"


@dataclass(frozen=True)
class Overlap:
    """A forward and a backward of two different micro-batches that a stage may run at the same time (DualPipeV's
    pairs): both inputs were made before, neither needs the other's result, and their sends follow them both.

    The engine runs the forward on a second thread while its own runs the backward, where the stage allows it
    (``schedules.pairs``), else one after the other; the simulator plays them at a stage's ``pair_share``
    (default 1.0: one after the other).
    """

    forward: Action
    backward: Action

    def __post_init__(self) -> None:
        if self.forward.kind is not Kind.FORWARD or self.backward.kind not in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            raise ValueError(f"an overlapped pair is a forward and a backward (B or I), got {self.forward} and {self.backward}")
        if (self.forward.chunk, self.forward.micro_batch) == (self.backward.chunk, self.backward.micro_batch):
            raise ValueError(f"an overlapped pair runs two different micro-batches or chunks, got {self.forward} twice")

    @property
    def actions(self) -> tuple[Action, Action]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"{self.forward}|{self.backward}"


Step = Action | P2PBatch | Overlap  # one item of a stage's program: a compute action, a P2P batch, or a pair


def compute_actions(steps: list[Step] | tuple[Step, ...]) -> list[Action]:
    """The compute actions of a program in order, an overlapped pair's forward before its backward."""
    out: list[Action] = []
    for step in steps:
        if isinstance(step, Overlap):
            out.extend(step.actions)
        elif isinstance(step, Action):
            out.append(step)
    return out
