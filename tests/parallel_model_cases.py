"""Per-rank bodies for the parallel-model equivalence tests (run through tests.dist_harness).

Every rank builds the single-process reference (``full_model``, no communicator) from the same
seed and data, runs its parallel version, and reports relative errors; the test asserts on them.
"""
from __future__ import annotations

from typing import Any

import torch

from hal.parallel.config.model import ModelConfig

SEED = 1234
BATCH, SEQ = 2, 16


def small_config(tied: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=128, max_seq_len=SEQ, tie_embeddings=tied)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)


def reference(config: ModelConfig) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss, full grads, full params) of the single-process model."""
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.shards import gather_full_grads, gather_full_params
    from hal.parallel.models.stage import full_model

    model = full_model(config, SEED)
    ids, labels = data()
    loss = vocab_parallel_cross_entropy(model(ids), labels, None)
    loss.backward()
    return loss.item(), gather_full_grads(model), gather_full_params(model)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: a per-tensor relative error that tiny entries cannot inflate."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """{name: relative error} for every name ``got`` holds (missing or misshapen: inf)."""
    return {n: rel(g, ref[n]) if n in ref and g.shape == ref[n].shape else float("inf") for n, g in got.items()}


def tp_equivalence(rank: int, world: int) -> list[dict[str, Any]]:
    """tp=world over the whole model, for sp off/on and untied/tied embeddings."""
    from hal.collectives import world_communicator
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.shards import gather_full_grads, gather_full_params
    from hal.parallel.models.stage import build_stage

    comm = world_communicator()
    ids, labels = data()
    rows = []
    for sp, tied in ((False, False), (True, False), (True, True), (False, True)):
        config = small_config(tied)
        ref_loss, ref_grads, ref_params = reference(config)
        stage = build_stage(config, range(config.num_layers), first=True, last=True, tp_comm=comm, sp=sp, seed=SEED)
        local_shapes = {n: tuple(p.shape) for n, p in stage.named_parameters()}
        with torch.no_grad():
            halved = vocab_parallel_cross_entropy(stage(ids), labels, comm, token_count=2 * BATCH * SEQ).item()
        loss = vocab_parallel_cross_entropy(stage(ids), labels, comm)
        loss.backward()
        rows.append({"halved": halved,
            "case": f"tp{world} sp={sp} tied={tied}", "loss": loss.item(), "ref_loss": ref_loss,
            "grads": compare(gather_full_grads(stage), ref_grads), "params": compare(gather_full_params(stage), ref_params),
            "names": sorted(ref_grads), "local_shapes": local_shapes,
        })
    return rows


def pipeline_tied_two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Two stages on two processes (tp=1 each), tied embeddings summed by sync_tied_embedding_grads."""
    from hal.collectives import world_communicator
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.models.stage import build_stage, sync_tied_embedding_grads

    comm = world_communicator()
    config = small_config(tied=True)
    ref_loss, ref_grads, _ = reference(config)
    ids, labels = data()
    stage = build_stage(config, range(rank, rank + 1), first=rank == 0, last=rank == 1, tp_comm=None, sp=False, seed=SEED)
    shape = (BATCH, SEQ, config.hidden_size)
    loss = None
    if rank == 0:
        h = stage(ids)
        comm.send(h.detach(), dst=1)
        h.backward(comm.recv(torch.empty(shape), src=1)[0])
    else:
        h = comm.recv(torch.empty(shape), src=0)[0].requires_grad_()
        loss = vocab_parallel_cross_entropy(stage(h), labels, None)
        loss.backward()
        comm.send(h.grad, dst=0)
    sync_tied_embedding_grads(stage, comm)
    return {"loss": None if loss is None else loss.item(), "ref_loss": ref_loss,
            "grads": compare(gather_full_grads(stage), ref_grads)}


def pipeline_mixed(rank: int, world: int) -> dict[str, Any]:
    """World 4, tied embeddings, two heterogeneous 2-stage plans; returns this rank's errors per plan.

    (a) stage 0 tp2+sp on ranks 0,1 → stage 1 tp2+sp on ranks 2,3: seq shards pass rank t → 2+t;
        tied gradients summed in the embedding groups {0,2}, {1,3} (same shard: cheap path).
    (b) stage 0 tp2 on ranks 0,1 → stage 1 dp2 (tp1) on ranks 2,3, one sequence each: each replica's
        loss is its token sum over the GLOBAL token count (``token_count``), so the gradients that
        cross the boundary need no scaling and stage 1 sums its gradients over dp; then the tied
        sum runs over all four ranks (different TP degrees: full-vocab path).
    """
    from hal.collectives import world_communicator
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.models.stage import build_stage, sync_tied_embedding_grads

    comm = world_communicator()
    groups = {r: comm.subgroup(r) for r in ((0, 1), (2, 3), (0, 2), (1, 3))}  # every rank creates every group
    config = small_config(tied=True)
    ref_loss, ref_grads, _ = reference(config)
    ids, labels = data()
    first, tp_pair = rank < 2, groups[(0, 1) if rank < 2 else (2, 3)]
    hidden = config.hidden_size
    out: dict[str, Any] = {}

    # (a) tp2+sp → tp2+sp
    t = rank % 2
    stage = build_stage(config, range(0, 1) if first else range(1, 2), first=first, last=not first, tp_comm=tp_pair, sp=True, seed=SEED)
    shard = (BATCH, SEQ // 2, hidden)
    loss = None
    if first:
        h = stage(ids)
        comm.send(h.detach().contiguous(), dst=2 + t)
        h.backward(comm.recv(torch.empty(shard), src=2 + t)[0])
    else:
        h = comm.recv(torch.empty(shard), src=t)[0].requires_grad_()
        loss = vocab_parallel_cross_entropy(stage(h), labels, tp_pair)
        loss.backward()
        comm.send(h.grad.contiguous(), dst=t)
    sync_tied_embedding_grads(stage, groups[(t, 2 + t)])
    out["a"] = {"loss": None if loss is None else loss.item(), "grads": compare(gather_full_grads(stage), ref_grads)}

    # (b) tp2 → dp2
    if first:
        stage = build_stage(config, range(0, 1), first=True, last=False, tp_comm=tp_pair, sp=False, seed=SEED)
        h = stage(ids)
        if t == 0:
            comm.send(h[0:1].detach().contiguous(), dst=2)
            comm.send(h[1:2].detach().contiguous(), dst=3)
        grads = [comm.recv(torch.empty(1, SEQ, hidden), src=src)[0] for src in (2, 3)]
        h.backward(torch.cat(grads))  # gradients of the one global loss: no scaling
        loss = None
    else:
        replica = rank - 2
        stage = build_stage(config, range(1, 2), first=False, last=True, tp_comm=None, sp=False, seed=SEED)
        h = comm.recv(torch.empty(1, SEQ, hidden), src=0)[0].requires_grad_()
        loss = vocab_parallel_cross_entropy(stage(h), labels[replica:replica + 1], None, token_count=BATCH * SEQ)  # a term of the global mean
        loss.backward()
        for dst in (0, 1):
            comm.send(h.grad.contiguous(), dst=dst)
        for p in stage.parameters():  # data parallelism: sum the replicas' terms
            tp_pair.all_reduce(p.grad, "sum")
        loss = tp_pair.all_reduce(loss.detach().clone(), "sum").item()
    sync_tied_embedding_grads(stage, comm)
    out["b"] = {"loss": loss, "grads": compare(gather_full_grads(stage), ref_grads)}
    out["ref_loss"] = ref_loss
    return out
