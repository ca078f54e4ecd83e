"""Per-rank bodies of the stand-in tests (``tests/cli/test_standins.py``), run through ``tests.dist_harness``."""
from __future__ import annotations

from typing import Any

import torch


def ccl_run(rank: int, world: int) -> dict[str, Any]:
    """The stand-in library's collectives on the device's tensors, raw (torch.distributed on the island's group) and
    through hal's Communicator; the library's gaps, refused in its words."""
    import torch.distributed as dist

    from hal.collectives import current_world
    from hal.collectives.communicator import Communicator
    from hal.collectives.process_groups import make_layout

    joined = current_world()
    device = joined.device
    group = dist.new_group(list(range(world)), backend=joined.backend.process_group_backend())
    out: dict[str, Any] = {"device": str(device), "library": dist.get_backend(group)}
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t, group=group)
    out["all_reduce"] = t.cpu().tolist()
    gathered = torch.empty(4 * world, device=device)
    dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank), device=device), group=group)
    out["all_gather"] = gathered.cpu().tolist()
    part = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * world, device=device), group=group)
    out["reduce_scatter"] = part.cpu().tolist()
    swapped = torch.empty(world, device=device)
    dist.all_to_all_single(swapped, torch.full((world,), float(rank), device=device), group=group)
    out["all_to_all"] = swapped.cpu().tolist()
    received = torch.full((3,), float(rank), device=device)
    ops = [dist.P2POp(dist.isend, received.clone() + 10, (rank + 1) % world, group),
           dist.P2POp(dist.irecv, received, (rank - 1) % world, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["p2p"] = received.cpu().tolist()
    refused: dict[str, str | None] = {}
    calls = {"float64": lambda: dist.all_reduce(torch.ones(2, dtype=torch.float64, device=device), group=group)}
    if joined.backend.name == "ascend":  # HCCL has no gather; CNCL has one
        calls["gather"] = lambda: dist.gather(t, [torch.empty_like(t) for _ in range(world)] if rank == 0 else None,
                                              dst=0, group=group)
    for name, call in calls.items():
        try:
            call()
            refused[name] = None
        except RuntimeError as exc:
            refused[name] = str(exc)
    out["refused"] = refused
    hal_group = Communicator(make_layout(joined, range(world)), joined, validate=False)
    summed = torch.full((3,), float(rank), device=device)
    hal_group.all_reduce(summed)
    out["hal_all_reduce"] = summed.cpu().tolist()
    out["hal_all_gather"] = hal_group.all_gather(torch.full((2,), float(rank), device=device)).cpu().tolist()
    gathered_at_0 = hal_group.gather(torch.full((2,), float(rank), device=device), 0)  # HCCL has none: via the host
    out["hal_gather"] = None if gathered_at_0 is None else [x.cpu().tolist() for x in gathered_at_0]
    return out
