"""The training loop's learning-rate schedule, global gradient clipping and AdamW's implementation choice.

Learning rate: linear warm-up from 0 over ``warmup_steps``, then constant, cosine or linear decay to
``min_lr`` at the last step — a pure function of the step, so a resumed run continues on the same
curve. (Without warm-up a fresh model's first AdamW steps move every weight by the full lr at once:
on an H100 the 1.2B model's loss jumped from 5.7 to 12.0 at step 3 at lr 3e-4.)

Clipping: the norm is the one of the WHOLE model's gradient, the same number every rank of the
pipeline would get on one device: each rank adds the squares of the gradients it alone owns —
a TP shard always, a TP-replicated parameter on TP rank 0 only, dp replicas (equal after the dp
sum) on dp rank 0 only, a tied embedding's head copy not at all on the last stage — and one SUM
all-reduce over the world adds them up. Every rank then scales by the same factor.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from hal.parallel.config.run import LR_SCHEDULES
from hal.parallel.models.layers import param_meta


def learning_rate(step: int, *, lr: float, steps: int, warmup_steps: int = 0, schedule: str = "constant",
                  min_lr: float = 0.0) -> float:
    """The lr of 0-based ``step`` of a run of ``steps`` steps."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r}: use one of {', '.join(LR_SCHEDULES)}")
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    span = max(1, steps - warmup_steps - 1)
    done = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - done)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))


def set_learning_rate(optimizer: Any, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value


def owned_square_sum(named: Iterable[tuple[str, torch.Tensor]], *, tp_rank: int, dp_rank: int,
                     skip: frozenset[str] = frozenset(), ep: int = 1) -> torch.Tensor:
    """Sum of squares of the gradients this rank alone owns (see the module doc), as a float64 host scalar.
    ``ep``: the stage's expert parallelism — dp replicas 0..ep-1 each own their share of the experts."""
    total = torch.zeros((), dtype=torch.float64)
    if dp_rank != 0 and dp_rank >= ep:
        return total
    parts = []
    for name, p in named:
        if p.grad is None or name in skip:
            continue
        meta = param_meta(p)
        if dp_rank != 0 and not (meta is not None and meta.expert_split):
            continue  # replicated over dp: counted on dp replica 0; expert shards on the first ep group
        if tp_rank != 0 and (meta is None or meta.spec is None):
            continue  # replicated over TP: counted once, on TP rank 0
        parts.append(p.grad.detach().float().square().sum())
    if parts:
        total += torch.stack(parts).sum().double().cpu()
    return total


def clip_global_norm(module: torch.nn.Module, max_norm: float, *, tp_rank: int, dp_rank: int,
                     skip: frozenset[str] = frozenset(), ep: int = 1, copies: int = 1) -> float:
    """Scale every gradient of ``module`` so the whole pipeline's gradient norm is at most ``max_norm``.

    Collective over the world (every rank calls it). Returns the norm before clipping. ``copies``: how many copies of
    the whole gradient the world holds (replicas after their every-step sync hold one each): the sum is divided by it.
    """
    square = owned_square_sum(module.named_parameters(), tp_rank=tp_rank, dp_rank=dp_rank, skip=skip, ep=ep)
    if dist.is_initialized():
        dist.all_reduce(square, op=dist.ReduceOp.SUM)
    square = square / copies
    norm = math.sqrt(float(square))
    if math.isfinite(norm) and norm > max_norm:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


__all__ = ["LR_SCHEDULES", "clip_global_norm", "learning_rate", "owned_square_sum", "set_learning_rate"]


def adamw_options(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation choice for ``device``: CUDA (and ROCm, which torch also calls cuda) has one fused
    kernel for the whole update; elsewhere torch's default (foreach) stays, which the single-process
    references of the tests also use. The trainer and the planner's measurement both build AdamW this way."""
    return {"fused": True} if device.type == "cuda" else {}


def decoupled_adamw(params: list[torch.nn.Parameter], device: torch.device, *, lr: float,
                    weight_decay: float | None = None) -> torch.optim.AdamW:
    """AdamW as the trainer builds it: weight decay on matrices only (norm weights and biases get none), the
    implementation ``adamw_options`` picks. ``weight_decay`` None: torch's default. The trainer, the planner's
    optimizer measurement and its calibration pipeline all use it, so they time the same update."""
    import torch

    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, **decay, **adamw_options(device))
