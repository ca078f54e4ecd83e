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
from hal.parallel.families.registry import get_family

WEIGHT_AND_GRADIENT_BYTES = 8  # fp32 weights + fp32 gradients, per parameter
OPTIMIZER_BYTES = 8  # AdamW's two fp32 moments, per parameter
GIB = 2**30


def layer_parameters(model: ModelConfig, index: int | None = None, *, active: bool = False) -> int:
    """One decoder layer's parameters, as the model's family counts them (``Family.layer_parameters``: for Llama's
    blocks the q/o projections, k/v at the kv width and their bias, the feed-forward and two norms; in an MoE layer
    the router, every expert — ``active``: the top-k experts a token runs through — and the shared expert).
    ``index``: that layer; None: the mean layer of the model (rounded), what per-layer estimates of a uniform
    split use.
    """
    if index is None:
        return round(sum(layer_parameters(model, i, active=active) for i in range(model.num_layers)) / model.num_layers)
    return get_family(model.family).layer_parameters(model, index, active=active)


def embedding_parameters(model: ModelConfig) -> int:
    """The input embedding table (the untied head is as large)."""
    return model.vocab_size * model.hidden_size


def final_norm_parameters(model: ModelConfig) -> int:
    """The norm after the last layer, as the model's family counts it."""
    return get_family(model.family).norm_parameters(model)


def routed_expert_parameters(model: ModelConfig, index: int) -> int:
    """The routed experts' parameters in layer ``index`` (0 in a dense layer): what expert parallelism splits."""
    if not model.is_moe_layer(index):
        return 0
    return model.moe_num_experts * 3 * model.hidden_size * (model.moe_ffn_hidden_size or model.ffn_hidden_size)


def stage_parameters(model: ModelConfig, plan: ParallelPlan, index: int) -> int:
    """Parameters of stage ``index``: its layers, the embedding on the first, the norm and head on the last."""
    count = sum(layer_parameters(model, i) for i in plan.stage_layers(index))
    embedding = embedding_parameters(model)
    if index == 0:
        count += embedding
    if index == plan.last_stage:
        count += final_norm_parameters(model) + (0 if model.tie_embeddings and plan.last_stage == 0 else embedding)
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
