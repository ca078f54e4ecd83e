"""The parallel parts a family builds its blocks from (``families.spec.Parts``), made for one rank of one stage.

Why a seam: the families room sits below this one, so a family never imports a parallel layer; the stage hands
it these factories, bound to the stage's tensor-parallel group, sequence parallelism and expert group."""
from __future__ import annotations

from typing import Any, Sequence

from hal.parallel.config.model import ModelConfig
from hal.parallel.models.layers import ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear, out_std
from hal.parallel.models.moe_layer import MoEFeedForward
from hal.parallel.models.tp_comm import TPComm, tp_size


class StageParts:
    """``Parts`` over one stage's groups: ``tp_comm`` (None: tp 1), ``sp``, ``ep_comm`` (its MoE experts' group)."""

    def __init__(self, config: ModelConfig, tp_comm: TPComm, sp: bool, ep_comm: Any = None) -> None:
        self.config, self.tp_comm, self.sp, self.ep_comm = config, tp_comm, sp, ep_comm
        self.tp = tp_size(tp_comm)
        self.out_std = out_std(config.num_layers)

    def column(self, in_features: int, out_features: int, *, parts: Sequence[int] | None = None,
               bias: bool = False) -> ColumnParallelLinear:
        return ColumnParallelLinear(in_features, out_features, tp_comm=self.tp_comm, sequence_parallel=self.sp,
                                    parts=parts, bias=bias)

    def row(self, in_features: int, out_features: int, *, bias: bool = False) -> RowParallelLinear:
        return RowParallelLinear(in_features, out_features, tp_comm=self.tp_comm, sequence_parallel=self.sp,
                                 std=self.out_std, bias=bias)

    def rms_norm(self, size: int, eps: float) -> RMSNorm:
        return RMSNorm(size, eps=eps, tp_comm=self.tp_comm, sequence_parallel=self.sp)

    def layer_norm(self, size: int, eps: float) -> LayerNorm:
        return LayerNorm(size, eps=eps, tp_comm=self.tp_comm, sequence_parallel=self.sp)

    def head_norm(self, size: int, eps: float) -> RMSNorm:
        """Each rank normalises only its heads, so the weight's gradient is partial wherever tp > 1: it enters
        through ``copy_to_tp_region`` as a sequence-parallel norm's does (``RMSNorm``)."""
        return RMSNorm(size, eps=eps, tp_comm=self.tp_comm, sequence_parallel=self.tp > 1)

    def moe(self, index: int) -> MoEFeedForward:
        return MoEFeedForward(self.config, self.tp_comm, self.ep_comm, self.sp)


__all__ = ["StageParts"]
