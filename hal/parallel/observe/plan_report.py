"""A validated run config and its topology as plain data: what ``hal plan`` shows and ``--json`` prints."""
from __future__ import annotations

from typing import Any

from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.run import RunConfig
from hal.parallel.config.topology import Topology
from hal.parallel.observe.timeline import layer_proportional
from hal.parallel.schedules import simulate
from hal.parallel.schedules.pairs import stage_pairs


def plan_report(run: RunConfig, index: int = 0) -> dict[str, Any]:
    """Replica ``index``'s validated plan and its topology over its own ranks as plain data (a run of one plan:
    ``--json`` prints exactly this)."""
    replica = run.replicas.replicas[index]
    plan, topology = replica.plan, replica.topology()
    return {
        "config": run.origin,
        "model": run.model.to_dict(),
        "plan": plan.to_dict(),
        "train": run.train.to_dict(),
        "global_batch_size": plan.global_batch_size,
        "precision": run.hal.precision,
        "stage_precision": [s.precision or run.hal.precision for s in plan.stages],
        "topology": topology.to_dict(),
        "schedule": {**schedule_prediction(plan), **_pairs(run, plan, topology)},
    }


def _pairs(run: RunConfig, plan: ParallelPlan, topology: Topology) -> dict[str, Any]:
    """{"pairs": how each stage runs DualPipeV's pairs (``pairs.stage_pairs``)}, or nothing for a schedule without."""
    how = [stage_pairs(plan.schedule, plan.num_stages, plan.micro_batches, m, run.model) for m in topology.stages]
    return {"pairs": how} if any(h is not None for h in how) else {}


def replicated_report(run: RunConfig) -> dict[str, Any]:
    """A run of several replicas: each replica's ``plan_report`` with its rows, the global batch and the sync
    settings."""
    replicas = [{"replica": index, "rows": replica.rows, "ranks": list(replica.ranks), **plan_report(run, index)}
                for index, replica in enumerate(run.replicas.replicas)]
    return {"config": run.origin, "model": run.model.to_dict(), "train": run.train.to_dict(),
            "global_batch_size": run.replicas.global_batch, "world_size": run.replicas.world_size,
            "replica_sync": run.replicas.sync.to_dict(), "replicas": replicas}


def schedule_prediction(plan: ParallelPlan) -> dict[str, Any]:
    """The schedule played with each stage's time proportional to its layers (backward = 2 x forward).

    A first look, not a profile: devices of different speed, the head and the boundaries are left out
    (the planner's cost model adds them). Gives each stage's idle share and most micro-batches in flight.
    """
    V = plan.virtual_stages
    sim = simulate(plan.schedule, plan.num_stages, plan.micro_batches, virtual_stages=V,
                   **layer_proportional(plan))
    return {"name": plan.schedule.name, "assumes": "stage time proportional to its layers, backward = 2 x forward",
            "bubble": [round(b, 4) for b in sim.bubble], "bubble_overall": round(sim.bubble_overall, 4),
            "in_flight": list(sim.peak_in_flight), "virtual_stages": V}
