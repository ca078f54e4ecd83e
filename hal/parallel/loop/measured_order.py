"""``parallel.order: measured`` (and ``auto``, the default, for a played schedule): after a calibration step, every rank re-plays its
schedule's order from measured times.

Why: the zero-bubble family's orders come from a play with unit F, I and W times and free transfers; a real
pipeline has a head on one stage, uneven layer counts, a CPU stage beside a GPU stage, links that take time.
So ``hal train`` times the second step of the run (device events on an accelerator: the device's own time,
not the host's enqueueing), each stage's link to the next (a round trip of one activation), gathers the
figures from every rank and builds the same ``StageTimes`` on each of them — the slowest rank of a stage sets
its figure — then plays the schedule with them (``Schedule.timed``). The simulator compares the result with
the unit-time order on the same times; the faster is kept, and the run says which and why on the writer's
stderr. Every rank switches at the same step, so the programs still pair.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch.distributed as dist

from hal.parallel.schedules import Kind, Schedule
from hal.parallel.schedules.fastest import measured_or_unit
from hal.parallel.schedules.stage_times import StageTimes

if TYPE_CHECKING:
    from hal.parallel.pipeline.engine import PipelineEngine
    from hal.parallel.replicas.replica_set import ReplicaSet

CALIBRATION_STEP = 1  # the run's second step: the first fills caches, compiles and allocates


@dataclass(frozen=True)
class OrderChoice:
    """What the calibration found: the times, the predicted step of each order, and the schedule now running."""

    times: StageTimes
    unit_s: float  # the simulator's step with the unit-time order, on the measured times
    measured_s: float  # the same for the order played from the measured times
    schedule: Schedule  # what runs from the next step on (the unit one when it was no slower)
    step: int  # the first step run with it (1-based)

    @property
    def chosen(self) -> str:
        return "unit" if self.schedule.times is None else "measured"

    def text(self) -> str:
        gain = self.unit_s / self.measured_s if self.measured_s > 0 else 1.0
        if self.chosen == "unit":
            why = (f"the unit-time order is already the fastest the simulator finds for these times "
                   f"({self.unit_s * 1e3:.1f} ms a step); it stays")
        else:
            why = (f"simulated {self.measured_s * 1e3:.1f} ms a step against {self.unit_s * 1e3:.1f} ms for the "
                   f"unit-time order ({gain:.3f}x); it runs from step {self.step}")
        return f"{self.schedule.name} order from measured times ({self.times.summary()}): {why}"

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "from_step": self.step, "unit_step_s": self.unit_s, "measured_step_s": self.measured_s,
                "forward_s": [list(r) for r in self.times.forward], "backward_input_s": [list(r) for r in self.times.backward_input],
                "backward_weight_s": [list(r) for r in self.times.backward_weight], "links_s": list(self.times.links)}


def wanted(plan: Any) -> bool:
    """Whether the plan's order is to come from measured times: ``order: measured``, or ``auto`` (the default) with a
    schedule whose order is played."""
    return plan.order in ("auto", "measured") and plan.schedule.plays_times


def due(plan: Any, start: int, steps: int, step: int) -> bool:
    """Whether ``step`` (0-based) is the calibration step of this run."""
    return wanted(plan) and step == start + CALIBRATION_STEP and step < steps - 1


def skipped(plan: Any, start: int, steps: int) -> str | None:
    """Why a run asking for ``order: measured`` will not calibrate (too few steps left), said before it starts; else None
    (``auto`` asks nothing: a short run simply keeps the unit order)."""
    if plan.order != "measured" or not plan.schedule.plays_times or start + CALIBRATION_STEP < steps - 1:
        return None
    return (f"parallel.order: measured calibrates on the run's step {start + CALIBRATION_STEP + 1} and needs one after it; "
            f"this run has {steps - start} step(s) left, so the unit-time order runs throughout")


def due_anywhere(plans: Sequence[Any], start: int, steps: int, step: int) -> bool:
    """Whether any replica (``plans``: every replica's) calibrates at ``step`` (the same answer on every rank): every
    rank then joins the gather, those of a replica that does not calibrate with nothing to add."""
    return any(due(p, start, steps, step) for p in plans)


def stage_times(records: Sequence[dict[str, Any]], num_stages: int, chunks: int, placement: str) -> StageTimes:
    """Every rank's measurements (``calibrate``'s records of one pipeline) as one ``StageTimes``: per stage and
    chunk, the slowest rank's mean F, I and W (a whole backward counts as I with no W); per boundary, the slowest
    rank's link; the wrap-around link of a loop-placed interleaved plan as the mean of the others."""
    def slowest(stage: int, kind: str, chunk: int) -> float:
        values = [r["actions"].get(f"{kind}{chunk}", 0.0) for r in records if r["stage"] == stage]
        return max(values, default=0.0)

    forward, inputs, weights = [], [], []
    for s in range(num_stages):
        forward.append([slowest(s, "F", c) for c in range(chunks)])
        inputs.append([slowest(s, "I", c) + slowest(s, "B", c) for c in range(chunks)])
        weights.append([slowest(s, "W", c) for c in range(chunks)])
    links = [max((r["link"] for r in records if r["stage"] == s and r["link"] is not None), default=0.0)
             for s in range(num_stages - 1)]
    if chunks > 1 and placement == "loop" and links:
        links.append(sum(links) / len(links))
    return StageTimes.of(forward, inputs, weights, links)


def choose(schedule: Schedule, times: StageTimes, micro_batches: int, step: int) -> OrderChoice:
    """Play ``schedule`` with ``times``; keep it if the simulator finds it faster than the unit order."""
    keep, unit_s, measured_s = measured_or_unit(schedule, times, micro_batches)
    return OrderChoice(times, unit_s, measured_s, keep, step)


def calibrate(engine: PipelineEngine, replicas: ReplicaSet, rank: int, writer: int, start: int, steps: int,
              step: int) -> OrderChoice | None:
    """After the calibration step (run with device events): time the links, gather every rank's figures, and
    switch every rank of this pipeline to the chosen order; said by ``writer`` (several replicas: each replica's
    first rank). Collective over the world (``due_anywhere``); None on a rank whose replica does not calibrate."""
    mine: dict[str, Any] | None = None
    if due(replicas.plan, start, steps, step):
        link = engine.time_links()
        actions = {f"{kind.value}{chunk}": seconds for (kind, chunk), seconds in engine.action_times().items()
                   if kind in (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)}
        mine = {"replica": replicas.index, "stage": engine.coord.stage, "actions": actions, "link": link}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if mine is None:
        return None
    ours = [e for e in everyone if e is not None and e["replica"] == replicas.index]
    plan = replicas.plan
    times = stage_times(ours, plan.num_stages, plan.virtual_stages, plan.placement)
    choice = choose(plan.schedule, times, plan.micro_batches, step + 2)
    if choice.schedule != engine.schedule:
        engine.set_schedule(choice.schedule)
    speaker = min(m.ranks[0] for m in replicas.topology.stages) if replicas.exchanges else writer
    if rank == speaker:
        where = f"replica {replicas.index}: " if replicas.exchanges else ""
        print(f"hal train: step {step + 1}: {where}{choice.text()}", file=sys.stderr, flush=True)
    return choice
