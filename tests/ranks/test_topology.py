"""Topology groups for real: 4 processes (CPU, gloo) build plan (a)'s communicators and each group
proves its membership with an all_gather of the members' ranks — once on one backend, once with
each stage declared its own island so the boundary group goes through the collectives bridge."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hal.errors import ConfigError
from hal.parallel.config.plan import ParallelPlan, StagePlan
from hal.parallel.config.topology import Topology
from hal.parallel.pipeline.mesh import build_mesh

from ..dist_harness import run_world

PLAN_A = ParallelPlan((StagePlan("cpu", 2, 3, tp=2), StagePlan("cpu", 2, 1, dp=2)), "1f1b", 4, 2)


def _members(comm) -> list[int]:
    """The ranks a communicator really joins, learned by exchanging them (not read from its layout)."""
    import torch

    gathered = comm.all_gather(torch.tensor([comm.rank], dtype=torch.int64))
    return gathered.tolist()


def build_and_report(rank: int, world: int) -> dict:
    """Runs on every rank: build plan (a)'s groups and report who is in each of mine."""
    import torch

    from hal.collectives import current_world

    groups = build_mesh(Topology.from_plan(PLAN_A), current_world())
    return {
        "coord": tuple(groups.coord),
        "stage": _members(groups.stage),
        "tp": _members(groups.tp),
        "dp": _members(groups.dp),
        "boundaries": {k: _members(c) for k, c in sorted(groups.boundaries.items())},
        "prev": groups.prev_boundary is not None,
        "next": groups.next_boundary is not None,
        "boundary_path": groups.boundaries[0].path,
        # the mesh's choices (Mesh): what the layers shard over, what sums a dense gradient, ZeRO-1, the loss
        "tp_shards": None if groups.tp_shards is None else _members(groups.tp_shards),
        "expert_shards": groups.expert_shards,
        "grad_dense": _members(groups.grad_group(torch.zeros(1))),
        "zero1": [None if g is None else _members(g) for g in groups.optimizer_groups()],
        "loss": _members(groups.loss_group),
    }


# rank → (coord, stage members, tp members, dp members)
EXPECTED = {
    0: ((0, 0, 0), [0, 1], [0, 1], [0]),
    1: ((0, 0, 1), [0, 1], [0, 1], [1]),
    2: ((1, 0, 0), [2, 3], [2], [2, 3]),
    3: ((1, 1, 0), [2, 3], [3], [2, 3]),
}


@pytest.mark.parametrize("islands", [None, Topology.from_plan(PLAN_A).stage_islands()], ids=["one-island", "stage-islands"])
def test_plan_a_groups_on_four_processes(islands) -> None:
    results = run_world("tests.ranks.test_topology", "build_and_report", 4, islands=islands, deadline_s=180)
    assert sorted(results) == [0, 1, 2, 3], results
    for rank, (status, *rest) in sorted(results.items()):
        assert status == "ok", rest
        got = rest[0]
        coord, stage, tp, dp = EXPECTED[rank]
        assert (got["coord"], got["stage"], got["tp"], got["dp"]) == (coord, stage, tp, dp), (rank, got)
        assert got["boundaries"] == {0: [0, 1, 2, 3]}, (rank, got)
        assert (got["prev"], got["next"]) == ((False, True) if rank < 2 else (True, False))
        assert got["boundary_path"] == ("native gloo" if islands is None else "bridge")
        assert got["tp_shards"] == (tp if len(tp) > 1 else None) and got["expert_shards"] is None
        assert got["grad_dense"] == got["loss"] == dp and got["zero1"] == [dp, None]


def test_world_that_does_not_match_the_plan_is_refused_on_every_rank() -> None:
    """Checked from data every rank shares (each rank's backend), so all ranks raise the same line."""
    topo = Topology.from_plan(PLAN_A)
    wrong_size = SimpleNamespace(size=3, rank=0, backends=("cpu",) * 3)
    with pytest.raises(ConfigError, match="the plan needs 4 ranks but the world has 3"):
        build_mesh(topo, wrong_size)
    wrong_backend = SimpleNamespace(size=4, rank=0, backends=("cpu", "cpu", "cuda", "cuda"))
    with pytest.raises(ConfigError, match="rank 2 runs backend 'cuda' but the plan puts it in stage 1 on 'cpu'"):
        build_mesh(topo, wrong_backend)
