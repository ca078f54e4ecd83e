"""The loss the pipeline applies to the last stage's logits (the stage itself stops at the logits).

Kept out of the model so a schedule can own it, as torch.distributed.pipelining's ``loss_fn``: the
same stage module then serves hal's engine, torch's ``PipelineStage`` and single-process runs.
"""
from __future__ import annotations

from typing import Callable

import torch

from hal.parallel.models.layers import vocab_parallel_cross_entropy
from hal.parallel.models.tp_comm import TPComm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> one micro-batch's loss


def token_sum_cross_entropy(tp_comm: TPComm, token_count: int | None = None) -> LossFn:
    """Cross-entropy of logits (..., V/tp: this rank's vocab slice) against labels (...), ``-100`` ignored.

    The token sum over ``token_count`` (None: the mean over the labels given). The engine passes the
    whole micro-batch's token count so a dp replica's loss is a term of the global mean
    (``parallel.pipeline.reshard``). The result is the same on every TP rank of ``tp_comm``.
    """
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, tp_comm, token_count=token_count)

    return loss_fn


__all__ = ["LossFn", "token_sum_cross_entropy"]
