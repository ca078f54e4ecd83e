"""Tensor-parallel layers (Megatron-style) that reduce to plain layers at tp=1.

Every parameter carries a ``ParamMeta``: its full (unsharded) shape, how it is split over the TP
group (``ShardSpec``, or None when replicated) and how to initialise it. That one record lets the
model initialise the full tensor from the seed and keep only this rank's shard (so every split
starts from the same weights), and lets ``parallel.models.shards.gather_full_grads`` put shards back
together. All math goes through ``hal.ops`` so vendor and Triton implementations plug in.

Activations are (batch, seq, hidden); under sequence parallelism (SP) the residual stream is
split along seq over the TP ranks (see ``parallel.models.tp_comm``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from hal import ops
from hal.parallel.models.linear import layer_linear
from hal.parallel.models.tp_comm import (
    TPComm,
    copy_to_tp_region,
    gather_from_seq_region,
    reduce_from_tp_region,
    reduce_scatter_to_seq_region,
    tp_rank,
    tp_size,
)

DEFAULT_STD = 0.02


def out_std(num_layers: int) -> float:
    """A residual branch's last linear's init std: scaled by 1/sqrt(2·layers) (GPT-2/Megatron) so depth doesn't grow
    the stream."""
    return DEFAULT_STD / math.sqrt(2 * num_layers)


@dataclass(frozen=True)
class ShardSpec:
    """How a full parameter is split over TP: along ``dim``, part by part.

    ``parts`` are the sizes of the logical pieces stacked along ``dim`` (e.g. q, k, v of a fused
    QKV weight). Each piece is split evenly and rank t holds the concatenation of every piece's
    t-th chunk, so a fused projection's local output is [q_t, k_t, v_t] — what the layer needs.
    """

    dim: int
    parts: tuple[int, ...]

    def check(self, size: int, what: str) -> None:
        bad = [p for p in self.parts if p % size]
        if bad:
            raise ValueError(f"{what}: sizes {list(self.parts)} along dim {self.dim} are not divisible by the TP size {size}")

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's shard of the full tensor."""
        pieces = full.split(list(self.parts), dim=self.dim)
        return torch.cat([p.chunk(size, dim=self.dim)[rank] for p in pieces], dim=self.dim)

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order (inverse of ``shard``)."""
        size = len(shards)
        local = [p // size for p in self.parts]
        split = [s.split(local, dim=self.dim) for s in shards]
        return torch.cat([torch.cat([s[i] for s in split], dim=self.dim) for i in range(len(local))], dim=self.dim)


@dataclass(frozen=True)
class ParamMeta:
    """Full shape, TP split (None: replicated) and initialisation ("normal" with ``std``, "ones" or "zeros")."""

    full_shape: tuple[int, ...]
    spec: ShardSpec | None
    init: str = "normal"
    std: float = DEFAULT_STD
    seq_parallel_grad: bool = False  # replicated weight used on seq shards: its gradient is TP-summed
    expert_split: bool = False  # stacked experts split along dim 0 over the stage's ep group (expert parallelism)


def param_meta(param: torch.Tensor) -> ParamMeta | None:
    """The ``ParamMeta`` a parallel layer attached to ``param`` (None for foreign parameters)."""
    return getattr(param, "hal_meta", None)


def expert_shard(param: torch.Tensor) -> bool:
    """Whether ``param`` is a share of stacked experts spread over an ep group (expert parallelism): the same only
    on the dp replicas holding that share, so summed and sharded over those (``edp``), not over all of dp."""
    meta = param_meta(param)
    return meta is not None and meta.expert_split


def _new_param(meta: ParamMeta, comm: TPComm) -> nn.Parameter:
    """An uninitialised local parameter (the model fills it from the seed; see ``parallel.models.stage``)."""
    shape = list(meta.full_shape)
    if meta.spec is not None:
        meta.spec.check(tp_size(comm), f"parameter of shape {tuple(shape)}")
        shape[meta.spec.dim] //= tp_size(comm)
    param = nn.Parameter(torch.empty(shape))
    param.hal_meta = meta  # type: ignore[attr-defined]
    return param


def local_shard(full: torch.Tensor, meta: ParamMeta, comm: TPComm, ep_comm: TPComm = None) -> torch.Tensor:
    """This rank's piece of a full parameter tensor: its experts (``ep_comm``), then its TP shard."""
    if meta.expert_split and tp_size(ep_comm) > 1:
        full = full.chunk(tp_size(ep_comm), dim=0)[tp_rank(ep_comm)]
    if meta.spec is None or tp_size(comm) == 1:
        return full
    return meta.spec.shard(full, tp_rank(comm), tp_size(comm))


