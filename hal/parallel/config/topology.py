"""Topology: the disjoint union of per-stage meshes (data: which rank is where, no process group).

A homogeneous engine forces one TP×DP×PP grid on every stage. Here each stage k has its own
grid ``dp_k × tp_k`` on its own backend, and the world is their disjoint union
``⊔_k ({k} × D_intra^(k))``. The convention (every part of the engine relies on it):

- **Stages own contiguous ranks, in pipeline order.** Stage k owns the global ranks
  ``[offset_k, offset_k + devices_k)`` with ``offset_0 = 0`` and
  ``offset_{k+1} = offset_k + devices_k``. Launchers therefore start the ranks of stage 0
  first; on several nodes, a node's ranks belong to the stages its backend runs.
- **TP is innermost inside a stage.** The rank at coordinate ``(dp_index, tp_index)`` of stage
  k is ``offset_k + dp_index * tp_k + tp_index``. So a TP group is ``tp_k`` consecutive ranks
  (the chattiest group stays on neighbouring devices, e.g. one NVLink island) and a DP group is
  strided by ``tp_k``.
- **Layers are contiguous too**: stage k runs layers ``[sum(layers_<k), sum(layers_≤k))``. With
  ``virtual_stages`` V > 1 (interleaved schedules) a stage holds V chunks instead: chunk v of stage
  k is virtual stage ``v*S + k`` (zbv's V: stage k holds virtual stages k and 2S-1-k, see
  ``schedules.placement``), and the virtual stages take the layers in model order, so stage k's
  chunks are V separate runs of layers (``StageMesh.chunks``).

``Topology.from_plan`` is pure (no processes): which rank is where. The communicators a rank uses
are built from it collectively by ``parallel.pipeline.mesh.build_mesh``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from hal.errors import ConfigError
from hal.parallel.config.plan import ParallelPlan


class Coord(NamedTuple):
    """Where a rank sits: its stage, and its (dp, tp) coordinate inside that stage's grid."""

    stage: int
    dp: int
    tp: int


@dataclass(frozen=True)
class StageMesh:
    """Stage ``index``'s grid: ``dp × tp`` ranks starting at global rank ``offset``."""

    index: int
    backend: str
    offset: int
    tp: int
    dp: int
    sp: bool
    checkpoint: bool
    chunks: tuple[tuple[int, int], ...]  # (first layer, end) of each model chunk, in chunk order
    compile: bool = False  # regional torch.compile of the stage's decoder layers
    compile_backend: str = "inductor"
    ep: int = 1  # expert parallelism: groups of ep consecutive dp replicas share out the experts

    def __post_init__(self) -> None:  # a job file gives lists; keep the mesh hashable and comparable
        object.__setattr__(self, "chunks", tuple((int(a), int(b)) for a, b in self.chunks))

    @property
    def size(self) -> int:
        return self.tp * self.dp

    @property
    def layer_ranges(self) -> tuple[range, ...]:
        """Each chunk's layers (one range unless the plan interleaves)."""
        return tuple(range(a, b) for a, b in self.chunks)

    @property
    def layer_ids(self) -> list[int]:
        """Every layer the stage holds, in chunk order."""
        return [i for r in self.layer_ranges for i in r]

    @property
    def layers(self) -> int:
        return sum(b - a for a, b in self.chunks)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.offset, self.offset + self.size))

    @property
    def layer_range(self) -> range:
        """The stage's layers as one range: only a stage of one chunk has that."""
        if len(self.chunks) != 1:
            raise ValueError(f"stage {self.index} holds {len(self.chunks)} chunks of layers; use layer_ranges")
        return self.layer_ranges[0]


