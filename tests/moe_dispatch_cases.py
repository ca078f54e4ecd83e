"""Rank bodies for tests/test_moe_dispatch.py: expert-parallel dispatch and combine on real gloo ranks."""
from __future__ import annotations

from typing import Any

import torch

HIDDEN = 3


def skewed_load(rank: int, world: int, local: int) -> torch.Tensor:
    """Rows rank ``rank`` routes to each global expert: the last rank's experts get none, expert 1 of rank 0
    gets most, local expert 0 of every rank but rank 0 gets none from odd ranks."""
    load = torch.zeros(world * local, dtype=torch.long)
    for e in range(world * local):
        owner, j = divmod(e, local)
        if owner == world - 1:
            continue
        load[e] = 9 + rank if (owner, j) == (0, 1 % local) else (0 if j == 0 and owner and rank % 2 else 1 + (e + rank) % 3)
    return load


def rows_of(rank: int, load: torch.Tensor, world: int, local: int) -> torch.Tensor:
    """Rank ``rank``'s rows in dispatch order (local expert major, owner rank minor), each row naming itself:
    (source rank, global expert, index inside that expert's rows)."""
    rows = []
    for j in range(local):
        for owner in range(world):
            e = owner * local + j
            rows += [[float(rank), float(e), float(i)] for i in range(int(load[e]))]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, HIDDEN)


def exchange(rank: int, world: int, local: int, validate: bool = True, dtype: str = "float64") -> dict[str, Any]:
    """Dispatch this rank's rows, scale what arrives per local expert, combine; and the backward. On the rank's
    device (gloo: cpu; NCCL: its GPU); ``validate=False`` as the engine builds its groups (NCCL: one grouped launch)."""
    from hal.collectives import world_communicator
    from hal.parallel.moe import combine, dispatch

    comm = world_communicator(validate=validate)
    load = skewed_load(rank, world, local).to(comm.device)
    rows = rows_of(rank, load.cpu(), world, local).to(comm.device, getattr(torch, dtype)).requires_grad_(True)
    arrived, route = dispatch(rows, load, comm, local)
    scale = torch.cat([torch.full((n, 1), 2.0 + j, dtype=rows.dtype, device=rows.device) for j, n in enumerate(route.counts)])
    back = combine(arrived * scale, route)
    back.sum().backward()
    return {"arrived": arrived.detach().double().tolist(), "counts": route.counts, "back": back.detach().double().tolist(),
            "rows": rows.detach().double().tolist(), "grad": rows.grad.double().tolist(), "send": route.send_splits,
            "recv": route.recv_splits, "grouped": comm._groups_all_to_alls(rows)}


def bad_blocks(rank: int, world: int) -> dict[str, str]:
    """all_to_all_blocks with malformed block tables: each one error naming the table, before anything is sent."""
    from hal.collectives import world_communicator

    comm = world_communicator(validate=False)
    x = torch.zeros(4, HIDDEN)
    tables = {
        "short row": ([[2, 2, 0]], [[2, 2]]),
        "negative": ([[5, -1]], [[2, 2]]),
        "rows do not add up": ([[1, 1]], [[2, 2]]),
        "row counts differ": ([[2, 2]], [[2, 2], [0, 0]]),
    }
    said = {}
    for name, (send, recv) in tables.items():
        try:
            comm.all_to_all_blocks(x, send, recv)
            said[name] = "no error"
        except Exception as exc:  # noqa: BLE001 — the type and text are what is checked
            said[name] = f"{type(exc).__name__}: {exc}"
    return said
