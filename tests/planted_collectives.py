"""A deliberately wrong communicator for the collectives conformance test (imported by the worker ranks).

``make`` is a ``communicator_factory``: rank 1 zeroes its all_reduce input before the real
reduction, so every all_reduce silently drops one rank's contribution while every other op is
untouched.
"""
from __future__ import annotations

from typing import Any

import torch

from hal.collectives import Communicator, current_world
from hal.collectives.process_groups import make_layout


class DroppingCommunicator(Communicator):
    """all_reduce loses rank 1's contribution; everything else is the real Communicator."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", **kwargs: Any) -> Any:
        if self.rank == 1:
            tensor.zero_()
        return super().all_reduce(tensor, op, **kwargs)


def make(*, validate: bool = True) -> Communicator:
    world = current_world()
    return DroppingCommunicator(make_layout(world, range(world.size)), world, validate=validate)


# --- jobs for conformance.spawn's failure paths (``run_job("tests.planted_collectives:hang", ...)``) ---


def hang(world: Any, spec: dict) -> None:
    """Rank 1 never arrives; rank 0 waits in an all_reduce: only the job deadline ends this."""
    import time

    from hal.collectives import world_communicator

    comm = world_communicator(validate=False)
    if world.rank == 1:
        time.sleep(3600)
    comm.all_reduce(torch.ones(4))


def crash(world: Any, spec: dict) -> None:
    """Rank 1 raises while rank 0 waits in an all_reduce."""
    from hal.collectives import world_communicator

    comm = world_communicator(validate=False)
    if world.rank == 1:
        raise RuntimeError("planted crash on rank 1")
    comm.all_reduce(torch.ones(4))
