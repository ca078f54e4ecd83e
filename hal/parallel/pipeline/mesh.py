"""A rank's mesh: the communicators it uses, built collectively from the topology, and the one place that decides
which group syncs, shards or gathers each parameter (``Mesh``).

``build_mesh`` creates every rank's TP, DP and stage groups, each boundary k→k+1's group over the union of both
stages' ranks (boundary resharding runs inside it), the expert-parallel groups and the tied-embedding and
wrap-around links. Groups are made by ``make_groups`` (the one place: the replicas' extra groups too) with
``collectives.process_groups.make_layout``, which splits any rank set
into islands by backend, so a boundary between a CUDA stage and a CPU stage is bridged by the collectives with
no special case here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from hal.errors import ConfigError
from hal.parallel.config.topology import Coord, StageMesh, Topology
from hal.parallel.models.layers import expert_shard, local_shard, param_meta
from hal.parallel.models.shards import gather_full

if TYPE_CHECKING:  # collectives (torch.distributed) is loaded only when groups are built
    from hal.collectives.communicator import Communicator
    from hal.collectives.process_groups import World


# --- the communicators -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """The communicators one rank uses, and which of them syncs, shards or gathers each parameter.

    Groups of one rank are real (size-1) communicators, so callers can use them unconditionally; the same rank
    set is one shared communicator. The choices live here and nowhere else: a stage's layers shard over
    ``tp_shards`` and ``expert_shards``; a gradient is summed over ``grad_group(param)`` (an expert shard over
    the replicas holding it, everything else over dp); ZeRO-1 shards the optimizer state over
    ``optimizer_groups``; the step's loss is summed over ``loss_group``; the tied embedding's two copies meet
    over ``embedding``."""

    topology: Topology  # the job's ranks and stages (data): my stage's grid is ``layout``
    coord: Coord
    stage: Communicator  # every rank of my stage
    tp: Communicator  # my TP group (tp consecutive ranks)
    dp: Communicator  # my DP group (dp ranks strided by tp)
    boundaries: Mapping[int, Communicator]  # boundary k → stages k and k+1 (only those I am in)
    embedding: Communicator | None = None  # tied embeddings over several stages: every rank of the first and last stage
    wrap: Communicator | None = None  # interleaved pipelines: the last stage → first stage link (first/last stage ranks)
    ep: Communicator | None = None  # expert parallelism: my ep group (ep consecutive dp replicas), None at ep 1
    edp: Communicator | None = None  # the dp replicas holding my expert shard (dp / ep of them), None at ep 1

    @property
    def layout(self) -> StageMesh:
        """My stage's grid, layers and options."""
        return self.topology.stages[self.coord.stage]

    @property
    def first(self) -> bool:
        """My stage holds the model's first chunk (the embedding)."""
        return self.coord.stage == 0

    @property
    def last(self) -> bool:
        """My stage holds the model's last chunk (the head, the loss): the first stage under zbv."""
        return self.coord.stage == self.topology.last_stage

    @property
    def tp_shards(self) -> Communicator | None:
        """The group a stage's layers split their tensor-parallel weights over (None: no split)."""
        return self.tp if self.tp.size > 1 else None

    @property
    def expert_shards(self) -> Communicator | None:
        """The group an MoE layer shares its experts out over (None: every expert on this rank)."""
        return self.ep if self.ep is not None and self.ep.size > 1 else None

    def grad_group(self, param: torch.Tensor) -> Communicator:
        """The replicas whose gradients of ``param`` are summed: an expert shard's holders (``edp``, dp / ep of
        them), every other parameter's dp group."""
        return self.edp if self.edp is not None and expert_shard(param) else self.dp

    def shard(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """My piece of ``param``'s full tensor (a checkpoint's, an optimizer state's): its experts, then its TP shard."""
        meta = param_meta(param)
        return full if meta is None else local_shard(full, meta, self.tp_shards, self.expert_shards)

    def gather_full(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` shaped like ``module``'s parameters, each in its full shape: collective over my TP group
        (and my ep group for expert shards); every rank of both calls it with the same names."""
        return gather_full(dict(module.named_parameters()), tensors, self.tp_shards, self.expert_shards)

    def optimizer_groups(self) -> tuple[Communicator, Communicator | None]:
        """ZeRO-1's shard groups: (dense parameters' dp group, expert shards' replica group or None without ep)."""
        return self.dp, self.edp

    @property
    def loss_group(self) -> Communicator:
        """The replicas whose micro-batch losses add up to the step's: each covers its rows only."""
        return self.dp

    @property
    def balance_group(self) -> Communicator | None:
        """The group an MoE balancing loss counts routed tokens over: the dp replicas splitting each micro-batch."""
        return self.dp if self.dp.size > 1 else None

    @property
    def prev_boundary(self) -> Communicator | None:
        """The boundary I receive activations on (None on stage 0)."""
        return self.boundaries.get(self.coord.stage - 1)

    @property
    def next_boundary(self) -> Communicator | None:
        """The boundary I send activations on (None on the last stage)."""
        return self.boundaries.get(self.coord.stage)

    def link(self, peer_stage: int) -> Communicator:
        """The communicator I share with ``peer_stage``: a neighbour's boundary, else the wrap-around link.

        With two stages the wrap-around traffic rides boundary 0 (the same ranks), on both sides alike.
        """
        me = self.coord.stage
        comm = self.boundaries.get(me) if peer_stage == me + 1 else self.boundaries.get(me - 1) if peer_stage == me - 1 else self.wrap
        if comm is None:
            raise ValueError(f"stage {me} has no link to stage {peer_stage} (the wrap link exists only in interleaved plans)")
        return comm


def _check_world_matches(topologies: Sequence[Topology], world: World) -> None:
    """Same answer on every rank (world.backends is gathered at init), so every rank raises together."""
    needed = sum(t.world_size for t in topologies)
    if world.size != needed:
        raise ConfigError(f"the plan needs {needed} ranks but the world has {world.size}; launch {needed} ranks")
    for topology in topologies:
        for rank in topology.ranks:
            wanted, running = topology.backend_of(rank), world.backends[rank]
            if wanted != running:
                raise ConfigError(
                    f"rank {rank} runs backend '{running}' but the plan puts it in stage {topology.stage_of(rank)} on "
                    f"'{wanted}'; start rank {rank} with HAL_BACKEND={wanted} (stages own consecutive ranks)"
                )


def _group_sets(topology: Topology, tied_embeddings: bool = False) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """Every group of the job, in the one order all ranks create them: (kind, stage/boundary, index, ranks)."""
    sets: list[tuple[str, int, int, tuple[int, ...]]] = []
    for m in topology.stages:
        sets.append(("stage", m.index, 0, m.ranks))
        sets += [("tp", m.index, d, topology.tp_ranks(m.index, d)) for d in range(m.dp)]
        sets += [("dp", m.index, t, topology.dp_ranks(m.index, t)) for t in range(m.tp)]
        if m.ep > 1:  # expert parallelism: ep groups (consecutive dp replicas) and the replicas of each expert shard
            for t in range(m.tp):
                dp = topology.dp_ranks(m.index, t)
                sets += [("ep", m.index, t, dp[g:g + m.ep]) for g in range(0, m.dp, m.ep)]
                sets += [("edp", m.index, t, dp[e::m.ep]) for e in range(m.ep)]
    sets += [("boundary", k, 0, topology.boundary_ranks(k)) for k in range(topology.num_stages - 1)]
    if tied_embeddings and topology.last_stage != 0:
        # ``parallel.models.stage.sync_tied_embedding_grads`` sums the two copies' gradients over this group,
        # whatever the first and last stages' tp/dp (each side must cover the vocabulary: it does).
        sets.append(("embedding", 0, 0, topology.stages[0].ranks + topology.stages[-1].ranks))
    if topology.has_wrap and topology.num_stages > 2:
        sets.append(("wrap", 0, 0, topology.wrap_ranks()))  # the same rank set as "embedding": one communicator
    return sets


def make_groups(world: World, rank_sets: Sequence[Sequence[int]], *,
                validate: bool = True) -> dict[tuple[int, ...], Communicator | None]:
    """One communicator per rank set, in the given order, made by every rank of the world (torch creates groups
    collectively, member or not): this rank's, or None where it is not a member. Every group of a job is made here —
    the mesh's, and those the replicas add beside it (their bridge speakers, the overlap's stage groups) — so one
    function holds the rule; a rank set an earlier call made gets a second communicator (its own stream)."""
    from hal.collectives.communicator import Communicator
    from hal.collectives.process_groups import make_layout

    made: dict[tuple[int, ...], Communicator | None] = {}
    for ranks in rank_sets:
        key = tuple(ranks)
        layout = make_layout(world, key)  # every rank calls this, member or not
        made[key] = Communicator(layout, world, validate=validate) if world.rank in key else None
    return made


def build_mesh(topology: Topology, world: World | None = None, *, validate: bool = True,
               tied_embeddings: bool = False) -> Mesh:
    """Create every stage, TP, DP and boundary communicator; return the ones this rank belongs to.

    Collective: every rank of the world calls it with the same topology (torch creates groups
    collectively, in the same order everywhere). Each distinct rank set becomes one layout.
    """
    return build_meshes((topology,), world, validate=validate, tied_embeddings=tied_embeddings)


def build_meshes(topologies: Sequence[Topology], world: World | None = None, *, validate: bool = True,
                 tied_embeddings: bool = False) -> Mesh:
    """``build_mesh`` for several plans side by side (replicas, ``parallel.config.replicas``): each topology over its
    own consecutive ranks, together the world. Every rank creates every topology's groups, in topology order; it
    gets its Mesh in the topology holding it."""
    from hal.collectives.process_groups import current_world

    world = world or current_world()
    _check_world_matches(topologies, world)
    made: dict[tuple[int, ...], Communicator | None] = {}
    mine: dict[tuple[str, int], Communicator] = {}
    own = next(t for t in topologies if world.rank in t.ranks)
    for topology in topologies:
        for kind, where, _index, ranks in _group_sets(topology, tied_embeddings):
            if ranks not in made:
                made.update(make_groups(world, [ranks], validate=validate))
            comm = made[ranks]
            if comm is not None and topology is own:
                mine[(kind, where)] = comm
    coord = own.coord(world.rank)
    boundaries = {k: comm for (kind, k), comm in mine.items() if kind == "boundary"}
    return Mesh(own, coord, mine[("stage", coord.stage)], mine[("tp", coord.stage)], mine[("dp", coord.stage)],
                boundaries, mine.get(("embedding", 0)), mine.get(("wrap", 0)), mine.get(("ep", coord.stage)),
                mine.get(("edp", coord.stage)))
