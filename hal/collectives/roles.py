"""Roles after rendezvous: under torchrun's c10d rendezvous, node ranks follow the order nodes join, so a rank's place
in a heterogeneous plan is decided here by what it is — the island (component) its launcher put it in — not by the
order it joined.

Each process says its island (``HAL_ISLAND_INDEX``, set per component by ``hal train --emit``), host and local rank
over a bootstrap gloo group; every process computes the same assignment — island i's processes, ordered by (host,
local rank), take island i's plan ranks in order — and the world is then joined again at those ranks, through a
prefix of the same store (the bootstrap's keys cannot collide), itself under a prefix of this incarnation's own
(``process_groups.incarnation_store``: a restarted world must not read the failed one's addresses). A world that
cannot fill the plan (an island with too few or too many processes, an island the plan does not have) ends with one
line naming it, on every rank, at once.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist

from hal.errors import ConfigError

ROLES_ENV = "HAL_ROLES"  # "by-island": take the plan's ranks by island after rendezvous
ISLAND_ENV = "HAL_ISLAND_INDEX"


@dataclass(frozen=True)
class Joined:
    """What one process said after rendezvous."""

    rank: int  # the rank torchrun gave it (join order)
    island: int
    host: str
    local: int


def assign(joined: Sequence[Joined], islands: Sequence[tuple[str, range]]) -> dict[int, int]:
    """torchrun rank -> plan rank; a ConfigError naming the first island that cannot be filled (the same on every
    process: it is computed from what every process said)."""
    roles: dict[int, int] = {}
    for index, (backend, ranks) in enumerate(islands):
        members = sorted((j for j in joined if j.island == index), key=lambda j: (j.host, j.local, j.rank))
        if len(members) != len(ranks):
            raise ConfigError(f"island {index} ({backend}, plan ranks {ranks.start}-{ranks.stop - 1}) needs {len(ranks)} "
                              f"process(es) and {len(members)} joined; start its component with {len(ranks)} "
                              f"process(es) in all ({ISLAND_ENV}={index})")
        roles.update({j.rank: r for j, r in zip(members, ranks)})
    strays = sorted({j.island for j in joined} - set(range(len(islands))))
    if strays:
        raise ConfigError(f"{ISLAND_ENV}={strays[0]} names no island: the plan has {len(islands)} (0-{len(islands) - 1})")
    return roles


def take_role(islands: Sequence[tuple[str, range]]) -> tuple[int, Any]:
    """Join the bootstrap group, agree on roles, leave it: (this process's plan rank, the store to join the world
    with). Called before ``init_distributed`` where ``HAL_ROLES`` asks for it."""
    given = os.environ.get(ISLAND_ENV)
    if given is None or not given.isdigit():
        raise ConfigError(f"{ROLES_ENV} is set but {ISLAND_ENV} is {given!r}: set it to this component's island index "
                          "(hal train --emit sets both)")
    from hal.collectives.process_groups import DEFAULT_TIMEOUT, incarnation_store

    me = Joined(int(os.environ["RANK"]), int(given), socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ["WORLD_SIZE"])
    store = incarnation_store(me.rank, world, DEFAULT_TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore("bootstrap/", store), rank=me.rank, world_size=world)
    try:
        said: list[Any] = [None] * world
        dist.all_gather_object(said, me)
        roles = assign(said, islands)
    finally:
        dist.destroy_process_group()
    return roles[me.rank], dist.PrefixStore("roles/", store)
