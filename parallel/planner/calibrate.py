"""How much slower cpu ranks compute, and how long they wait, inside a real pipeline run than alone.

Why measure it: the layer points of a profile are timed in one process with the node to itself. In a run,
a node's ranks share its cores, caches, memory bandwidth and clock; a rank whose input arrived may wait
for a core, and each blocking exchange waits for its partner to be scheduled. On this project's 2-core
CI host that stretches compute by 1.2–2.1× and adds milliseconds per hand-off — more than the
ranks-over-cores share the cost model assumed before. No formula gets that right for every host, so
``hal profile`` runs the engine itself on the node's ranks: a 1F1B pipeline of 4 layers a stage and
4 × stages micro-batches of the largest profiled row count (busy ranks, as in real plans), and compares
each rank's measured compute with what the profile predicts for it alone. Two such runs (every rank of
the node, and half of them) give (occupancy, compute slowdown, hand-off seconds) points — occupancy is
the busy share of the node's ranks × their threads over its cores — and one run of tp-2 stages gives the
wait one tp all-reduce costs. The cost model interpolates them (``DeviceProfile.stretch`` and friends).
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Callable

import torch

from ..model_config import ModelConfig
from .profile import DeviceProfile

STEPS = 5  # timed steps (the median is kept) a calibration run, after one warm-up step
LAYERS, MICRO_BATCHES_PER_STAGE = 4, 4  # a stage's layers; micro-batches = 4 × stages: busy ranks, as in real plans


def calibration_rank(model: dict[str, Any], rows: int, seq: int, threads: int, steps: int, tp: int = 1) -> dict[str, float]:
    """One rank of the calibration pipeline (stages of ``tp`` ranks, one layer each): its median compute and
    schedule seconds a step (host clock)."""
    import datetime

    from hal.collectives import init_distributed, shutdown

    from ..engine import PipelineEngine
    from ..plan import ParallelPlan, StagePlan
    from ..topology import Topology, build_groups

    torch.set_num_threads(threads)
    os.environ.pop("HAL_ISLANDS", None)
    world = init_distributed("cpu", init_method=os.environ.get("HAL_INIT_METHOD"), timeout=datetime.timedelta(minutes=2))
    try:
        stages = world.size // tp
        config = ModelConfig(**{**model, "num_layers": stages * LAYERS})
        plan = ParallelPlan(tuple(StagePlan("cpu", tp, LAYERS, tp=tp) for _ in range(stages)), "1f1b",
                            MICRO_BATCHES_PER_STAGE * stages, rows)
        topology = Topology.from_plan(plan)
        groups = build_groups(topology, world, validate=False)
        engine = PipelineEngine(config, plan, topology, groups, backend=world.backend, seed=0, device=world.device,
                                dtype=torch.float32, seq_len=seq)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (plan.micro_batches, rows, seq + 1), generator=gen)
        compute, schedule = [], []
        for i in range(steps + 1):
            engine.module.zero_grad(set_to_none=True)
            engine.step_lazy(tokens)
            if i:  # the first step warms the allocator and the op caches
                compute.append(engine.times.compute)
                schedule.append(engine.times.schedule)
        return {"compute_s": statistics.median(compute), "schedule_s": statistics.median(schedule)}
    finally:
        shutdown()


def solo_compute_s(device: DeviceProfile, stages: int, stage: int, rows: int, seq: int, tp: int = 1) -> float:
    """What the profile predicts for stage ``stage`` of the calibration pipeline alone, without tp's
    communication: its micro-batches through its layers, plus the embedding (first) or the head (last)."""
    f, b, _ = device.layer(tp, rows, seq, False)
    per = LAYERS * (f + b)
    tokens = rows * seq
    if stage == 0:
        per += tokens * (device.embedding.forward_s + device.embedding.backward_s)
    if stage == stages - 1:
        per += tokens * (device.head.forward_s + device.head.backward_s) / tp
    return MICRO_BATCHES_PER_STAGE * stages * per


def calibrate_node(device: DeviceProfile, model: ModelConfig, *, ranks: int, cores: int, threads: int, rows: int, seq: int,
                   launch: Callable[..., Any], steps: int = STEPS) -> tuple[tuple[float, float, float], ...]:
    """(occupancy, compute slowdown, hand-off seconds) points for a node of ``cores`` cores: one rank alone (slowdown 1: the profile's own
    conditions), one calibration run with ``ranks`` ranks and, where ranks > 2, one with half of them.
    Occupancy = mean busy share × ranks × threads / cores."""
    import sys

    points = [(round(threads / cores, 4), 1.0, 0.0)]  # one rank alone: the profile's own conditions
    for count in sorted({ranks, max(2, ranks // 2)}):
        if count < 2:
            continue
        run = launch(f"{__name__}:calibration_rank", count,
                     {"model": model.to_dict(), "rows": rows, "seq": seq, "threads": threads, "steps": steps},
                     deadline_s=300, what=f"hal profile: calibration pipeline of {count} cpu ranks", echo_stderr=sys.stderr)
        values = [run.values[r] for r in range(count)]
        slowdown = statistics.median(v["compute_s"] / solo_compute_s(device, count, r, rows, seq) for r, v in enumerate(values))
        busy = statistics.mean(min(1.0, v["compute_s"] / v["schedule_s"]) for v in values)
        hand_off = hand_off_s(device, values, rows, seq)
        points.append((round(busy * count * threads / cores, 4), round(max(1.0, slowdown), 4), round(hand_off, 6)))
    return tuple(points)


def calibrate_tp(device: DeviceProfile, model: ModelConfig, *, ranks: int, cores: int, threads: int, rows: int, seq: int,
                 launch: Callable[..., Any], steps: int = STEPS) -> tuple[tuple[float, float], ...]:
    """(occupancy, seconds a tp all-reduce costs inside a layer) for a node: one rank alone (0) and a calibration
    pipeline of tp-2 stages over the node's ranks. Why: tp's all-reduces are blocking exchanges between
    ranks that compute together; on a busy node each waits for its partner to be scheduled."""
    import sys

    tp = 2
    stages = ranks // tp
    points = [(round(threads / cores, 4), 0.0)]
    if stages < 1:
        return tuple(points)
    run = launch(f"{__name__}:calibration_rank", stages * tp,
                 {"model": model.to_dict(), "rows": rows, "seq": seq, "threads": threads, "steps": steps, "tp": tp},
                 deadline_s=300, what=f"hal profile: calibration pipeline of {stages} tp-{tp} stage(s)", echo_stderr=sys.stderr)
    values = [run.values[r] for r in range(stages * tp)]
    busy = statistics.mean(min(1.0, v["compute_s"] / v["schedule_s"]) for v in values)
    occupancy = busy * stages * tp * threads / cores
    stretch = device.stretch(occupancy) or 1.0
    calls = MICRO_BATCHES_PER_STAGE * stages * LAYERS * 4  # micro-batches × layers × (two all-reduces forward, two backward)
    extra = statistics.median((v["compute_s"] - stretch * solo_compute_s(device, stages, r // tp, rows, seq, tp)) / calls
                              for r, v in enumerate(values))
    points.append((round(occupancy, 4), round(max(0.0, extra), 6)))
    return tuple(points)


def hand_off_s(device: DeviceProfile, values: list[dict[str, float]], rows: int, seq: int) -> float:
    """The seconds one blocking hand-off between two ranks costs in the calibration run: the p2p time that makes
    the simulator's 1F1B makespan, fed with each rank's measured compute, equal the measured schedule.

    Why: on a busy node a receiver whose data arrived still waits to be scheduled again; the link's
    latency measured on an idle node misses that. The cost model charges it on every boundary transfer
    and every step of a tp collective (``CostModel``)."""
    from ..schedules import get_schedule, simulate

    S, M = len(values), MICRO_BATCHES_PER_STAGE * len(values)
    f1, b1, _ = device.layer(1, rows, seq, False)
    share = f1 / (f1 + b1) if f1 + b1 > 0 else 1 / 3
    fwd = [v["compute_s"] / M * share for v in values]
    bwd = [v["compute_s"] / M * (1 - share) for v in values]
    target = max(v["schedule_s"] for v in values)
    schedule = get_schedule("1f1b")

    def makespan(p2p: float) -> float:
        return simulate(schedule, S, M, forward_s=fwd, backward_s=bwd, p2p_s=p2p).makespan

    lo, hi = 0.0, target
    if makespan(lo) >= target:
        return 0.0
    for _ in range(40):  # makespan grows with p2p: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if makespan(mid) < target else (lo, mid)
    return (lo + hi) / 2
