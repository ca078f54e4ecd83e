"""The MoE block as a decoder layer's feed-forward (``MoEFeedForward``), and the flag a checkpointed layer's
recompute raises so the block counts its routing once (``REPLAYING``)."""
from __future__ import annotations

from typing import Any

import torch

from hal.parallel.config.model import ModelConfig
from hal.parallel.models.layers import out_std
from hal.parallel.models.moe import MoE, attach_aux_loss
from hal.parallel.models.tp_comm import TPComm, tp_rank


class ReplayFlag:
    """Whether a checkpointed layer is being recomputed. A plain attribute, not a context variable: a compiled layer
    reads it as a guarded constant (Dynamo cannot trace ``ContextVar.get``), so the recompute gets its own graph
    instead of a graph break. One flag per process is enough: the recompute runs inside the backward, while no
    forward of this process runs."""

    active = False


REPLAYING = ReplayFlag()


class MoEFeedForward(MoE):
    """The MoE block as a decoder layer's feed-forward: its output only, the auxiliary loss attached to it.

    The balancing and z losses (weighted by the config) reach the router through ``attach_aux_loss`` with
    ``aux_scale`` — the share of the step's loss one forward is: 1 / (micro-batches × dp replicas) in the
    engine, as the language-model loss of a micro-batch on one replica. ``tally`` sums what each forward
    routed until the trainer reads it (``take_tally``), on the device, with no host read per forward.
    """

    def __init__(self, config: ModelConfig, tp_comm: TPComm, ep_comm: Any = None, sp: bool = False) -> None:
        super().__init__(config.hidden_size, config.moe_config(), out_std=out_std(config.num_layers), ep_group=ep_comm,
                         tp_comm=tp_comm, sequence_parallel=sp)
        self.aux_scale = 1.0
        self._counts: torch.Tensor | None = None  # (E + 1,) int64: pairs per expert, forwards
        self._sums: torch.Tensor | None = None  # (2,) float32: aux loss sum, z loss sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, stats = super().forward(x)
        self._count(stats)
        aux = self.loss(stats)
        if torch.is_grad_enabled() and aux.requires_grad and self.aux_scale:
            out = attach_aux_loss(out, aux, self.aux_scale)
        return out

    @torch.no_grad()
    def _count(self, stats: Any) -> None:
        """Add one forward's routing to the tally — once: not again in a checkpointed layer's recompute, and on one TP
        rank (all route the same tokens). Counts in int64 and the two loss sums in float32, on the device (no float64:
        an NPU or MLU has none, which the stand-ins found), so a compiled layer keeps them in its graph."""
        if REPLAYING.active or tp_rank(self.tp_comm) != 0:
            return
        counts = torch.cat([stats.load.to(torch.int64), stats.load.new_ones(1, dtype=torch.int64)])
        sums = torch.stack([stats.aux_loss.detach().float().reshape(()), stats.z_loss.detach().float().reshape(())])
        self._counts = counts if self._counts is None else self._counts + counts
        self._sums = sums if self._sums is None else self._sums + sums

    def take_tally(self) -> dict[str, Any] | None:
        """What the forwards since the last call routed (host values; one read each), then start again."""
        if self._counts is None or self._sums is None:
            return None
        counts, (aux, z) = self._counts.cpu().tolist(), self._sums.cpu().tolist()
        self._counts = self._sums = None
        load, n = counts[:-1], counts[-1]
        count = max(n, 1)
        return {"load": [int(v) for v in load], "aux_loss": aux / count, "z_loss": z / count,
                "exchange": self.exchange}  # under ep: the path the last forward took (symmetric | all_to_all)


__all__ = ["MoEFeedForward", "REPLAYING", "ReplayFlag"]
