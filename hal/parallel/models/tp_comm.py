"""Autograd-aware collectives over a tensor-parallel group (Megatron's "mappings").

Each function pairs a forward collective with its adjoint in backward, so parallel layers stay
ordinary autograd code:

    copy_to_tp_region          identity      | all-reduce      (enter a column-parallel layer, TP only)
    reduce_from_tp_region      all-reduce    | identity        (leave a row-parallel layer, TP only)
    gather_from_seq_region     all-gather    | reduce-scatter  (enter a column-parallel layer under SP)
    reduce_scatter_to_seq_region reduce-scatter | all-gather   (leave a row-parallel layer under SP)
    scatter_to_seq_region      take my chunk | all-gather      (enter SP from a replicated tensor)
    gather_to_replicated_region all-gather   | take my chunk   (leave SP into a region computed alike on every rank)

Activation layout: (batch, seq, hidden). Under sequence parallelism the seq dim is split over the
TP ranks in contiguous chunks: group rank t holds positions [t*S/tp, (t+1)*S/tp). The project's
``Communicator`` gathers and scatters along dim 0, so the seq functions move seq to the front,
communicate, and move it back (results are contiguous).

The group is a ``collectives.Communicator`` (anything with ``size``, ``group_rank``,
``all_reduce``, ``all_gather`` and ``reduce_scatter``). ``None`` or a group of size 1 means tp=1:
every function returns its input unchanged and no collective runs — that is how the parallel
layers reduce to plain layers.
"""
from __future__ import annotations

from typing import Any

import torch

from hal.collectives import Communicator
from hal.parallel.models.graph_breaks import eager_when_compiled

TPComm = Communicator | None


def tp_size(comm: TPComm) -> int:
    """Number of TP ranks (1 for ``None``)."""
    return 1 if comm is None else comm.size


def tp_rank(comm: TPComm) -> int:
    """This rank's index inside the TP group (0 for ``None``)."""
    return 0 if comm is None else comm.group_rank


def _active(comm: TPComm) -> bool:
    return comm is not None and comm.size > 1


# --- raw collectives (no autograd), each returning a fresh tensor ------------------------------
def _all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    # all_reduce works in place: reduce a copy, never a tensor autograd may still hold.
    return comm.all_reduce(x.contiguous().clone())


def _gather_seq(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, S/tp, H) → (B, S, H)."""
    return comm.all_gather(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, S, H) partial sums → (B, S/tp, H) of the full sum."""
    return comm.reduce_scatter(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


def _my_seq_chunk(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if x.shape[1] % comm.size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the TP size {comm.size}; pad the sequence")
    return x.chunk(comm.size, dim=1)[comm.group_rank].contiguous()


@eager_when_compiled
def _apply_mapping(mapping: type[torch.autograd.Function], x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """One mapping, run eagerly inside a compiled layer: the communicator's Python (validation, timeouts, async
    handles) cannot be traced; met while tracing, its collective broke the graph inside a context manager Dynamo
    cannot resume from. Here the break is clean, at the call."""
    return mapping.apply(x, comm)


# --- autograd functions ---------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.comm), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _reduce_scatter_seq(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.comm), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _my_seq_chunk(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.comm), None


class _GatherSeqReplicated(_GatherSeq):
    """``_GatherSeq``'s forward; backward takes this rank's chunk of a gradient every rank holds whole."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _my_seq_chunk(grad, ctx.comm), None


# --- public API -------------------------------------------------------------------------------
def copy_to_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (every TP rank used the same input)."""
    return _apply_mapping(_CopyToTP, x, comm) if _active(comm) else x


def reduce_from_tp_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """All-reduce of partial sums forward; identity backward (the sum's gradient is the same everywhere)."""
    return _apply_mapping(_ReduceFromTP, x, comm) if _active(comm) else x


def gather_from_seq_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """All-gather along seq forward ((B, S/tp, H) → (B, S, H)); reduce-scatter of the gradient backward."""
    return _apply_mapping(_GatherSeq, x, comm) if _active(comm) else x


def reduce_scatter_to_seq_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Reduce-scatter of partial sums along seq forward ((B, S, H) → (B, S/tp, H)); all-gather backward."""
    return _apply_mapping(_ReduceScatterSeq, x, comm) if _active(comm) else x


def scatter_to_seq_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Keep this rank's seq chunk of a replicated (B, S, H) tensor; all-gather of the gradient backward."""
    return _apply_mapping(_ScatterSeq, x, comm) if _active(comm) else x


def gather_to_replicated_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """All-gather along seq forward ((B, S/tp, H) → (B, S, H)) into a region every TP rank computes alike; backward
    keeps this rank's seq chunk of the gradient, which that region hands every TP rank whole (no sum: the
    ranks' gradients are the same one, not partial ones)."""
    return _apply_mapping(_GatherSeqReplicated, x, comm) if _active(comm) else x


__all__ = [
    "TPComm", "copy_to_tp_region", "gather_from_seq_region", "gather_to_replicated_region", "reduce_from_tp_region",
    "reduce_scatter_to_seq_region", "scatter_to_seq_region", "tp_rank", "tp_size",
]
