"""One rank of a multi-process conformance job: ``run_rank``, started by a launcher through ``conformance.jobs.launch``.

The rank joins the world through ``collectives.init_distributed`` on the backend under test (its
rank, size and rendezvous come from the launcher's environment: RANK, WORLD_SIZE, LOCAL_RANK,
HAL_INIT_METHOD), runs the job's per-rank function on the spec and returns what it returns
(tensors, numbers, strings, lists and dicts). Any exception propagates: the launcher prints it,
the rank exits 1, and the others are stopped.

A job is a name in ``JOBS`` or any importable ``"module:callable"`` with the signature
``fn(world: collectives.World, spec: dict) -> object``.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

from hal.plugins import resolve

JOBS: dict[str, str] = {
    "collectives": "hal.conformance.jobs.collective_job:run_rank",
    "pipeline": "hal.conformance.jobs.pipeline_check:run_rank",
}


def run_rank(job: str, spec: dict[str, Any], backend: str, collective_timeout_s: float = 60.0) -> Any:
    """This rank's part of ``job``: join the world, run the job function on ``spec``, leave; its value."""
    import torch

    from hal.collectives import init_distributed, shutdown

    world = init_distributed(
        backend, init_method=os.environ.get("HAL_INIT_METHOD"), timeout=datetime.timedelta(seconds=collective_timeout_s),
    )
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the host's cores
    try:
        return resolve(JOBS.get(job, job), "job")(world, spec)
    finally:
        shutdown()
