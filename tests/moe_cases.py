"""Per-rank bodies for the MoE equivalence tests (run through tests.dist_harness)."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch

from hal.parallel.config.model import ModelConfig

from .engine_cases import batch

BASE = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                   max_seq_len=8, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
                   moe_aux_loss_weight=0.05, moe_z_loss_weight=0.01)


def model_config(moe: dict[str, Any]) -> ModelConfig:
    return replace(BASE, **moe)


def reference(plan_raw: dict, moe: dict[str, Any], steps: int, lr: float, seed: int = 0) -> dict[str, Any]:
    """The single-process run, one micro-batch at a time (the balancing loss is per micro-batch, over all
    its rows): losses per step, step-1 gradients and each MoE layer's step-1 load."""
    from hal.parallel.config.plan import parse_plan

    plan = parse_plan(plan_raw)
    return _reference(plan.micro_batches, plan.micro_batch_size, tuple(sorted(moe.items())), steps, lr, seed)


@functools.cache
def _reference(M: int, micro_batch_size: int, moe_items: tuple[tuple[str, Any], ...], steps: int, lr: float,
               seed: int) -> dict[str, Any]:
    """``reference`` of one micro-batching (cached for the test session: plans sharing it share one run)."""
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import full_model

    config = model_config(dict(moe_items))
    model = full_model(config, seed)
    model.configure_moe(1.0 / M)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads, load = [], {}, {}
    for step in range(steps):
        tokens = batch(seed, step, M, micro_batch_size, config.max_seq_len, config.vocab_size)
        opt.zero_grad()
        total = 0.0
        for m in range(M):
            loss = vocab_parallel_cross_entropy(model(tokens[m, :, :-1]), tokens[m, :, 1:], None) / M
            loss.backward()
            total += float(loss.detach())
        tally = model.take_moe_tally()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            load = {i: t["load"] for i, t in tally.items()}
        opt.step()
        losses.append(total)
    return {"losses": losses, "grads": grads, "load": load}


def engine_run(rank: int, world: int, plan_raw: dict, moe: dict[str, Any], steps: int, lr: float,
               seed: int = 0) -> dict[str, Any]:
    """This rank's part of the same run through the pipeline engine."""
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan, validate_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    plan = parse_plan(plan_raw)
    config = model_config(moe)
    validate_plan(plan, config, world_size=world, check_backends=False)
    topology = Topology.from_plan(plan)
    world_ = current_world()
    groups = build_mesh(topology, world_, validate=False)  # as hal train runs it
    engine = build_engine(config, plan, groups, backend=world_.backend, seed=seed, device=world_.device)
    opt = torch.optim.AdamW(engine.module.parameters(), lr=lr)
    losses, grads, load = [], {}, {}
    for step in range(steps):
        tokens = batch(seed, step, plan.micro_batches, plan.micro_batch_size, config.max_seq_len, config.vocab_size)
        opt.zero_grad()
        loss = engine.step(tokens)
        tally = engine.module.take_moe_tally()
        if step == 0:
            grads = {n: g.cpu().tolist() for n, g in gather_full_grads(engine.module).items()}
            load = {i: t["load"] for i, t in tally.items()}
        opt.step()
        losses.append(loss)
    ep_islands = len(groups.ep.layout.islands) if groups.ep is not None else 0
    return {"coord": tuple(groups.coord), "losses": losses, "grads": grads, "load": load, "ep_islands": ep_islands}


def scaled_grads(rank: int, world: int, plan_raw: dict, moe: dict[str, Any], scale: float) -> dict[str, Any]:
    """One step with the engine's loss scale set to ``scale`` (what fp16-mixed's scaler does): the gradients."""
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    plan = parse_plan(plan_raw)
    config = model_config(moe)
    topology = Topology.from_plan(plan)
    world_ = current_world()
    groups = build_mesh(topology, world_, validate=False)  # as hal train runs it
    engine = build_engine(config, plan, groups, backend=world_.backend, seed=0, device=world_.device)
    engine.loss_scale = scale
    engine.step(batch(0, 0, plan.micro_batches, plan.micro_batch_size, config.max_seq_len, config.vocab_size))
    return {n: g.cpu().tolist() for n, g in gather_full_grads(engine.module).items()}