@dataclass(frozen=True)
class Topology:
    """The rank ↔ (stage, dp, tp) map of a plan; pure data, the same on every rank."""

    stages: tuple[StageMesh, ...]
    placement: str = "loop"  # where the chunks sit (``schedules.placement``): "v" under zbv

    @classmethod
    def from_plan(cls, plan: ParallelPlan, first_rank: int = 0) -> Topology:
        """Lay the stages out on consecutive ranks from ``first_rank`` (a replica's first: ``parallel.config.replicas``;
        0 for a plan of its own). Assumes ``devices == tp * dp`` (validate_plan checks it)."""
        chunks = plan.layer_chunks()  # virtual stage v*S + k takes the next layers
        meshes, offset = [], first_rank
        for k, s in enumerate(plan.stages):
            if s.devices != s.tp * s.dp:
                raise ConfigError(f"stage {k}: devices {s.devices} != tp {s.tp} × dp {s.dp}; validate the plan first")
            meshes.append(StageMesh(k, s.backend, offset, s.tp, s.dp, s.sp, s.checkpoint, tuple(chunks[k]),
                                    plan.stage_compiles(k), plan.compile_backend, s.ep))
            offset += s.devices
        return cls(tuple(meshes), plan.placement)

    # --- sizes and lookups ----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks of this plan (a replica's, among the other replicas' ranks: see ``first_rank``)."""
        return sum(m.size for m in self.stages)

    @property
    def first_rank(self) -> int:
        """The global rank of stage 0's first device: 0, or a replica's offset among the replicas."""
        return self.stages[0].offset

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.world_size)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def _stage(self, stage: int) -> StageMesh:
        if not 0 <= stage < len(self.stages):
            raise ValueError(f"stage {stage} does not exist; the plan has stages 0..{len(self.stages) - 1}")
        return self.stages[stage]

    def stage_of(self, rank: int) -> int:
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is outside the plan's ranks {self.first_rank}..{self.ranks[-1]}")
        return next(m.index for m in self.stages if m.offset <= rank < m.offset + m.size)

    def coord(self, rank: int) -> Coord:
        mesh = self.stages[self.stage_of(rank)]
        dp, tp = divmod(rank - mesh.offset, mesh.tp)
        return Coord(mesh.index, dp, tp)

    def rank_of(self, stage: int, dp: int, tp: int) -> int:
        mesh = self._stage(stage)
        if not (0 <= dp < mesh.dp and 0 <= tp < mesh.tp):
            raise ValueError(f"stage {stage} has dp 0..{mesh.dp - 1} and tp 0..{mesh.tp - 1}; got dp {dp}, tp {tp}")
        return mesh.offset + dp * mesh.tp + tp

    def backend_of(self, rank: int) -> str:
        return self.stages[self.stage_of(rank)].backend

    # --- rank sets ---------------------------------------------------------------------------------
    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return self._stage(stage).ranks

    def tp_ranks(self, stage: int, dp: int) -> tuple[int, ...]:
        """The TP group of replica ``dp`` of ``stage``: ``tp`` consecutive ranks."""
        mesh = self._stage(stage)
        return tuple(self.rank_of(stage, dp, t) for t in range(mesh.tp))

    def dp_ranks(self, stage: int, tp: int) -> tuple[int, ...]:
        """The DP group of TP position ``tp`` of ``stage``: ranks strided by the stage's tp."""
        mesh = self._stage(stage)
        return tuple(self.rank_of(stage, d, tp) for d in range(mesh.dp))

    def boundary_ranks(self, boundary: int) -> tuple[int, ...]:
        """Boundary ``k`` joins stage k and stage k+1: the union of their ranks."""
        if not 0 <= boundary < len(self.stages) - 1:
            raise ValueError(f"boundary {boundary} does not exist; the plan has boundaries 0..{len(self.stages) - 2}")
        return self.stage_ranks(boundary) + self.stage_ranks(boundary + 1)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per stage (every stage holds the same number)."""
        return len(self.stages[0].chunks)

    @property
    def last_stage(self) -> int:
        """The stage holding the model's last chunk: the head, the loss, the losses a run reports."""
        from hal.parallel.schedules.placement import last_stage

        return last_stage(self.num_stages, self.placement)

    @property
    def has_wrap(self) -> bool:
        """Whether the last stage feeds the first (Megatron's loop of chunks; the V turns round in place)."""
        return self.virtual_stages > 1 and self.placement == "loop"

    def wrap_ranks(self) -> tuple[int, ...]:
        """The wrap-around link of an interleaved pipeline: the last stage's chunk v feeds the first stage's v+1."""
        return self.stages[0].ranks + self.stages[-1].ranks

    def stage_islands(self) -> tuple[int, ...]:
        """One island number per rank, the stage's index: declares each stage an island on one backend
        (``init_distributed(islands=...)`` / ``HAL_ISLANDS``), so a CPU-only run exercises the bridge
        at every boundary as a mixed-vendor run would."""
        return tuple(self.stage_of(r) for r in self.ranks)

    # --- reports -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "placement": self.placement,
            "stages": [
                {"stage": m.index, "backend": m.backend, "ranks": list(m.ranks), "tp": m.tp, "dp": m.dp, "ep": m.ep, "sp": m.sp,
                 "checkpoint": m.checkpoint, "compile": m.compile, "layers": m.layer_ids,
                 "chunks": [list(r) for r in m.layer_ranges]}
                for m in self.stages
            ],
            "ranks": [
                {"rank": r, **self.coord(r)._asdict(), "backend": self.backend_of(r)} for r in self.ranks
            ],
            "boundaries": [
                {"boundary": k, "from_stage": k, "to_stage": k + 1, "ranks": list(self.boundary_ranks(k)),
                 "backends": [self.stages[k].backend, self.stages[k + 1].backend]}
                for k in range(self.num_stages - 1)
            ] + ([{"boundary": self.num_stages - 1, "from_stage": self.num_stages - 1, "to_stage": 0,
                   "ranks": list(self.wrap_ranks()), "backends": [self.stages[-1].backend, self.stages[0].backend]}]
                 if self.has_wrap else []),
        }
