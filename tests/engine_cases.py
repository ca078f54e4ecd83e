"""Per-rank bodies for the engine equivalence tests (run through tests.dist_harness)."""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import replace
from typing import Any

import torch

from hal.parallel.config.model import ModelConfig

MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=64, max_seq_len=8)


def batch(seed: int, step: int, micro_batches: int, mbs: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(0, vocab, (micro_batches, mbs, seq + 1), generator=g)


def model_config(tied: bool, num_layers: int = MODEL.num_layers) -> ModelConfig:
    return replace(MODEL, tie_embeddings=tied, num_layers=num_layers)


def reference(plan_raw: dict, steps: int, lr: float, seed: int = 0, tied: bool = False,
              num_layers: int = MODEL.num_layers) -> dict[str, Any]:
    """The single-process run: same model, seed, data; losses per step and step-1 gradients.

    It depends on the plan only through its micro-batching, so plans that share it share one computation (cached
    for the test session; callers only read it)."""
    from hal.parallel.config.plan import parse_plan

    plan = parse_plan(plan_raw)
    return _reference(plan.micro_batches, plan.micro_batch_size, steps, lr, seed, tied, num_layers)


@functools.cache
def _reference(micro_batches: int, micro_batch_size: int, steps: int, lr: float, seed: int, tied: bool,
               num_layers: int) -> dict[str, Any]:
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import full_model

    model = full_model(model_config(tied, num_layers), seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        tokens = batch(seed, step, micro_batches, micro_batch_size, MODEL.max_seq_len, MODEL.vocab_size)
        x = tokens[..., :-1].reshape(-1, MODEL.max_seq_len)
        y = tokens[..., 1:].reshape(-1, MODEL.max_seq_len)
        opt.zero_grad()
        loss = vocab_parallel_cross_entropy(model(x), y, None)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads}


def engine_run(rank: int, world: int, plan_raw: dict, steps: int, lr: float, seed: int = 0, tied: bool = False,
               num_layers: int = MODEL.num_layers, times: dict | None = None, switch_at: int = 0,
               pair_overlap: str | None = None) -> dict[str, Any]:
    """This rank's part of the same run through the pipeline engine. ``times`` (``StageTimes.of``'s arguments): from
    step ``switch_at`` on, the schedule's order is the one played with them (as ``parallel.order: measured`` does).
    A compiled plan also reports its graphs, its graph breaks and Dynamo's lru_cache warnings. ``pair_overlap``:
    HAL_PAIR_OVERLAP for this run (the rank's environment is restored after: a world serves many tests)."""
    from hal.parallel.schedules.pairs import ENV

    before = os.environ.get(ENV)
    if pair_overlap is not None:
        os.environ[ENV] = pair_overlap
    try:
        return _engine_run(plan_raw, steps, lr, seed, tied, num_layers, times, switch_at)
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def _engine_run(plan_raw: dict, steps: int, lr: float, seed: int, tied: bool, num_layers: int, times: dict | None,
                switch_at: int) -> dict[str, Any]:
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    plan = parse_plan(plan_raw)
    topology = Topology.from_plan(plan)
    world = current_world()
    groups = build_mesh(topology, world, validate=False, tied_embeddings=tied)  # as hal train runs it
    engine = build_engine(model_config(tied, num_layers), plan, groups, backend=world.backend, seed=seed,
                            device=world.device)
    opt = torch.optim.AdamW(engine.module.parameters(), lr=lr)
    losses, grads, link = [], {}, None
    with warnings.catch_warnings(record=True) as seen:  # what a compiled run prints (Dynamo's lru_cache warning: none)
        warnings.simplefilter("always")
        if plan.compile:
            from torch._dynamo.utils import counters

            counters.clear()
        for step in range(steps):
            _engine_step(engine, opt, plan, step, seed, times, switch_at, losses)
            if step == 0:
                grads = {n: g.cpu().tolist() for n, g in gather_full_grads(engine.module).items()}
                if times is not None:  # what a calibration measures: one activation's trip to the next stage
                    link = engine.time_links(repeats=1)
            opt.step()
    compiled = {}
    if plan.compile:
        compiled = {"graphs": counters["stats"]["unique_graphs"], "breaks": sorted(counters["graph_break"]),
                    "lru_warnings": sum("lru_cache" in str(w.message) for w in seen)}
    return {"coord": tuple(groups.coord), "losses": losses, "grads": grads, "link": link, "compiled": compiled,
            "pairs": (engine.pair_overlap, engine.pairs_run)}


def _engine_step(engine: Any, opt: Any, plan: Any, step: int, seed: int, times: dict | None, switch_at: int,
                 losses: list) -> None:
    from hal.parallel.schedules.stage_times import StageTimes

    if times is not None and step == switch_at:
        engine.set_schedule(plan.schedule.timed(StageTimes.of(**times)))
    tokens = batch(seed, step, plan.micro_batches, plan.micro_batch_size, MODEL.max_seq_len, MODEL.vocab_size)
    opt.zero_grad()
    losses.append(engine.step(tokens))


def overlap_run(rank: int, world: int, gate: str, micro_batches: int) -> float | None:
    """2 stages, GPipe: stage 1 starts receiving only after stage 0 finished ALL its forwards.

    gloo point-to-point is a rendezvous (a send completes only once its receive is posted), so a
    stage 0 that waited for each send before computing on would block on its first send forever:
    this run completes only if sends stay in flight while stage 0 computes.
    """
    import datetime

    import torch.distributed as dist

    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    plan = parse_plan({"schedule": "gpipe", "micro_batches": micro_batches, "micro_batch_size": 2,
                       "stages": [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]})
    topology = Topology.from_plan(plan)
    joined = current_world()
    groups = build_mesh(topology, joined, validate=False)  # as hal train: peer checks would rendezvous too
    engine = build_engine(MODEL, plan, groups, backend=joined.backend, seed=0, device=torch.device("cpu"))
    store = dist.FileStore(gate, world)
    if rank == 0:
        forwards = 0

        def count(*_: Any) -> None:
            nonlocal forwards
            forwards += 1
            if forwards == micro_batches:
                store.set("stage0_forwards_done", "1")

        engine.module.register_forward_hook(count)
    else:
        store.wait(["stage0_forwards_done"], datetime.timedelta(seconds=20))
    return engine.step(batch(0, 0, micro_batches, 2, MODEL.max_seq_len, MODEL.vocab_size))


def first_half_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss other than the default: the mean cross-entropy of each sequence's first half only."""
    from hal.parallel.models.layers import vocab_parallel_cross_entropy

    masked = labels.clone()
    masked[:, labels.shape[1] // 2:] = -100
    return vocab_parallel_cross_entropy(logits, masked, None)


def loss_fn_run(rank: int, world: int, micro_batches: int) -> dict[str, Any]:
    """One stage on one rank: the step loss with the default loss and with ``first_half_loss``, and what it saw."""
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    plan = parse_plan({"schedule": "1f1b", "micro_batches": micro_batches, "micro_batch_size": 2,
                       "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]})
    topology = Topology.from_plan(plan)
    groups = build_mesh(topology, current_world(), validate=False)
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def recording(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(logits.shape), tuple(labels.shape)))
        return first_half_loss(logits, labels)

    tokens = batch(0, 0, micro_batches, 2, MODEL.max_seq_len, MODEL.vocab_size)
    losses = {}
    for name, fn in (("default", None), ("first_half", recording)):
        engine = build_engine(MODEL, plan, groups, backend=current_world().backend, seed=0, device=torch.device("cpu"), loss_fn=fn)
        losses[name] = engine.step(tokens)
    return {"losses": losses, "seen": seen}
