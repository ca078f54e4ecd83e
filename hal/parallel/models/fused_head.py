"""The LM head and its loss in one step, so a micro-batch's full logits never exist in memory.

With ``parallel.models.fused_head: true`` the last stage stops at the normalised hidden state and the loss
function applies the head: at tp = 1 through the registry's ``linear_cross_entropy`` (the chunked
Triton kernel on cuda; the reference elsewhere, which does form the logits), and under tensor
parallelism through ``VocabParallelLinearCrossEntropy`` below — chunked over tokens, each rank
multiplying by its own vocabulary slice of the head and agreeing on every row's max and sum of
exponentials with two small all-reduces per chunk (Megatron's vocab-parallel cross-entropy, fused
with the matmul as Liger-Kernel fuses the single-device one).

Both compute the weight and input gradients during the forward (the logits are needed for both and
are gone afterwards) and scale them by the loss's gradient in the backward, so that backward runs
once. The input gradient is this rank's partial sum over its vocabulary slice: the head's input
went through ``parallel_input``, whose backward sums it over the TP group, as for the plain head.
"""
from __future__ import annotations

from typing import Any

import torch

from hal import ops
from hal.parallel.models.loss import LossFn
from hal.parallel.models.tp_comm import TPComm, tp_rank, tp_size

LOGITS_BUDGET = 256 * 2**20  # bytes of one chunk's fp32 logits (the vocab-parallel path's working set)
MIN_CHUNK = 256  # tokens: fewer starve the matmuls


def chunk_tokens(tokens: int, vocab_slice: int) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within ``LOGITS_BUDGET``."""
    fit = max(MIN_CHUNK, LOGITS_BUDGET // max(1, 4 * vocab_slice))
    return max(1, min(tokens, fit))


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` where ``weight`` is this rank's (V/tp, H) vocab slice.

    Returns the fp32 sum over the non-ignored tokens, the same on every TP rank.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, comm: TPComm,
                ignore_index: int, chunk: int) -> torch.Tensor:
        n, rows = hidden.shape[0], weight.shape[0]
        first = tp_rank(comm) * rows
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            h_c, t_c = hidden[start:start + chunk], target[start:start + chunk]
            grad, loss_sum = _chunk_loss_and_grad(h_c @ weight.t(), t_c, first, ignore_index, comm)
            total += loss_sum
            grad = grad.to(hidden.dtype)
            if dh is not None:
                torch.mm(grad, weight, out=dh[start:start + chunk])
            if dw is not None:
                dw.addmm_(grad.t(), h_c)
        ctx.save_for_backward(*(g for g in (dh, dw) if g is not None))
        ctx.has = (dh is not None, dw is not None)
        ctx.spent = False
        return total

    @staticmethod
    def backward(ctx: Any, d_loss: torch.Tensor) -> tuple[Any, ...]:
        if ctx.spent:
            raise RuntimeError("the fused vocab-parallel head's backward runs once: its gradients were computed in the "
                               "forward and are scaled in place")
        ctx.spent = True
        saved = list(ctx.saved_tensors)
        dh = saved.pop(0).mul_(d_loss) if ctx.has[0] else None
        dw = saved.pop(0).mul_(d_loss) if ctx.has[1] else None
        return dh, dw, None, None, None, None


def _chunk_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, first: int, ignore_index: int,
                         comm: TPComm) -> tuple[torch.Tensor, torch.Tensor]:
    """d(summed loss)/d(logits) of one chunk (fp32, this rank's columns) and the chunk's summed loss."""
    x = logits.float()
    rows = x.shape[1]
    row_max = x.max(dim=-1).values
    if tp_size(comm) > 1:
        comm.all_reduce(row_max, "max")
    x.sub_(row_max.unsqueeze(-1))
    valid = target != ignore_index
    local = target - first
    here = valid & (local >= 0) & (local < rows)
    index = local.clamp(0, rows - 1).unsqueeze(-1)
    picked = x.gather(-1, index).squeeze(-1).masked_fill(~here, 0.0)
    x.exp_()
    stats = torch.stack([x.sum(dim=-1), picked])  # one all-reduce for both
    if tp_size(comm) > 1:
        comm.all_reduce(stats, "sum")
    sum_exp, target_logit = stats[0], stats[1]
    loss = ((sum_exp.log() - target_logit) * valid).sum()
    x.div_(sum_exp.unsqueeze(-1))  # softmax
    x.scatter_add_(-1, index, -here.to(x.dtype).unsqueeze(-1))
    x.mul_(valid.to(x.dtype).unsqueeze(-1))
    return x, loss


def fused_head_cross_entropy(stage: Any, token_count: int, ignore_index: int = -100) -> LossFn:
    """The engine's loss for a fused-head last stage: ``stage``'s head applied to its hidden output.

    Same convention as ``parallel.models.loss.token_sum_cross_entropy``: the token sum over ``token_count``.
    Under autocast the head runs in the autocast dtype, as ``F.linear`` would (the cast weight's
    gradient flows back to the fp32 master weight).
    """
    comm = stage.tp_comm

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = stage.head_weight
        kind = hidden.device.type
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        flat, target = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        with torch.autocast(kind, enabled=False):
            if tp_size(comm) == 1:
                total = ops.linear_cross_entropy(flat, weight, target, ignore_index=ignore_index, reduction="sum")
            else:
                total = VocabParallelLinearCrossEntropy.apply(flat, weight, target, comm, ignore_index,
                                                              chunk_tokens(flat.shape[0], weight.shape[0]))
        return total.float() / token_count

    return loss_fn


__all__ = ["VocabParallelLinearCrossEntropy", "chunk_tokens", "fused_head_cross_entropy"]
