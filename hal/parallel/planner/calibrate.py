"""How much slower cpu ranks train inside a real pipeline run than one rank alone: the in-run costs of a node.

Why measure it: the layer points of a profile are timed in one process with the node to itself. In a run,
a node's ranks share its cores, caches, memory bandwidth and clock; a rank whose input arrived may wait
for a core, and each blocking exchange waits for its partner to be scheduled. On this project's 2-core
CI host that costs 1.2–2.3× — more than the ranks-over-cores share the cost model once assumed. No
formula gets that right for every host, so ``hal profile`` runs the engine itself on the node's ranks
and fits what the simulator needs to reproduce the measured schedules (``calibrate_node``):

- all of the node's ranks in three 1F1B pipelines — busy (4 layers a stage, 4 × stages micro-batches of
  the largest profiled row count, as in real plans), sparse (one micro-batch a stage: a large bubble)
  and short actions (one layer, one row) — fit a slowdown on compute, how it grows with the node's
  occupancy, and a fixed wait every action pays (the hand-off partner being scheduled: on the CI host
  about 2 ms, which a plan of short actions — small micro-batches, interleaving, zero-bubble's split
  backward — pays more often; without it those plans were under-predicted by up to a third);
- half of the ranks in the busy pipeline (where they fit the cores: no wait) give a point at lower load;
- tp-2 stages, sequence parallelism off and on, give the wait each tp all-reduce or sp exchange adds.

Occupancy is the node's busy share (as the simulator plays the pipeline: the axis the cost model reads a
plan's occupancy on) × ranks × threads over cores; the cost model interpolates the points
(``DeviceProfile.stretch``, ``action_wait_s``, ``tp_all_reduce_s``, ``sp_exchange_s``).

Why fitted on whole schedules and not on the host clock's split of a run into compute and waiting: on a
noisy shared host that split moves the same lost time between the two from run to run (fitted that way,
a per-transfer wait swung by 3× between calibrations). Makespans of pipelines that differ in action size
and bubble are stable, and three of them pin three unknowns.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hal.parallel.config.model import ModelConfig
from hal.parallel.planner.device_profile import DeviceProfile

STEPS = 5  # timed steps (the median is kept) a calibration run, after one warm-up step
LAYERS, MICRO_BATCHES_PER_STAGE = 4, 4  # a stage's layers; micro-batches = 4 × stages: busy ranks, as in real plans
# the ranks' backend, said to the launcher: cpu ranks fork from one interpreter that imported torch (as hal train's
# do) instead of each starting its own
CPU_RANKS = {"HAL_BACKEND": "cpu"}


def calibration_plan(backend: str, stages: int, rows: int, tp: int = 1, layers: int = LAYERS,
                     per_stage: int = MICRO_BATCHES_PER_STAGE, sp: bool = False) -> Any:
    """The calibration pipeline: ``stages`` stages of ``tp`` ranks (sequence parallel when ``sp``) and ``layers``
    layers, 1F1B, ``per_stage`` × stages micro-batches of ``rows`` rows."""
    from hal.parallel.config.plan import ParallelPlan, StagePlan

    return ParallelPlan(tuple(StagePlan(backend, tp, layers, tp=tp, sp=sp) for _ in range(stages)), "1f1b",
                        per_stage * stages, rows)


def calibration_rank(model: dict[str, Any], rows: int, seq: int, threads: int | None, steps: int, tp: int = 1,
                     backend_name: str = "cpu", precision: str = "fp32", fallback: str = "warn",
                     trainer_step: bool = False, shapes: list[list[int]] | None = None) -> Any:
    """One rank of the calibration pipeline (stages of ``tp`` ranks, LAYERS layers each): its median compute and
    schedule seconds a step (host clock). ``shapes``: [layers, micro-batches per stage, rows(, sp)] pipelines run
    one after another in the same ranks instead (one process start for all); a list of results, one a shape.

    ``trainer_step``: each step as ``hal train`` runs it instead — a fresh batch, the loss read on the last
    stage, AdamW, and every rank's times gathered over the default group (a host barrier a step) — timed as
    ``hal train`` times it (``steps_s``: this rank's wall time of each step, its device unsynchronized)."""
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh
    from hal.parallel.planner.measure import profiling_rank

    if threads is not None:
        torch.set_num_threads(threads)
    with profiling_rank(backend_name, precision, fallback) as (world, backend, mode):
        stages = world.size // tp
        out = []
        for layers, per_stage, shape_rows, *sp in shapes or [[LAYERS, MICRO_BATCHES_PER_STAGE, rows]]:
            config = ModelConfig(**{**model, "num_layers": stages * layers})
            plan = calibration_plan(backend_name, stages, shape_rows, tp, layers, per_stage, bool(sp and sp[0]))
            topology = Topology.from_plan(plan)
            groups = build_mesh(topology, world, validate=False)
            engine = build_engine(config, plan, groups, backend=backend, seed=0, device=world.device,
                                    dtype=torch.float32, seq_len=seq, autocast=lambda: mode.autocast(backend))
            if trainer_step:
                return {"steps_s": _trainer_steps(engine, config, plan, seq, steps)}
            gen = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, config.vocab_size, (plan.micro_batches, shape_rows, seq + 1), generator=gen)
            compute, schedule = [], []
            for i in range(steps + 1):
                engine.module.zero_grad(set_to_none=True)
                engine.step_lazy(tokens)
                if i:  # the first step warms the allocator and the op caches
                    compute.append(engine.times.compute)
                    schedule.append(engine.times.schedule)
            out.append({"compute_s": statistics.median(compute), "schedule_s": statistics.median(schedule)})
        return out if shapes else out[0]


