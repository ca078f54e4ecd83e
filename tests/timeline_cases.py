"""Per-rank body for the timeline tests (run through tests.dist_harness): a short engine run's spans."""
from __future__ import annotations

from typing import Any


def spans_run(rank: int, world: int, plan_raw: dict, steps: int) -> dict[str, Any]:
    """``steps`` steps of ``plan_raw`` on this rank; the last step's spans and this stage's program, as plain data."""
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.observe.timeline import rank_record
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh
    from hal.parallel.schedules import P2PBatch

    from .engine_cases import MODEL, batch, model_config

    plan = parse_plan(plan_raw)
    topology = Topology.from_plan(plan)
    groups = build_mesh(topology, current_world(), validate=False)  # as hal train runs it
    engine = build_engine(model_config(False, sum(s.layer_count for s in plan.stages)), plan, groups,
                            backend=current_world().backend, seed=0, device=current_world().device)
    for step in range(steps):
        engine.step(batch(0, step, plan.micro_batches, plan.micro_batch_size, MODEL.max_seq_len, MODEL.vocab_size))
    record = rank_record(rank, groups.coord.stage, groups.coord.dp, groups.coord.tp, engine.step_spans(),
                         host="h", clock_at_origin=0.0)
    program = [(s.kind.value, s.micro_batch, s.chunk) for s in engine.program if not isinstance(s, P2PBatch)]
    batches = sum(isinstance(s, P2PBatch) for s in engine.program)
    return {"record": record, "program": program, "batches": batches, "compute_s": engine.times.compute,
            "p2p_s": engine.times.p2p}
