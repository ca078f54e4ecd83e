"""Will the model's training state fit? A lower bound per rank, checked before any process starts.

Each rank of a stage holds fp32 weights, fp32 gradients and AdamW's two fp32 moments for its share
of the parameters: 16 bytes a parameter (8 + 8/dp under ZeRO-1; routed experts split over ep first). Activations, buffers and the
allocator's slack come on top, so this bound only refuses plans that cannot fit at all — a model of
terabytes on a 24 GiB host is one line before anything is allocated, not a MemoryError in a rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan

WEIGHT_AND_GRADIENT_BYTES = 8  # fp32 weights + fp32 gradients, per parameter
OPTIMIZER_BYTES = 8  # AdamW's two fp32 moments, per parameter
GIB = 2**30


def layer_parameters(model: ModelConfig, index: int | None = None, *, active: bool = False) -> int:
    """One decoder layer: q/o projections, k/v at the kv width (and their bias), the feed-forward and two norms.

    The feed-forward is the dense SwiGLU MLP, or in an MoE layer the router, every expert (``active``: the
    top-k experts a token runs through) and the shared expert. ``index``: that layer; None: the mean layer
    of the model (rounded), what per-layer estimates of a uniform split use.
    """
    if index is None:
        return round(sum(layer_parameters(model, i, active=active) for i in range(model.num_layers)) / model.num_layers)
    hidden, kv_width = model.hidden_size, model.num_kv_heads * model.head_dim
    bias = hidden + 2 * kv_width if model.qkv_bias else 0
    attention = 2 * hidden * hidden + 2 * hidden * kv_width + 2 * hidden + bias
    if not model.is_moe_layer(index):
        return attention + 3 * hidden * model.ffn_hidden_size
    experts = model.moe_top_k if active else model.moe_num_experts
    expert = 3 * hidden * (model.moe_ffn_hidden_size or model.ffn_hidden_size)
    shared = 3 * hidden * model.moe_shared_ffn_size + (hidden if model.moe_shared_gate else 0)
    return attention + model.moe_num_experts * hidden + experts * expert + shared


def routed_expert_parameters(model: ModelConfig, index: int) -> int:
    """The routed experts' parameters in layer ``index`` (0 in a dense layer): what expert parallelism splits."""
    if not model.is_moe_layer(index):
        return 0
    return model.moe_num_experts * 3 * model.hidden_size * (model.moe_ffn_hidden_size or model.ffn_hidden_size)


def stage_parameters(model: ModelConfig, plan: ParallelPlan, index: int) -> int:
    """Parameters of stage ``index``: its layers, the embedding on the first, the norm and head on the last."""
    count = sum(layer_parameters(model, i) for i in plan.stage_layers(index))
    embedding = model.vocab_size * model.hidden_size
    if index == 0:
        count += embedding
    if index == plan.last_stage:
        count += model.hidden_size + (0 if model.tie_embeddings and plan.last_stage == 0 else embedding)
    return count


def rank_bytes(model: ModelConfig, plan: ParallelPlan, index: int) -> int:
    """The lower bound for one rank of stage ``index``: its share of weights, gradients and AdamW state.

    Dense parameters are split over tp, their ZeRO-1 state over dp; routed experts over the ep group, their
    ZeRO-1 state over the dp / ep replicas of each expert shard (``parallel.loop.zero.Zero1Experts``)."""
    stage: StagePlan = plan.stages[index]
    experts = sum(routed_expert_parameters(model, i) for i in plan.stage_layers(index))
    dense = stage_parameters(model, plan, index) - experts
    replicas = (stage.dp, stage.dp // stage.ep) if plan.zero1 else (1, 1)
    total = (dense / stage.tp * (WEIGHT_AND_GRADIENT_BYTES + OPTIMIZER_BYTES / replicas[0])
             + experts / (stage.tp * stage.ep) * (WEIGHT_AND_GRADIENT_BYTES + OPTIMIZER_BYTES / replicas[1]))
    return int(total)


@dataclass(frozen=True)
class MemoryPool:
    """Memory that ranks draw from: one accelerator's, or the host's (shared by every cpu rank on it)."""

    what: str
    bytes: int


def check_memory(model: ModelConfig, plan: ParallelPlan, pools: dict[int, MemoryPool | None], origin: str) -> None:
    """Refuse a plan whose lower bound exceeds the memory its ranks have (pools: stage -> its device's
    pool, None where unknown). Host pools add up every rank on the host; device pools are per rank."""
    host_need, host_pool = 0, None
    for index, pool in pools.items():
        if pool is None:
            continue
        need = rank_bytes(model, plan, index)
        if pool.what == "host":
            host_need += need * plan.stages[index].devices
            host_pool = pool
        elif need > pool.bytes:
            raise ConfigError(
                f"{origin}: stage {index} needs at least {need / GIB:,.1f} GiB a rank for weights, gradients and AdamW "
                f"state ({_why(model, plan, index)}) but a {pool.what} device has {pool.bytes / GIB:,.1f} GiB; "
                "shrink the model, give the stage fewer layers or more tp, or turn on zero1")
    if host_pool is not None and host_need > host_pool.bytes:
        raise ConfigError(
            f"{origin}: the cpu ranks need at least {host_need / GIB:,.1f} GiB together for weights, gradients and "
            f"AdamW state (16 B a parameter; {_stages(model, plan, pools)}) but this host has "
            f"{host_pool.bytes / GIB:,.1f} GiB of memory; shrink the model (hidden_size, ffn_hidden_size, num_layers, "
            "vocab_size), or use fewer dp replicas or zero1")


def _why(model: ModelConfig, plan: ParallelPlan, index: int) -> str:
    stage = plan.stages[index]
    return f"{stage_parameters(model, plan, index) / 1e9:,.2f} G parameters / tp {stage.tp} × 16 B"


def _stages(model: ModelConfig, plan: ParallelPlan, pools: dict[int, MemoryPool | None]) -> str:
    return ", ".join(f"stage {i}: {plan.stages[i].devices} × {rank_bytes(model, plan, i) / GIB:,.1f} GiB"
                     for i, pool in pools.items() if pool is not None and pool.what == "host")
