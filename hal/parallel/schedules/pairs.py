"""Where a stage runs DualPipeV's pairs at once (``action.Overlap``), and where in turn: the rule, said the same way by
the engine, ``hal train`` and ``hal plan``.

In turn on a stage whose compute talks to other ranks (tensor or expert parallelism, an MoE balancing sum over dp
replicas): two threads would reach its communicator in an order that differs between its ranks, which deadlocks or
mixes up tensors. In turn on a compiled stage too, unless ``HAL_PAIR_OVERLAP=1``: its layers' graphs are called from
Python on both sides (the backward's too), so the two threads mostly take turns holding the interpreter's lock (1 x
H200, 6 layers of the 1.21B model at 1 row: 0.88-1.16x at once over four machines, median 0.93x, against 1.04-1.21x
eager; ``benchmarks/pair_overlap.py``). ``HAL_PAIR_OVERLAP=0`` runs every pair in turn. A cpu stage runs its pairs at
once: a small one is host-bound as an accelerator's is (4 layers of hidden 64 on this project's 2-core CI host: 1.67x).
The threads themselves are ``hal.parallel.pipeline.pairs``.
"""
from __future__ import annotations

import os
from typing import Protocol, Sequence

from hal.errors import ConfigError
from hal.parallel.schedules.base import Schedule

ENV = "HAL_PAIR_OVERLAP"  # 0: every pair in turn; 1: at once on every stage that can; unset: not on compiled stages


class StageShape(Protocol):
    """What ``stage_pairs`` reads of a stage's grid (``StageMesh`` has it)."""

    index: int
    tp: int
    dp: int
    ep: int
    compile: bool

    @property
    def layer_ids(self) -> Sequence[int]: ...


class ModelShape(Protocol):
    """What ``stage_pairs`` reads of the model (``ModelConfig`` has it)."""

    def is_moe_layer(self, index: int) -> bool: ...


def why_not(tp: int, ep: int, balances_over_dp: bool, compiled: bool) -> str | None:
    """Why a stage runs its pairs one after the other (with the fix where there is one), or None where at once."""
    setting = os.environ.get(ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ConfigError(f"{ENV}={setting!r}: use 0 (every pair in turn), 1 (at once wherever a stage can) or leave "
                          "it unset (at once but on compiled stages)")
    if setting == "0":
        return f"{ENV}=0"
    if tp > 1 or ep > 1 or balances_over_dp:
        what = "tensor parallelism" if tp > 1 else "expert parallelism" if ep > 1 else "the MoE balancing sum over dp"
        return (f"{what}: collectives inside the stage's compute, which two threads would issue in different orders "
                "on its ranks")
    if compiled and setting != "1":
        return (f"compiled layers: both threads call their graphs from Python and take turns holding its lock, which "
                f"measured slower at once on most machines ({ENV}=1 runs them at once anyway)")
    return None


def stage_pairs(schedule: Schedule, num_stages: int, micro_batches: int, stage: StageShape, model: ModelShape,
                ) -> str | None:
    """How ``stage`` runs ``schedule``'s pairs (``why_not``): "at once", or "in turn: " and why; None where the schedule
    pairs nothing there. The one rule the engine follows and ``hal train`` and ``hal plan`` say."""
    if not schedule.pairs(num_stages, micro_batches, stage.index):
        return None
    moe_here = any(model.is_moe_layer(i) for i in stage.layer_ids)  # its balancing sum runs over the stage's dp
    why = why_not(stage.tp, stage.ep, moe_here and stage.dp > 1, stage.compile)
    return "at once" if why is None else f"in turn: {why}"


def in_brief(how: str) -> str:
    """``stage_pairs``'s answer in a few words, for a line or a table: "at once", or "in turn (its reason's name)"."""
    return how if how == "at once" else f"in turn ({how.split(': ')[1]})"


__all__ = ["ENV", "ModelShape", "StageShape", "in_brief", "stage_pairs", "why_not"]
