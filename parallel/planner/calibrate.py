"""How much slower cpu ranks train inside a real pipeline run than one rank alone: the in-run slowdown of a node.

Why measure it: the layer points of a profile are timed in one process with the node to itself. In a run,
a node's ranks share its cores, caches, memory bandwidth and clock; a rank whose input arrived may wait
for a core, and each blocking exchange waits for its partner to be scheduled. On this project's 2-core
CI host that costs 1.3–2.2× — more than the ranks-over-cores share the cost model assumed before. No
formula gets that right for every host, so ``hal profile`` runs the engine itself on the node's ranks: a
1F1B pipeline of 4 layers a stage and 4 × stages micro-batches of the largest profiled row count (busy
ranks, as in real plans), and finds the factor on the profile's solo compute times with which the
simulator reproduces the measured schedule. Two such runs (every rank of the node, and half of them) give
(occupancy, slowdown) points — occupancy is the busy share of the node's ranks × their threads over its
cores — and one run of tp-2 stages gives the wait one tp all-reduce costs beyond that. The cost model
interpolates them (``DeviceProfile.stretch``, ``DeviceProfile.tp_all_reduce_s``).

Why one factor on compute rather than a compute slowdown plus a wait per transfer: on a noisy shared host
the host clock splits the same lost time between "compute" and "waiting" differently from run to run;
fitted separately, the two parts swung by 3× between calibrations and extrapolated apart. Their sum —
the schedule — is what the cost model predicts, and is stable.
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
                   launch: Callable[..., Any], steps: int = STEPS) -> tuple[tuple[float, float], ...]:
    """(occupancy, slowdown) points for a node of ``cores`` cores: one rank alone (slowdown 1: the profile's own
    conditions), one calibration run with ``ranks`` ranks and, where ranks > 2, one with half of them.
    Occupancy = mean busy share × ranks × threads / cores."""
    import sys

    points = [(round(threads / cores, 4), 1.0)]  # one rank alone: the profile's own conditions
    for count in sorted({ranks, max(2, ranks // 2)}):
        if count < 2:
            continue
        run = launch(f"{__name__}:calibration_rank", count,
                     {"model": model.to_dict(), "rows": rows, "seq": seq, "threads": threads, "steps": steps},
                     deadline_s=300, what=f"hal profile: calibration pipeline of {count} cpu ranks", echo_stderr=sys.stderr)
        values = [run.values[r] for r in range(count)]
        slowdown = schedule_slowdown(device, values, rows, seq)
        busy = statistics.mean(min(1.0, v["compute_s"] / v["schedule_s"]) for v in values)
        points.append((round(busy * count * threads / cores, 4), round(slowdown, 4)))
    return tuple(points)


def schedule_slowdown(device: DeviceProfile, values: list[dict[str, float]], rows: int, seq: int) -> float:
    """The factor on every stage's solo compute with which the simulator's 1F1B makespan equals the measured
    schedule of the calibration run (at least 1)."""
    from ..schedules import get_schedule, simulate

    S, M = len(values), MICRO_BATCHES_PER_STAGE * len(values)
    f1, b1, _ = device.layer(1, rows, seq, False)
    share = f1 / (f1 + b1) if f1 + b1 > 0 else 1 / 3
    solo = [solo_compute_s(device, S, k, rows, seq) / M for k in range(S)]
    target = max(v["schedule_s"] for v in values)
    # without p2p time the makespan scales linearly with every stage's compute: one simulation gives the factor
    base = simulate(get_schedule("1f1b"), S, M, forward_s=[c * share for c in solo],
                    backward_s=[c * (1 - share) for c in solo]).makespan
    return max(1.0, target / base) if base > 0 else 1.0


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
    points.append((round(occupancy, 4), round(tp_wait_s(device, values, stages, tp, rows, seq, occupancy), 6)))
    return tuple(points)


def tp_wait_s(device: DeviceProfile, values: list[dict[str, float]], stages: int, tp: int, rows: int, seq: int,
              occupancy: float) -> float:
    """Seconds per tp all-reduce with which the simulator — each stage's solo compute × the node's slowdown at
    this occupancy, plus 4 all-reduces a layer a micro-batch — reproduces the tp run's measured schedule."""
    from ..schedules import get_schedule, simulate

    M = MICRO_BATCHES_PER_STAGE * stages
    stretch = device.stretch(occupancy) or 1.0
    solo = [stretch * solo_compute_s(device, stages, k, rows, seq, tp) / M for k in range(stages)]
    calls = LAYERS * 4  # a micro-batch: two all-reduces a layer forward, two backward
    target = max(v["schedule_s"] for v in values)

    def makespan(wait: float) -> float:  # linear in ``wait``: forward and backward each take half the calls
        return simulate(get_schedule("1f1b"), stages, M, forward_s=[c / 3 + wait * calls / 2 for c in solo],
                        backward_s=[2 * c / 3 + wait * calls / 2 for c in solo]).makespan

    base, slope = makespan(0.0), makespan(1e-3) - makespan(0.0)
    return max(0.0, (target - base) / slope * 1e-3) if slope > 0 else 0.0
