"""``rows: auto``: each replica's share of the step set from its measured speed, by a short calibration at start.

Every replica with ``rows: auto`` times a few forward/backward steps of its own plan on random tokens (gradients
dropped, weights untouched; the first step is a warm-up), and reports rows per second; every rank gathers the
figures (one small gather over the world) and computes the same shares (``parallel.config.replicas.auto_rows``:
whole micro-batches, at least one each, adding up to the global batch). A replica with fixed rows keeps them.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.replicas import ReplicatedPlan, auto_rows

CALIBRATION_STEPS = 3  # timed steps after one warm-up


def rows_per_second(engine: Any, plan: ParallelPlan, seq: int, vocab: int, steps: int = CALIBRATION_STEPS) -> float:
    """This replica's training speed in rows a second: the median of ``steps`` timed forward/backward steps (after one
    warm-up) of ``engine`` on random tokens. Every rank of the replica calls it; the gradients are dropped."""
    generator = torch.Generator().manual_seed(12345)
    tokens = torch.randint(0, vocab, (plan.micro_batches, plan.micro_batch_size, seq + 1), generator=generator)
    times = []
    for index in range(steps + 1):
        began = time.perf_counter()
        engine.step(tokens)
        engine.backend.synchronize()
        if index:
            times.append(time.perf_counter() - began)
        for p in engine.module.parameters():
            p.grad = None
    engine.module.take_moe_tally()  # the calibration's routing is not the first step's load
    return plan.global_batch_size / statistics.median(times)


def resolve_shares(replicas: ReplicatedPlan, replica: int, measure: Callable[[], float], speaks: bool,
                   say: Callable[[str], None] | None = None) -> ReplicatedPlan:
    """The replicas with every ``auto`` replaced by rows from measured speed. Collective over the world: every rank
    calls it; ``measure()`` runs on the ranks of auto replicas (all of a replica's ranks: it steps the engine);
    ``speaks``: this rank reports its replica's figure (one rank a replica). ``say``: where the shares are told."""
    mine = measure() if replicas.replicas[replica].rows is None else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (replica, mine) if speaks else None)
    speeds = [0.0] * len(replicas.replicas)
    for entry in everyone:
        if entry is not None and entry[1] is not None:
            speeds[entry[0]] = float(entry[1])
    fixed = [r.rows for r in replicas.replicas]
    rows = auto_rows(speeds, replicas.global_batch, [r.plan.micro_batch_size for r in replicas.replicas], fixed)
    if say is not None:
        parts = [f"replica {i}: {n} rows" + (f" ({speeds[i]:.1f} rows/s measured)" if fixed[i] is None else " (fixed)")
                 for i, n in enumerate(rows)]
        say(f"replica shares by measured speed ({CALIBRATION_STEPS} calibration steps each): " + "; ".join(parts))
    return replicas.with_rows(rows)
