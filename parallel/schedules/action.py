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
from typing import Union


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


Step = Union[Action, P2PBatch]  # one item of a stage's program: a compute action or a P2P batch
