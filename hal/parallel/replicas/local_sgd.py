"""Local SGD across replicas (DiLoCo): each replica steps on its own gradients; every H steps they meet.

At a meeting every rank computes its replica's parameter delta since the last meeting (anchor − now), the
replicas sum the deltas weighted by their token shares (``ReplicaExchange``: full tensors by name, across the
bridge) — the *outer gradient* — and every replica applies the same outer step from the anchor: SGD with
Nesterov momentum (``outer_momentum`` μ, ``outer_lr`` η):

    m ← μ·m + Δ;   p ← anchor − η·(Δ + μ·m)   (μ = 0: p ← anchor − η·Δ);   anchor ← p

so the replicas leave every meeting with the same parameters. Cross-island bytes fall by H. With H = 1, η = 1,
μ = 0 the parameters after a step are the token-weighted mean of the replicas' own steps: for an inner SGD that
is exactly the every-step gradient sync; for AdamW it is not (each replica's Adam normalises its own gradient).
Inner optimizer states stay each replica's own. A checkpoint (taken at a meeting) keeps the outer momentum beside
the weights; a resumed run anchors at the loaded weights (``resume``).
"""
from __future__ import annotations

import torch

from hal.parallel.replicas.sync import ReplicaExchange


class LocalSGD:
    """This rank's anchor and outer momentum (its own shards), and the outer step every ``every`` steps."""

    def __init__(self, exchange: ReplicaExchange, every: int, outer_lr: float = 1.0, outer_momentum: float = 0.0) -> None:
        if every < 1:
            raise ValueError(f"local SGD needs every >= 1, got {every}")
        self.exchange, self.every, self.lr, self.momentum = exchange, every, outer_lr, outer_momentum
        self.anchor = {n: p.detach().clone() for n, p in exchange.params.items()}
        self.velocity = {n: torch.zeros_like(p) for n, p in self.anchor.items()} if outer_momentum else {}
        self.bytes_sent = 0  # cross-replica bytes of the last meeting (0 on steps without one)

    @torch.no_grad()
    def resume(self, velocity: dict[str, torch.Tensor] | None) -> None:
        """After a checkpoint was loaded into the parameters (a checkpoint is taken where the replicas meet): the
        anchor is the loaded weights; ``velocity``: the outer momentum's full tensors saved with it (this rank keeps
        its shards), or None where the checkpoint has none (the momentum restarts at zero)."""
        mesh = self.exchange.mesh
        for name, p in self.exchange.params.items():
            self.anchor[name].copy_(p.detach())
            if self.momentum:
                if velocity is not None and name in velocity:
                    self.velocity[name].copy_(mesh.shard(velocity[name], p).to(device=p.device, dtype=p.dtype))
                else:
                    self.velocity[name].zero_()

    def due(self, steps_done: int) -> bool:
        """Whether the replicas meet after ``steps_done`` inner steps."""
        return steps_done % self.every == 0

    @torch.no_grad()
    def after_step(self, steps_done: int, weight: float) -> bool:
        """Call after every inner optimizer step (every rank together); meets when due. True when it met."""
        self.bytes_sent = 0
        if not self.due(steps_done):
            return False
        mesh, params = self.exchange.mesh, self.exchange.params
        delta = {n: self.anchor[n] - p.detach() for n, p in params.items()}
        summed = self.exchange.exchange(mesh.gather_full(self.exchange.module, delta), weight)
        self.bytes_sent = self.exchange.bytes_sent
        for name, p in params.items():
            outer = mesh.shard(summed[name], p).to(p.dtype)
            if self.momentum:
                v = self.velocity[name].mul_(self.momentum).add_(outer)
                outer = outer + self.momentum * v
            p.copy_(self.anchor[name] - self.lr * outer)
            self.anchor[name].copy_(p)
        return True
