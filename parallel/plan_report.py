"""A validated run config and its topology as plain data: what ``hal plan`` shows and ``--json`` prints."""
from __future__ import annotations

from typing import Any

from .run_config import RunConfig
from .topology import Topology


def plan_report(run: RunConfig) -> dict[str, Any]:
    """The validated plan and its topology as plain data (``--json`` prints exactly this)."""
    return {
        "config": run.origin,
        "model": run.model.to_dict(),
        "plan": run.plan.to_dict(),
        "train": run.train.to_dict(),
        "global_batch_size": run.plan.global_batch_size,
        "topology": Topology.from_plan(run.plan).to_dict(),
    }
