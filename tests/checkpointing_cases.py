"""Bodies for the activation-checkpointing tests: one stage run with and without checkpointing.

``measure`` runs forward and backward once, counting what autograd saves for backward (through
``saved_tensors_hooks``, which also see the inputs a non-reentrant checkpoint keeps; parameters
are left out: they are not activations) and the TP collectives each pass runs.
"""
from __future__ import annotations

from typing import Any

import torch

from hal.parallel.config.model import ModelConfig

SEED = 5


def config(seq: int) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=64, max_seq_len=seq)


def data(seq: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


class CountingComm:
    """A TP communicator that counts its collectives (the layers need only these four names)."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.counts = comm, {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}

    size = property(lambda self: self.comm.size)
    group_rank = property(lambda self: self.comm.group_rank)

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        self.counts["all_reduce"] += 1
        return self.comm.all_reduce(*args, **kwargs)

    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        self.counts["all_gather"] += 1
        return self.comm.all_gather(*args, **kwargs)

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        self.counts["reduce_scatter"] += 1
        return self.comm.reduce_scatter(*args, **kwargs)


def measure(checkpoint: bool, seq: int, tp_comm: Any = None, sp: bool = False, layers: range | None = None) -> dict[str, Any]:
    """Loss, gradients (local shards, and the input's when not first), saved tensors and collectives."""
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import build_stage

    cfg = config(seq)
    layers = layers if layers is not None else range(cfg.num_layers)
    first = layers.start == 0
    counter = CountingComm(tp_comm) if tp_comm is not None and tp_comm.size > 1 else None
    stage = build_stage(cfg, layers, first=first, last=True, tp_comm=counter, sp=sp, seed=SEED, checkpoint=checkpoint)
    ids, labels = data(seq)
    x = ids if first else torch.randn(2, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).requires_grad_()
    params = {p.data_ptr() for p in stage.parameters()}
    saved = {"tensors": 0, "bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved["tensors"] += 1
            saved["bytes"] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = vocab_parallel_cross_entropy(stage(x), labels, stage.tp_comm)
    forward = dict(counter.counts) if counter else {}
    loss.backward()
    backward = {k: v - forward[k] for k, v in counter.counts.items()} if counter else {}
    grads = {n: p.grad.detach().clone() for n, p in stage.named_parameters()}
    if not first:
        grads["<input>"] = x.grad.detach().clone()
    return {"loss": loss.detach(), "grads": grads, "saved": saved, "forward": forward, "backward": backward}


def compare(plain: dict[str, Any], ckpt: dict[str, Any]) -> dict[str, Any]:
    """Plain-data summary: bitwise equality, the largest gradient difference, both measurements."""
    diffs = [float((ckpt["grads"][n] - g).abs().max()) for n, g in plain["grads"].items()]
    return {
        "loss_equal": bool(torch.equal(plain["loss"], ckpt["loss"])),
        "grads_equal": all(torch.equal(ckpt["grads"][n], g) for n, g in plain["grads"].items()),
        "max_grad_diff": max(diffs), "names": sorted(plain["grads"]) == sorted(ckpt["grads"]),
        "saved": (plain["saved"], ckpt["saved"]), "forward": (plain["forward"], ckpt["forward"]),
        "backward": (plain["backward"], ckpt["backward"]),
    }


ENGINE_PLAN = {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
               "stages": [{"backend": "cpu", "devices": 1, "layers": 2},
                          {"backend": "cpu", "devices": 2, "layers": 2, "tp": 2, "sp": True}]}
ENGINE_STEPS, ENGINE_LR = 3, 3e-3


def engine_checkpointed(rank: int, world: int) -> dict[str, Any]:
    """A 2-stage plan (tp1 → tp2+sp, 1F1B) with every stage checkpointed; losses to compare with one process."""
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    from .engine_cases import MODEL, batch

    plan = parse_plan(ENGINE_PLAN)
    topology = Topology.from_plan(plan)
    joined = current_world()
    groups = build_mesh(topology, joined, validate=False)  # as hal train runs it
    engine = build_engine(MODEL, plan, groups, backend=joined.backend, seed=0, device=torch.device("cpu"))
    engine.module.checkpoint = True  # what build_stage(..., checkpoint=mesh.checkpoint) will set
    opt = torch.optim.AdamW(engine.module.parameters(), lr=ENGINE_LR)
    losses = []
    for step in range(ENGINE_STEPS):
        tokens = batch(0, step, plan.micro_batches, plan.micro_batch_size, MODEL.max_seq_len, MODEL.vocab_size)
        opt.zero_grad()
        losses.append(engine.step(tokens))
        opt.step()
    return {"stage": groups.coord.stage, "losses": losses}


def world3(rank: int, world: int) -> dict[str, Any]:
    """Ranks 1, 2: tp=2 (sp off and on) with and without checkpointing. Then all three: the engine
    on a 2-stage plan (tp1 → tp2+sp, 1F1B) with every stage checkpointed."""
    from hal.collectives import world_communicator

    tp = world_communicator().subgroup([1, 2])  # every rank creates every group
    out: dict[str, Any] = {}
    if rank in tp.ranks:
        for sp in (False, True):
            out[f"sp={sp}"] = compare(measure(False, 16, tp, sp), measure(True, 16, tp, sp))
    out["engine"] = engine_checkpointed(rank, world)
    return out
