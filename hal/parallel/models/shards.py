"""Full-shape views of a sharded stage: its TP shards (and expert shards) gathered back into full tensors by name,
for checkpoints, the cross-replica sync and comparisons. Every rank of the groups calls them (collectives)."""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from hal.parallel.models.layers import param_meta
from hal.parallel.models.tp_comm import TPComm, tp_size


def gather_full(params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], tp: TPComm,
                ep: TPComm = None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` (each shaped like ``params[name]``, this rank's shard) in full shape: the TP shards over
    ``tp``, then (expert shards) every ``ep`` rank's experts in order. Never returns a live tensor."""
    out = {}
    for name, local in tensors.items():
        meta = param_meta(params[name])
        full = local.detach()
        if meta is not None and meta.spec is not None and tp_size(tp) > 1:
            dim = meta.spec.dim
            gathered = tp.all_gather(full.movedim(dim, 0).contiguous())  # type: ignore[union-attr]
            full = meta.spec.unshard([s.movedim(0, dim) for s in gathered.chunk(tp.size, dim=0)])  # type: ignore[union-attr]
        if meta is not None and meta.expert_split and tp_size(ep) > 1:
            full = ep.all_gather(full.contiguous())  # type: ignore[union-attr]
        out[name] = full.clone() if full.data_ptr() == local.data_ptr() else full
    return out


def _gather_full(stage: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return gather_full(dict(stage.named_parameters()), tensors, stage.tp_comm, getattr(stage, "ep_comm", None))


def gather_full_grads(stage: nn.Module) -> dict[str, torch.Tensor]:
    """{name: gradient in the full parameter's shape}; collective over the stage's TP group (and its ep group
    under expert parallelism).

    Every TP rank must call it (same parameters have gradients on every TP rank), and every rank of its ep group.
    """
    return _gather_full(stage, {n: p.grad for n, p in stage.named_parameters() if p.grad is not None})


def gather_full_params(stage: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full parameter}; collective over the stage's TP group (checkpoints, comparisons)."""
    return _gather_full(stage, {n: p for n, p in stage.named_parameters()})


__all__ = ["gather_full", "gather_full_grads", "gather_full_params"]
