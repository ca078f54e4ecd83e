"""A rank's engine from a model, a plan and its mesh: the stage module over the mesh's groups, the loss, then the engine.

Why apart from the engine: the engine runs a schedule over whatever stage, mesh, schedule and loss it is handed;
which layers the stage holds, how they are initialised (a seed, or a Hugging Face checkpoint), whether they
compile and which loss the last stage applies are the plan's and the model's decisions, made here once.
"""
from __future__ import annotations

import os
from typing import Any, Callable, ContextManager

import torch

from hal.backend import Backend
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan
from hal.parallel.models.fused_head import fused_head_cross_entropy
from hal.parallel.models.loss import LossFn, token_sum_cross_entropy
from hal.parallel.models.stage import Stage, build_stage
from hal.parallel.pipeline.compile_stage import compile_layers
from hal.parallel.pipeline.engine import PipelineEngine
from hal.parallel.pipeline.mesh import Mesh


def stage_for(model: ModelConfig, plan: ParallelPlan, mesh: Mesh, *, seed: int, device: torch.device,
              dtype: torch.dtype = torch.float32, init_from: str | os.PathLike[str] | None = None) -> Stage:
    """This rank's stage module: its layers (every chunk of them), sharded over the mesh's TP and expert groups,
    initialised from ``seed`` or sliced from the Hugging Face checkpoint ``init_from``; compiled where the plan
    says so."""
    layout = mesh.layout
    stage = build_stage(model, layout.layer_ranges, first=mesh.first, last=mesh.last, tp_comm=mesh.tp_shards,
                        sp=layout.sp, seed=seed, device=device, dtype=dtype, checkpoint=layout.checkpoint,
                        fused_head=plan.fused_head, init_from=init_from, ep_comm=mesh.expert_shards)
    if layout.compile:
        compile_layers(stage, layout.compile_backend)
    return stage


def default_loss(stage: Stage, tokens_per_micro_batch: int) -> LossFn:
    """The token-sum cross-entropy over a micro-batch's token count, through the fused head when the stage has one."""
    if stage.fused_head:
        return fused_head_cross_entropy(stage, tokens_per_micro_batch)
    return token_sum_cross_entropy(stage.tp_comm, token_count=tokens_per_micro_batch)


def build_engine(
    model: ModelConfig, plan: ParallelPlan, mesh: Mesh, *, backend: Backend, seed: int, device: torch.device,
    dtype: torch.dtype = torch.float32, seq_len: int | None = None, autocast: Callable[[], ContextManager[Any]] | None = None,
    loss_fn: LossFn | None = None, fp8_dtype: torch.dtype | None = None, init_from: str | os.PathLike[str] | None = None,
) -> PipelineEngine:
    """The engine running ``plan`` on this rank: (stage, mesh, schedule, loss) made from the model and the plan.

    ``loss_fn``: default the token-sum cross-entropy (``default_loss``). ``seq_len``: default the model's
    ``max_seq_len``. The other arguments go to ``PipelineEngine``."""
    seq = seq_len or model.max_seq_len
    stage = stage_for(model, plan, mesh, seed=seed, device=device, dtype=dtype, init_from=init_from)
    loss = loss_fn or default_loss(stage, plan.micro_batch_size * seq)
    return PipelineEngine(stage, mesh, plan.schedule, loss, micro_batches=plan.micro_batches,
                          micro_batch_size=plan.micro_batch_size, seq_len=seq, backend=backend, device=device,
                          dtype=dtype, autocast=autocast, fp8_dtype=fp8_dtype)


__all__ = ["build_engine", "default_loss", "stage_for"]
