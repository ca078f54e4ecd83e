"""Per-rank bodies for the replica equivalence tests (run through tests.dist_harness)."""
from __future__ import annotations

from typing import Any

import torch

from .engine_cases import batch


def global_rows(seed: int, step: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """The step's global batch, (rows, S+1): what the single-process reference trains on in one piece."""
    return batch(seed, step, 1, rows, seq, vocab)[0]


def replica_run(rank: int, world: int, raw: dict, steps: int, lr: float, seed: int = 0, tied: bool = False,
                num_layers: int = 4, moe: dict[str, Any] | None = None, inner: str = "adamw",
                local_sgd: dict[str, Any] | None = None, runs: int = 1,
                shares: list[list[int]] | None = None, compress: str = "none", overlap: bool = True,
                bucket_bytes: int | None = None) -> dict[str, Any]:
    """This rank's part of a replicated run: its replica's engine on its rows, gradients summed across replicas
    every step — or, with ``local_sgd`` ({every, outer_lr, outer_momentum}), each replica on its own gradients and
    the replicas' deltas meeting every H steps. ``inner``: adamw | sgd. ``runs`` > 1: the run again from the start
    in the same world (a fresh engine), with ``local_sgd`` only from the second on: {"first": ..., "second": ...}.
    ``shares``: each step's rows per replica, in turn (a mid-run rebalance: ``Engine.set_micro_batches``).
    ``compress``: the cross-replica wire (none | bf16 | fp8). ``overlap``: the exchange during the backward where a
    stage allows it (``parallel.replicas.overlap``), as the trainer runs it. ``bucket_bytes``: the exchange's bucket
    size (default: the shipped one)."""
    if runs == 2:
        first = replica_run(rank, world, raw, steps, lr, seed, tied, num_layers, moe, inner, None)
        return {"first": first, "second": replica_run(rank, world, raw, steps, lr, seed, tied, num_layers, moe, inner,
                                                      local_sgd)}
    from hal.collectives import current_world
    from hal.parallel.config.replicas import parse_replicated, validate_replicated
    from hal.parallel.loop.zero import Zero1AdamW
    from hal.parallel.models.shards import gather_full_grads, gather_full_params
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_meshes
    from hal.parallel.replicas.local_sgd import LocalSGD
    from hal.parallel.replicas.overlap import BackwardOverlap
    from hal.parallel.replicas.replica_set import dp_grad_sum
    from hal.parallel.replicas.sync import ReplicaExchange, token_weights

    from . import engine_cases, moe_cases

    config = moe_cases.model_config(moe) if moe is not None else engine_cases.model_config(tied, num_layers)
    rep = parse_replicated(raw)
    validate_replicated(rep, config, world_size=world, check_backends=False)
    joined = current_world()
    topologies = [r.topology() for r in rep.replicas]
    mesh = build_meshes(topologies, joined, validate=False, tied_embeddings=tied)
    index = rep.replica_of(joined.rank)
    plan = rep.replicas[index].plan
    engine = build_engine(config, plan, mesh, backend=joined.backend, seed=seed, device=joined.device)
    exchange = ReplicaExchange(mesh, engine.module, index, topologies, joined, compress=compress,
                               **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
    during = BackwardOverlap(exchange, engine, topologies, "on") if overlap and local_sgd is None else None
    engine.dp_grads = dp_grad_sum(mesh, engine.module, plan.zero1, True, during)  # as the trainer asks it
    early = 0
    params = list(engine.module.parameters())
    opt: Any = (torch.optim.SGD(params, lr=lr) if inner == "sgd" else Zero1AdamW(params, mesh.dp, lr=lr) if plan.zero1
                else torch.optim.AdamW(params, lr=lr))
    outer = LocalSGD(exchange, **local_sgd) if local_sgd is not None else None
    ranges = rep.row_ranges()
    losses, grads, sent = [], {}, 0
    for step in range(steps):
        if shares is not None:  # the rows move between replicas, as the trainer's rebalance moves them
            rep = rep.with_rows(shares[step % len(shares)])
            ranges, plan = rep.row_ranges(), rep.replicas[index].plan
            engine.set_micro_batches(plan.micro_batches)
        tokens = global_rows(seed, step, rep.global_batch, config.max_seq_len, config.vocab_size)
        weight = token_weights(tokens, ranges)[index]
        mine = tokens[ranges[index].start:ranges[index].stop].reshape(plan.micro_batches, plan.micro_batch_size, -1)
        opt.zero_grad()
        if during is not None:
            during.begin(weight)
        loss = engine.step(mine)
        if during is not None and during.eligible:
            during.finish()
            early += during.early
            sent += exchange.bytes_sent
        elif outer is None:
            exchange.sync_grads(weight)
            sent += exchange.bytes_sent
        if step == 0:
            grads = {n: g.cpu().tolist() for n, g in gather_full_grads(engine.module).items()}
        opt.step()
        if outer is not None:
            outer.after_step(step + 1, weight)
            sent += outer.bytes_sent
        losses.append(exchange.step_loss(loss, weight))
    params_full = {n: t.cpu() for n, t in gather_full_params(engine.module).items()}
    return {"replica": index, "losses": losses, "grads": grads, "bytes_sent": sent, "params": params_full,
            "overlapped": None if during is None else (during.why_not or early),
            "bridged": [len(c.layout.islands) for c in exchange.groups.values() if c is not None]}


def fp8_wire_run(rank: int, world: int, steps: int, replicated: dict[str, Any]) -> dict[str, Any]:
    """``Fp8Wire`` between the world's ranks (each its own island: through the bridge), ``steps`` sends of a block
    whose small values fp8 cannot hold beside its large one, with and without error feedback; then
    ``replica_run(**replicated)`` with compress: fp8 in the same world."""
    from hal.collectives import current_world
    from hal.collectives.communicator import Communicator
    from hal.collectives.process_groups import make_layout
    from hal.parallel.replicas.fp8_wire import Fp8Wire

    joined = current_world()
    group = Communicator(make_layout(joined, list(range(world))), joined, validate=False)
    g = torch.Generator().manual_seed(rank)
    sent = [torch.randn(3000, generator=g) for _ in range(steps)]
    for x in sent:
        x[5] = 448.0  # the first block's scale is 1: its values below 2^-10 are lost (or kept only as a residual)
        x[6:1024] = 1e-3
    wire, plain = Fp8Wire(), Fp8Wire()
    summed, unfed, sums, wire_bytes = [], [], [], 0
    for x in sent:
        got = x.clone()
        wire_bytes = wire.all_reduce(got, group, 0)
        summed.append(got)
        raw = x.clone()
        plain.all_reduce(raw, group, 0)
        plain.reset()  # no error feedback: every step starts without a residual
        unfed.append(raw)
        total = x.clone()
        group.all_reduce(total, "sum")
        sums.append(total)
    residuals = wire.residuals[0].clone()
    group.all_reduce(residuals, "sum")
    return {"summed": torch.stack(summed), "unfed": torch.stack(unfed), "exact": torch.stack(sums),
            "residuals": residuals, "wire_bytes": wire_bytes,
            "replicated": replica_run(rank, world, **replicated, compress="fp8")}