def _trainer_steps(engine: Any, config: ModelConfig, plan: Any, seq: int, steps: int) -> list[float]:
    """``steps`` + 1 steps the way ``parallel.loop.trainer`` runs them; this rank's wall seconds of each after the first."""
    import time

    import torch.distributed as dist

    from hal.parallel.data.batches import global_batch
    from hal.parallel.loop.optim_schedule import decoupled_adamw

    optimizer = decoupled_adamw([p for p in engine.module.parameters() if p.requires_grad], engine.device, lr=1e-4)
    out = []
    for step in range(steps + 1):
        started = time.perf_counter()
        tokens = global_batch("synthetic", 0, step, plan.micro_batches, plan.micro_batch_size, seq, config.vocab_size)
        optimizer.zero_grad(set_to_none=True)
        engine.step(tokens)  # the last stage reads its loss: its host waits for its device, as in hal train
        optimizer.step()
        took = time.perf_counter() - started
        row = torch.tensor([took], dtype=torch.float64)
        gathered = [torch.empty_like(row) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
        dist.gather(row, gathered, dst=0)  # hal train's per-step gather of every rank's times
        if step:
            out.append(took)
    return out


def solo_compute_s(device: DeviceProfile, stages: int, stage: int, rows: int, seq: int, tp: int = 1, layers: int = LAYERS,
                   per_stage: int = MICRO_BATCHES_PER_STAGE) -> float:
    """What the profile predicts for stage ``stage`` of the calibration pipeline alone, without tp's
    communication: its micro-batches through its layers, plus the embedding (first) or the head (last)."""
    f, b, _ = device.layer(tp, rows, seq, False)
    per = layers * (f + b)
    tokens = rows * seq
    if stage == 0:
        per += tokens * (device.embedding.forward_s + device.embedding.backward_s)
    if stage == stages - 1:
        per += tokens * (device.head.forward_s + device.head.backward_s) / tp
    return per_stage * stages * per


Shape = tuple[int, int, int]  # a calibration pipeline: layers a stage, micro-batches a stage, rows a micro-batch


def node_shapes(rows: int) -> tuple[Shape, Shape, Shape]:
    """The three pipelines run on all of a node's ranks: the standard one (busy ranks, as in real plans), a sparse
    one (one micro-batch a stage: a large bubble, the node less busy) and one of short actions (one layer, one
    row: the fixed cost of each action shows). Three runs for three unknowns (``fit_node``)."""
    return (LAYERS, MICRO_BATCHES_PER_STAGE, rows), (LAYERS, 1, rows), (1, MICRO_BATCHES_PER_STAGE, 1)


@dataclass(frozen=True)
class Played:
    """A calibration pipeline as the simulator plays it from the profile's solo times."""

    compute_s: float  # the makespan with solo compute (no slowdown, no wait, no transfers)
    per_wait: float  # how much the makespan grows per second added to every action
    busy: float  # the stages' mean busy share (1 − bubble)
    p2p_s: float = 0.0  # what the boundary transfers add to the makespan (the cost model charges them apart)


def play(device: DeviceProfile, stages: int, shape: Shape, seq: int, tp: int = 1, p2p_s: float = 0.0) -> Played:
    """The simulator's view of one calibration pipeline: its makespan is about linear in a slowdown s on compute
    and a wait w added to each action (equal stages keep one critical path), so two plays give both coefficients;
    a third gives what the transfers (``p2p_s`` each, timed as the cost model times them) add."""
    from hal.parallel.schedules import OneFOneB, simulate

    layers, per_stage, rows = shape
    M = per_stage * stages
    f1, b1, _ = device.layer(tp, rows, seq, False)
    share = f1 / (f1 + b1) if f1 + b1 > 0 else 1 / 3
    solo = [solo_compute_s(device, stages, k, rows, seq, tp, layers, per_stage) / M for k in range(stages)]
    times = {"forward_s": [c * share for c in solo], "backward_s": [c * (1 - share) for c in solo]}
    compute = simulate(OneFOneB(), stages, M, **times)
    waits = simulate(OneFOneB(), stages, M, forward_s=0.0, backward_s=0.0, action_s=1.0)
    sent = simulate(OneFOneB(), stages, M, p2p_s=p2p_s, **times).makespan if p2p_s else compute.makespan
    return Played(compute.makespan, waits.makespan, statistics.mean(1.0 - b for b in compute.bubble),
                  sent - compute.makespan)


def calibrate_node(device: DeviceProfile, model: ModelConfig, *, ranks: int, cores: int, threads: int, rows: int, seq: int,
                   launch: Callable[..., Any], steps: int = STEPS,
                   boundary: Callable[[int], float] = lambda rows: 0.0) -> tuple[tuple[float, float, float], ...]:
    """(occupancy, slowdown, wait per action) points for a node of ``cores`` cores: one rank alone (1, 0: the
    profile's own conditions); all ``ranks`` ranks in the three ``node_shapes`` pipelines (two points: the sparse
    and the standard one's occupancy, one wait); and, where ranks > 2, half of them in the standard pipeline.

    Occupancy = the simulated busy share × ranks × threads / cores. Why simulated and not the host clock's own
    busy share: the cost model looks a plan's occupancy up from the simulator's bubble, so a point must sit
    on that axis; the host clock counts a descheduled rank's wait as idle and put the points left of where
    the cost model looks. Why a wait per action beside the slowdown: where ranks outnumber cores, each hand-off
    waits for the partner to be scheduled — a fixed cost an action, which a plan of short actions (small
    micro-batches, few layers a stage, interleaving, zero-bubble's split backward) pays more often. ``boundary``:
    seconds of one boundary transfer of a micro-batch of that many rows, as the cost model will time it — played
    here too, so the fit does not count transfers twice."""
    import sys

    points: list[tuple[float, float, float]] = [(round(threads / cores, 4), 1.0, 0.0)]
    occupancy = lambda played, count: round(played.busy * count * threads / cores, 4)  # noqa: E731
    full_shapes = node_shapes(rows)
    run = launch(f"{__name__}:calibration_rank", ranks,
                 {"model": model.to_dict(), "rows": rows, "seq": seq, "threads": threads, "steps": steps,
                  "shapes": [list(x) for x in full_shapes]},
                 deadline_s=300, what=f"hal profile: calibration pipelines of {ranks} cpu ranks", echo_stderr=sys.stderr,
                 env=CPU_RANKS)
    played = [play(device, ranks, shape, seq, p2p_s=boundary(shape[2])) for shape in full_shapes]
    measured = [max(run.values[r][i]["schedule_s"] for r in range(ranks)) - p.p2p_s for i, p in enumerate(played)]
    occ = [occupancy(p, ranks) for p in played]
    slowdown, slope, wait = fit_node(played, occ, measured)
    points += [(occ[1], round(max(1.0, slowdown + slope * (occ[1] - occ[0])), 4), round(wait, 6)),
               (occ[0], round(slowdown, 4), round(wait, 6))]
    half = max(2, ranks // 2)
    if half < ranks:
        standard = full_shapes[0]
        run = launch(f"{__name__}:calibration_rank", half,
                     {"model": model.to_dict(), "rows": rows, "seq": seq, "threads": threads, "steps": steps},
                     deadline_s=300, what=f"hal profile: calibration pipeline of {half} cpu ranks", echo_stderr=sys.stderr,
                     env=CPU_RANKS)
        p = play(device, half, standard, seq, p2p_s=boundary(rows))
        half_wait = 0.0 if half * threads <= cores else wait  # ranks that fit the cores hand off without waiting
        target = max(run.values[r]["schedule_s"] for r in range(half)) - p.p2p_s
        s = max(1.0, (target - half_wait * p.per_wait) / p.compute_s) if p.compute_s > 0 else 1.0
        points.append((occupancy(p, half), round(s, 4), round(half_wait, 6)))
    return tuple(sorted(points))


def fit_node(played: list[Played], occupancy: list[float], measured: list[float]) -> tuple[float, float, float]:
    """(slowdown at the first pipeline's occupancy, its growth per unit of occupancy, wait per action) with which the
    simulator reproduces the measured makespans: makespan_i = (s + k·(occ_i − occ_0))·compute_i + w·per_wait_i.

    Least squares, then the physical bounds: a wait is never negative (refit without it), a busier node never
    computes faster (refit with k = 0), a slowdown is at least 1."""
    import numpy as np

    rows = [[p.compute_s, (o - occupancy[0]) * p.compute_s, p.per_wait] for p, o in zip(played, occupancy)]
    free = [0, 1, 2]
    solution = [1.0, 0.0, 0.0]
    for _ in range(3):
        a = np.array([[r[j] for j in free] for r in rows])
        x, *_ = np.linalg.lstsq(a, np.array(measured), rcond=None)
        solution = [0.0, 0.0, 0.0]
        for j, v in zip(free, x):
            solution[j] = float(v)
        bad = [j for j in (2, 1) if j in free and solution[j] < 0]
        if not bad:
            break
        free.remove(bad[0])
    return max(1.0, solution[0]), max(0.0, solution[1]), max(0.0, solution[2])


def calibrate_tp(device: DeviceProfile, model: ModelConfig, *, ranks: int, cores: int, threads: int, rows: int, seq: int,
                 launch: Callable[..., Any], steps: int = STEPS,
                 boundary: Callable[[int], float] = lambda rows: 0.0) -> tuple[tuple[float, ...], ...]:
    """(occupancy, seconds a tp all-reduce costs inside a layer, seconds a sequence-parallel exchange costs) for a
    node: one rank alone (0, 0) and calibration pipelines of tp-2 stages over the node's ranks, sequence
    parallelism off and on (one launch; a sequence length tp does not divide: off only, and no sp column). Why: tp's collectives are
    blocking exchanges between ranks that compute
    together; on a busy node each waits for its partner to be scheduled — and sp makes twice as many of them
    (an all-gather and a reduce-scatter where tp has one all-reduce), each half the size."""
    import sys

    tp = 2
    stages = ranks // tp
    with_sp = seq % tp == 0  # sp splits the sequence over the tp ranks
    points: list[tuple[float, ...]] = [(round(threads / cores, 4), 0.0, 0.0) if with_sp else (round(threads / cores, 4), 0.0)]
    if stages < 1:
        return tuple(points)
    shapes = [[LAYERS, MICRO_BATCHES_PER_STAGE, rows, sp] for sp in ((0, 1) if with_sp else (0,))]
    run = launch(f"{__name__}:calibration_rank", stages * tp,
                 {"model": model.to_dict(), "rows": rows, "seq": seq, "threads": threads, "steps": steps, "tp": tp, "shapes": shapes},
                 deadline_s=300, what=f"hal profile: calibration pipelines of {stages} tp-{tp} stage(s), sp off and on",
                 echo_stderr=sys.stderr, env=CPU_RANKS)
    occupancy = play(device, stages, node_shapes(rows)[0], seq, tp).busy * stages * tp * threads / cores
    waits = [tp_wait_s(device, [run.values[r][i] for r in range(stages * tp)], stages, tp, rows, seq, occupancy, bool(sp),
                       boundary(rows))
             for i, (*_, sp) in enumerate(shapes)]
    points.append((round(occupancy, 4), *(round(w, 6) for w in waits)))
    return tuple(points)


TP_EXCHANGES = {False: 2, True: 4}  # blocking tp exchanges a layer each way: two all-reduces, or sp's 2 all-gathers + 2 reduce-scatters


def tp_wait_s(device: DeviceProfile, values: list[dict[str, float]], stages: int, tp: int, rows: int, seq: int,
              occupancy: float, sp: bool = False, p2p_s: float = 0.0) -> float:
    """Seconds per tp exchange with which the simulator — each stage's solo compute × the node's slowdown at
    this occupancy and its wait per action, plus TP_EXCHANGES[sp] exchanges a layer each way a micro-batch —
    reproduces the tp run's measured schedule."""
    from hal.parallel.schedules import OneFOneB, simulate

    M = MICRO_BATCHES_PER_STAGE * stages
    stretch = device.stretch(occupancy) or 1.0
    per_action = device.action_wait_s(occupancy)
    solo = [stretch * solo_compute_s(device, stages, k, rows, seq, tp) / M for k in range(stages)]
    calls = LAYERS * 2 * TP_EXCHANGES[sp]  # a micro-batch's exchanges, forward and backward
    target = max(v["schedule_s"] for v in values)

    def makespan(wait: float) -> float:  # linear in ``wait``: forward and backward each take half the calls
        return simulate(OneFOneB(), stages, M, forward_s=[c / 3 + wait * calls / 2 for c in solo],
                        backward_s=[2 * c / 3 + wait * calls / 2 for c in solo], action_s=per_action, p2p_s=p2p_s).makespan

    base, slope = makespan(0.0), makespan(1e-3) - makespan(0.0)
    return max(0.0, (target - base) / slope * 1e-3) if slope > 0 else 0.0


HOST_STAGES, HOST_ROWS = 2, 1  # the accelerator calibration: 2 stages, 1 row a micro-batch (the host's pace shows)


def calibrate_host(device: DeviceProfile, cluster: Any, kind: Any, model: ModelConfig, *, precision: str, seq: int,
                   launch: Callable[..., Any], steps: int = STEPS, fallback: str = "warn") -> float:
    """The engine's host seconds per compute action on an accelerator (its P2P posts and bookkeeping included): the
    value with which the cost model reproduces a measured calibration pipeline (2 stages of LAYERS layers, 1F1B,
    8 micro-batches of one row) on two of this host's devices (the caller checks it has them).

    Why: an accelerator's host enqueues everything a step runs — the layers (measured per layer point) and
    the engine's own work between them (P2P batches, bookkeeping, the loss), which no layer point holds. On a
    host-bound device that work is part of the step time; per action it is about constant."""
    import dataclasses
    import sys

    from hal.parallel.planner.cost import CostModel, Placement
    from hal.parallel.planner.device_profile import Profile

    run = launch(f"{__name__}:calibration_rank", HOST_STAGES,
                 {"model": model.to_dict(), "rows": HOST_ROWS, "seq": seq, "threads": None, "steps": steps,
                  "backend_name": kind.backend, "precision": precision, "fallback": fallback, "trainer_step": True},
                 deadline_s=300, what=f"hal profile: calibration pipeline of {HOST_STAGES} {kind.backend} ranks", echo_stderr=sys.stderr,
                 env={"HAL_BACKEND": kind.backend})
    # hal train's step time: each step's slowest rank (the last stage waits for its loss), the median over steps
    per_step = [max(t) for t in zip(*(run.values[r]["steps_s"] for r in range(HOST_STAGES)))]
    measured = statistics.median(per_step)
    plan = calibration_plan(kind.backend, HOST_STAGES, HOST_ROWS)
    config = ModelConfig(**{**model.to_dict(), "num_layers": HOST_STAGES * LAYERS})
    place = Placement.pack(plan, (kind,) * HOST_STAGES)

    def predicted(per_action: float) -> float:
        prof = Profile(config.to_dict(), precision, {kind.device: dataclasses.replace(device, action_host_s=per_action)}, seq=seq)
        return CostModel(cluster, prof, config, seq).predict(plan, place).step_s

    return fit_increasing(predicted, measured)


def fit_increasing(f: Callable[[float], float], target: float, iterations: int = 50) -> float:
    """The x ≥ 0 with f(x) = target for a nondecreasing f (0 when f(0) is already at or above it)."""
    if f(0.0) >= target:
        return 0.0
    hi = 1e-3
    while f(hi) < target and hi < 10.0:
        hi *= 2
    lo = 0.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return round((lo + hi) / 2, 9)