# --- layers -------------------------------------------------------------------------------------
def parallel_input(x: torch.Tensor, comm: TPComm, sequence_parallel: bool) -> torch.Tensor:
    """What a column-parallel layer multiplies: the full-seq input, seen by every TP rank."""
    return gather_from_seq_region(x, comm) if sequence_parallel else copy_to_tp_region(x, comm)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W's output rows split over TP: the output's last dim is this rank's slice.

    Input (B, S, in) — or (B, S/tp, in) under SP, gathered along seq first. ``parts`` declares a
    fused weight (e.g. q|k|v or gate|up), each part split separately. ``bias`` (Qwen2's q, k, v): one
    per output row, split exactly as the rows are, so each rank adds its own slice and nothing is
    communicated; it starts at zero.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_comm: TPComm, sequence_parallel: bool = False,
                 parts: Sequence[int] | None = None, std: float = DEFAULT_STD, bias: bool = False) -> None:
        super().__init__()
        parts = tuple(parts or (out_features,))
        if sum(parts) != out_features:
            raise ValueError(f"parts {list(parts)} must sum to out_features {out_features}")
        self.tp_comm = tp_comm
        self.sequence_parallel = sequence_parallel
        self.weight = _new_param(ParamMeta((out_features, in_features), ShardSpec(0, parts), std=std), tp_comm)
        self.bias = _new_param(ParamMeta((out_features,), ShardSpec(0, parts), init="zeros"), tp_comm) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_linear(parallel_input(x, self.tp_comm, self.sequence_parallel), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W's input columns split over TP: partial products are summed over the group.

    Input is the column-parallel slice (B, S, in/tp); output (B, S, out), or its seq shard
    (B, S/tp, out) under SP (reduce-scatter instead of all-reduce). ``bias`` (GPT-NeoX's): replicated, added once
    after the sum; under SP each rank adds it to its seq shard, so its gradient is summed over TP (as a norm's).
    """

    def __init__(self, in_features: int, out_features: int, *, tp_comm: TPComm, sequence_parallel: bool = False,
                 std: float = DEFAULT_STD, bias: bool = False) -> None:
        super().__init__()
        self.tp_comm = tp_comm
        self.sequence_parallel = sequence_parallel
        self.weight = _new_param(ParamMeta((out_features, in_features), ShardSpec(1, (in_features,)), std=std), tp_comm)
        self.bias = _new_param(ParamMeta((out_features,), None, init="zeros", seq_parallel_grad=sequence_parallel),
                               tp_comm) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = layer_linear(x, self.weight)
        out = (reduce_scatter_to_seq_region(partial, self.tp_comm) if self.sequence_parallel
               else reduce_from_tp_region(partial, self.tp_comm))
        if self.bias is None:
            return out
        return out + (copy_to_tp_region(self.bias, self.tp_comm) if self.sequence_parallel else self.bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over TP: rank t holds ids [t*V/tp, (t+1)*V/tp).

    Each rank looks up the ids it owns (zeros elsewhere) and the partial rows are summed over the
    group — all-reduce, or reduce-scatter along seq under SP, which leaves the output seq-sharded.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_comm: TPComm, sequence_parallel: bool = False,
                 std: float = DEFAULT_STD) -> None:
        super().__init__()
        self.tp_comm = tp_comm
        self.sequence_parallel = sequence_parallel
        self.weight = _new_param(ParamMeta((vocab_size, hidden_size), ShardSpec(0, (vocab_size,)), std=std), tp_comm)
        rows = vocab_size // tp_size(tp_comm)
        self.vocab_start = tp_rank(tp_comm) * rows
        self.vocab_end = self.vocab_start + rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size(self.tp_comm) == 1:
            return ops.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = ops.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_seq_region(partial, self.tp_comm)
        return reduce_from_tp_region(partial, self.tp_comm)


class _ReplicatedNorm(nn.Module):
    """A norm whose weight (and bias) every TP rank holds whole.

    Under SP each TP rank normalises only its seq chunk, so its parameters' gradients are partial sums: they
    enter through ``copy_to_tp_region`` (identity forward, all-reduce of the gradient), which sums them over TP as
    Megatron does. Doing it in autograd rather than after backward keeps it right under gradient accumulation and
    any pipeline schedule, with nothing for the engine to remember (cost: one all-reduce of ``hidden`` floats per
    parameter per norm per micro-batch).
    """

    def __init__(self, hidden_size: int, *, eps: float, tp_comm: TPComm, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.tp_comm = tp_comm
        self.sequence_parallel = sequence_parallel
        self.weight = self._replicated_param(hidden_size, "ones")

    def _replicated_param(self, hidden_size: int, init: str) -> nn.Parameter:
        meta = ParamMeta((hidden_size,), None, init=init, seq_parallel_grad=self.sequence_parallel)
        return _new_param(meta, self.tp_comm)

    def _summed_over_tp(self, param: torch.Tensor) -> torch.Tensor:
        return copy_to_tp_region(param, self.tp_comm) if self.sequence_parallel else param


class RMSNorm(_ReplicatedNorm):
    """RMSNorm with a replicated weight (``_ReplicatedNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self._weight(), self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a pre-norm block's residual step and the next norm in one op
        (``ops.add_rms_norm``, one pass where a kernel serves it); the same numbers as adding, then ``forward``."""
        return ops.add_rms_norm(x, residual, self._weight(), self.eps)

    def _weight(self) -> torch.Tensor:
        return self._summed_over_tp(self.weight)


class LayerNorm(_ReplicatedNorm):
    """LayerNorm with a replicated weight and bias (``_ReplicatedNorm``: under SP both gradients summed over TP)."""

    def __init__(self, hidden_size: int, *, eps: float, tp_comm: TPComm, sequence_parallel: bool = False) -> None:
        super().__init__(hidden_size, eps=eps, tp_comm=tp_comm, sequence_parallel=sequence_parallel)
        self.bias = self._replicated_param(hidden_size, "zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self._summed_over_tp(self.weight), self._summed_over_tp(self.bias), self.eps)


# --- vocab-parallel cross-entropy -----------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss of (N, V/tp) logit shards against global (N,) targets.

    Numerically stable: the max and the sum of exp are all-reduced over TP (the target logit rides
    along with the sum), so no rank ever holds the full vocabulary row.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Any) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()
        rows = logits.shape[-1]
        start = comm.group_rank * rows
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, "max")
        shifted = logits - row_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + rows)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), picked])  # one all-reduce for both
        comm.all_reduce(sums, "sum")
        sum_exp, target_logit = sums[0], sums[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: TPComm,
                                 ignore_index: int = -100, token_count: int | None = None) -> torch.Tensor:
    """Cross-entropy of this rank's vocab slice ``logits`` (..., V/tp) against global ``target`` (...).

    The sum over non-ignored tokens divided by ``token_count`` — by default their number here (the
    mean). Pass the count of the whole global micro-batch when data parallelism splits it, so every
    shard's loss is a term of the one global loss (the boundary-resharding convention, see
    ``parallel.pipeline.reshard``). At tp=1 this is ``ops.cross_entropy`` on the full logits (no collective).
    The loss is the same on every TP rank; each rank's backward fills only its vocab slice.
    """
    flat, labels = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    keep = labels != ignore_index
    if tp_size(comm) == 1:
        if token_count is None:
            return ops.cross_entropy(flat, labels, ignore_index=ignore_index)
        return ops.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum") / token_count
    per_token = _VocabParallelCrossEntropy.apply(flat, labels.masked_fill(~keep, 0), comm)
    total = (per_token * keep).sum()
    return total / (keep.sum().clamp(min=1) if token_count is None else token_count)


__all__ = [
    "ColumnParallelLinear", "LayerNorm", "ParamMeta", "RMSNorm", "RowParallelLinear", "ShardSpec", "VocabParallelEmbedding",
    "local_shard", "out_std", "param_meta", "parallel_input", "vocab_parallel_cross_entropy",
]
