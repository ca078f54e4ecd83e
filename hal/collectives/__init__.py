"""Collectives: one API over every vendor CCL, and a bridge between vendor islands.

    from hal.collectives import init_distributed, world_communicator
    init_distributed("cpu")            # under hal launch / torchrun
    comm = world_communicator()
    comm.all_reduce(t, "sum")
"""
from .communicator import P2P, Communicator, Handle, world_communicator
from .errors import CollectiveError, CollectivePeerLost, CollectiveTimeout
from .process_groups import Island, Layout, World, current_world, init_distributed, shutdown

__all__ = [
    "P2P", "CollectiveError", "CollectivePeerLost", "CollectiveTimeout", "Communicator", "Handle", "Island", "Layout", "World",
    "current_world", "init_distributed", "shutdown", "world_communicator",
]
