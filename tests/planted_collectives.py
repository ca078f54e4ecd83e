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


def crash_slowly(world: Any, spec: dict) -> None:
    """Rank 1 drops its connections (rank 0, waiting in an all_reduce, fails at once: it lost a peer), then takes a
    second before it raises: a crashing rank still tearing down when its victim's exit is seen."""
    import os
    import socket
    import stat
    import time

    from hal.collectives import world_communicator

    comm = world_communicator(validate=False)
    if world.rank == 1:
        for fd in map(int, os.listdir("/proc/self/fd")):  # every connection shut, as a dying process's are
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    sock = socket.socket(fileno=fd)
                    try:
                        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # not a listener
                            sock.shutdown(socket.SHUT_RDWR)
                    finally:
                        sock.detach()  # the descriptor stays gloo's
            except OSError:
                pass
        time.sleep(1.0)
        raise RuntimeError("planted crash on rank 1")
    comm.all_reduce(torch.ones(4))


def crash(world: Any, spec: dict) -> None:
    """Rank 1 raises while rank 0 waits in an all_reduce."""
    from hal.collectives import world_communicator

    comm = world_communicator(validate=False)
    if world.rank == 1:
        raise RuntimeError("planted crash on rank 1")
    comm.all_reduce(torch.ones(4))
