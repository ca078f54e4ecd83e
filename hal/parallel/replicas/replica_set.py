"""This rank's replica among the run's, and everything that passes between replicas, as one object the loop calls
unconditionally (torchtitan's ``FTManager`` is the model).

A run is always a set of replicas (``parallel.config.replicas``): a plain plan is the set of one. The set owns
which replica this rank trains, its rows of every step and their token weight, the exchange (``sync``), local SGD
(``local_sgd``), the exchange during the backward (``overlap``), the shares of ``rows: auto`` and their mid-run
rebalance (``shares``), the fp8 wire's state across a restart, and its part of the step record and the
checkpoint. With one replica nothing crosses islands: every method answers with nothing to do, so the training
loop has no branch for replicas.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.replicas import ReplicatedPlan
from hal.parallel.config.topology import Topology
from hal.parallel.data.batches import global_batch
from hal.parallel.pipeline.engine import DpGradSum
from hal.parallel.replicas.local_sgd import LocalSGD
from hal.parallel.replicas.overlap import BackwardOverlap
from hal.parallel.replicas.shares import ShareTracker, rebalance_text, resolve_shares
from hal.parallel.replicas.sync import ReplicaExchange, token_weights

if TYPE_CHECKING:
    from hal.collectives.process_groups import World
    from hal.parallel.config.run import TrainConfig
    from hal.parallel.pipeline.engine import PipelineEngine
    from hal.parallel.pipeline.mesh import Mesh


def dp_grad_sum(mesh: Mesh, module: torch.nn.Module, zero1: bool, exchanges: bool,
                overlap: BackwardOverlap | None) -> DpGradSum:
    """The one answer to who sums the dp gradients, from the mesh (the dp group, a tied embedding across stages) and
    the replica set (an exchange needs every gradient whole; the overlap sums them during the backward)."""
    if overlap is not None and overlap.eligible:
        return "backward"
    tied_across_stages = bool(getattr(module, "needs_tied_grad_sync", False))  # needs the full dp sum first
    if zero1 and mesh.dp.size > 1 and not tied_across_stages and not exchanges:
        return "optimizer"
    return "engine"


@dataclass
class CheckpointParts:
    """What a rank adds to a checkpoint for the replicas (``state.checkpoint.save_checkpoint``'s arguments)."""

    write: bool = True  # replica 0's ranks write the weights; the others hold the same ones
    inner_file: str | None = None  # local SGD: this replica's own inner optimizer state (replicas > 0)
    inner_files: list[str] = field(default_factory=list)  # every such file (rank 0 lists them)
    outer_momentum: dict[str, torch.Tensor] | None = None  # local SGD's outer momentum, beside the weights
    wire: tuple[str, int, dict[str, torch.Tensor]] | None = None  # this speaker's fp8 residuals: (file, replica, by name)
    wire_files: list[str] = field(default_factory=list)  # every speaker's residual file


class ReplicaSet:
    """This rank's replica and its part of every cross-replica step (see the module doc). Built on every rank."""

    def __init__(self, replicas: ReplicatedPlan, rank: int, say: Callable[[str], None] | None = None) -> None:
        """``say``: where this rank tells a person what the replicas decided (the writer's stderr; None: silent)."""
        self.replicas, self.rank, self.say = replicas, rank, say
        self.index = replicas.replica_of(rank)
        self.exchange: ReplicaExchange | None = None
        self.local_sgd: LocalSGD | None = None
        self.overlap: BackwardOverlap | None = None
        self.shares = _share_tracker(replicas)
        self.sync_s = 0.0  # the last step's cross-replica exchange, seconds
        self.weight = 1.0  # this replica's share of the current step's counted tokens
        self.rebalanced: list[int] | None = None  # rows a rebalance just set (the next step's record says so)
        self._during = False  # the current step's exchange runs during the backward
        self._own_began = 0.0
        self._own_s: float | None = None

    # --- what this rank trains ------------------------------------------------------------------------------
    @property
    def plan(self) -> ParallelPlan:
        """This rank's replica's plan (its rows in force: a rebalance changes its micro-batches)."""
        return self.replicas.replicas[self.index].plan

    @property
    def topology(self) -> Topology:
        return self.replicas.replicas[self.index].topology()

    @property
    def first_stage(self) -> int:
        """Where this replica's stages begin in the run's list of every replica's stages."""
        return self.replicas.first_stage(self.index)

    @property
    def exchanges(self) -> bool:
        """Something crosses islands: more than one replica."""
        return self.replicas.several

    @property
    def copies(self) -> int:
        """How many replicas hold each (synced, alike) gradient when the global norm is taken: 1 without an exchange."""
        return len(self.replicas.replicas) if self.exchange is not None else 1

    @property
    def tokens_per_step(self) -> int:
        """Rows of a step over every replica (times the sequence: tokens)."""
        return self.replicas.global_batch

    # --- setup, collective over the world ------------------------------------------------------------------
    def resolve_rows(self, measure: Callable[[], float], speaks: bool) -> list[int]:
        """``rows: auto`` replicas' rows from measured speed (``shares.resolve_shares``, said by ``say``); every
        replica's rows. ``measure``: this replica's rows a second (run on the ranks of auto replicas)."""
        if not self.replicas.resolved:
            self.replicas = resolve_shares(self.replicas, self.index, measure, speaks, self.say)
        return [int(r.rows or 0) for r in self.replicas.replicas]

    def connect(self, mesh: Mesh, engine: PipelineEngine, world: World) -> DpGradSum:
        """Build the exchange (every step), local SGD (every H > 1 steps) and the overlap (``replica_sync.overlap``)
        beside ``mesh``; returns who sums the dp gradients (``dp_grad_sum``), for the engine and the optimizer."""
        if self.exchanges:
            sync, topologies = self.replicas.sync, self.replicas.topologies()
            self.exchange = ReplicaExchange(mesh, engine.module, self.index, topologies, world, compress=sync.compress)
            if sync.every > 1:
                self.local_sgd = LocalSGD(self.exchange, sync.every, sync.outer_lr, sync.outer_momentum)
            elif sync.overlap == "on":
                self.overlap = BackwardOverlap(self.exchange, engine, topologies, sync.overlap)
        return dp_grad_sum(mesh, engine.module, self.plan.zero1, self.exchanges, self.overlap)

    def optimizer_source(self) -> int:
        """The replica whose optimizer state this rank resumes from: under local SGD its own replica's (each steps its
        inner optimizer on its own gradients); otherwise replica 0's — replicas that sync every step hold one state,
        whatever a local SGD checkpoint kept for each."""
        return self.index if self.local_sgd is not None else 0

    def resume(self, checkpoint: Any, meta: dict[str, Any]) -> None:
        """After the weights were loaded: local SGD anchors there with the saved outer momentum, and the fp8 wire takes
        its residuals back; whatever of the checkpoint's replica state this run's sync mode does not use is said."""
        from hal.parallel.state.checkpoint import inner_replicas, read_outer_momentum, read_wire_residuals

        own = inner_replicas(meta)  # a local SGD checkpoint (it alone keeps replicas' own states, and a momentum)
        if self.local_sgd is None:
            if own:
                self._tell("the checkpoint's local SGD state (each replica's own inner optimizer state, the outer "
                           "momentum) is not used: this run " + ("syncs every step" if self.exchanges else "is one replica")
                           + ", so every replica resumes from replica 0's optimizer state")
        else:  # the stage files are read for the momentum only where this run has one
            velocity = read_outer_momentum(checkpoint, meta) if self.local_sgd.momentum else None
            sync = (meta.get("replicas") or {}).get("replica_sync") or {}
            kept = velocity is not None if self.local_sgd.momentum else bool(own and sync.get("outer_momentum"))
            self._tell_local_sgd_gaps(own, kept)
            self.local_sgd.resume(velocity)
        residuals = read_wire_residuals(checkpoint, meta)
        if residuals:
            self._resume_wire(residuals)

    def _tell_local_sgd_gaps(self, own: list[int], kept_momentum: bool) -> None:
        """What a local SGD run resumes without: replicas whose own inner state the checkpoint lacks, the momentum."""
        assert self.local_sgd is not None
        lacking = [i for i in range(1, len(self.replicas.replicas)) if i not in own]
        if lacking:
            why = "it was not a local SGD run" if not own else f"its run's replicas were 0-{max(own)}"
            self._tell(f"replica(s) {lacking} resume from replica 0's inner optimizer state: the checkpoint keeps none of "
                       f"their own ({why})")
        if self.local_sgd.momentum and not kept_momentum:
            self._tell("the checkpoint holds no local SGD outer momentum (it was not a local SGD run with momentum): the "
                       "momentum starts at zero")
        if kept_momentum and not self.local_sgd.momentum:
            self._tell("the checkpoint's local SGD outer momentum is not used: replica_sync.outer_momentum is 0")

    def _resume_wire(self, kept: dict[int, dict[str, torch.Tensor]]) -> None:
        """The fp8 wire's residuals from the checkpoint into this speaker (matched by parameter name), or a line saying
        why they are not used: a resumed fp8 run then carries the error feedback the uninterrupted run would."""
        fp8 = self.exchange is not None and self.exchange.fp8 is not None
        if not fp8 or self.index not in kept:
            why = ("this run's cross-replica wire is not fp8" if not fp8 else
                   f"the checkpoint's run had replicas {sorted(kept)}, not this run's replica {self.index}")
            self._tell(f"the checkpoint's fp8 wire residuals are not used: {why}")
            return
        assert self.exchange is not None
        missing = self.exchange.load_residuals(kept[self.index])
        if missing:  # every speaker says its own: the parameters differ by rank
            print(f"hal train: warning: the checkpoint keeps no fp8 wire residual for {len(missing)} parameter(s) of "
                  f"replica {self.index} (e.g. {missing[0]}): their buckets start without error feedback",
                  file=sys.stderr, flush=True)

    # --- one step ------------------------------------------------------------------------------------------
    def batch(self, train: TrainConfig, step: int, seq: int, vocab: int) -> torch.Tensor:
        """This replica's rows of step ``step`` as (micro_batches, micro_batch_size, seq + 1): its part of the step's
        rows over every replica (the same data as one plan of that many rows); sets its token ``weight``."""
        rows = global_batch(train.data, train.seed, step, 1, self.replicas.global_batch, seq, vocab,
                            validation=train.validation)[0]
        ranges = self.replicas.row_ranges()
        mine = ranges[self.index]
        self.weight = token_weights(rows, ranges)[self.index] if self.exchanges else 1.0
        plan = self.plan
        return rows[mine.start:mine.stop].reshape(plan.micro_batches, plan.micro_batch_size, seq + 1)

    def before_backward(self) -> None:
        """Before the step's forward/backward: its own time starts, and the overlap's hooks are armed."""
        self._own_began = time.perf_counter()
        self._during = self.overlap is not None and self.overlap.eligible
        if self._during:
            assert self.overlap is not None
            self.overlap.begin(self.weight)  # buckets start from the gradient hooks as the backward finishes them

    def after_backward(self, engine: PipelineEngine, loss: float | None) -> float | None:
        """After the forward/backward: the exchange (what is left of it after an overlapped backward, or all of it;
        none under local SGD), and the step's loss over every replica (one replica: its own)."""
        self._own_s = None
        if self.shares is not None:  # this rank's own time of the step, before it waits for the other replicas
            engine.backend.synchronize()
            self._own_s = time.perf_counter() - self._own_began
        self.sync_s = 0.0
        if self.exchange is None:
            return loss
        began = time.perf_counter()
        if self._during:
            assert self.overlap is not None
            self.overlap.finish()  # what is left of the exchange after the backward: the part the step waits for
        elif self.local_sgd is None:
            self.exchange.sync_grads(self.weight)  # every replica's gradient becomes the step's token-weighted mean
        summed = self.exchange.step_loss(loss, self.weight)
        self.sync_s = time.perf_counter() - began
        return summed

    def after_optimizer(self, steps_done: int) -> None:
        """After the optimizer step: local SGD's outer step every H steps."""
        if self.local_sgd is not None:
            began = time.perf_counter()
            self.local_sgd.after_step(steps_done, self.weight)
            self.sync_s += time.perf_counter() - began

    def timing(self, step_s: float) -> list[float]:
        """This rank's replica fields of the step's timing row (``observe.records.TIME_FIELDS``): the exchange's
        seconds, the bytes it sent across islands, the buckets begun during the backward (NaN: none overlaps)."""
        if self.shares is not None and self._own_s is not None:
            self.shares.record(self._own_s, step_s)
        sent = 0.0
        if self.exchange is not None:
            sent = float(self.local_sgd.bytes_sent if self.local_sgd is not None else self.exchange.bytes_sent)
        early = float(self.overlap.early) if self._during and self.overlap is not None else float("nan")
        return [self.sync_s, sent, early]

    def rebalance(self, done: int, steps: int, engine: PipelineEngine) -> None:
        """When due, the collective look at the replicas' measured times; a change is applied to the engine, said, and
        kept in ``rebalanced`` for the next step's record."""
        self.rebalanced = None
        if self.shares is None or not self.shares.due(done, steps):
            return
        before = self.replicas
        after, note = self.shares.look(before, self.index)
        if note is not None:
            self._tell(f"warning: {note}")
        if after is None:
            return
        self.replicas = after
        engine.set_micro_batches(self.plan.micro_batches)
        self._tell(rebalance_text(before, after, done))
        self.rebalanced = [int(r.rows or 0) for r in after.replicas]

    # --- the checkpoint -------------------------------------------------------------------------------------
    def checkpoint_parts(self, stage: int) -> CheckpointParts:
        """Replicas hold the same weights at a checkpoint (every step, or a meeting of local SGD): replica 0 writes;
        under local SGD the others add their own inner optimizer states, and the outer momentum goes beside the
        weights; an fp8 wire's speakers add what their sends rounded away. ``stage``: this rank's stage."""
        from hal.parallel.state.checkpoint import inner_file_name

        parts = CheckpointParts(write=self.index == 0)
        if self.local_sgd is not None:
            parts.inner_files = [inner_file_name(i, k) for i, rep in enumerate(self.replicas.replicas) if i > 0
                                 for k in range(rep.plan.num_stages)]
            parts.inner_file = inner_file_name(self.index, stage) if self.index > 0 else None
            parts.outer_momentum = self.local_sgd.velocity if self.local_sgd.momentum else None
        if self.exchange is not None and self.exchange.fp8 is not None:  # carried over a restart
            parts.wire_files = self.exchange.residual_files()
            file = self.exchange.residual_file()
            parts.wire = None if file is None else (file, self.index, self.exchange.residuals_by_name())
        return parts

    def checkpoint_meta(self) -> dict[str, Any]:
        """The checkpoint's record of the plan: replica 0's (whose ranks wrote the files), and every replica's where
        there are several."""
        meta: dict[str, Any] = {"plan": self.replicas.replicas[0].plan.to_dict()}
        if self.replicas.several:
            meta["replicas"] = self.replicas.to_dict()
        return meta

    def _tell(self, text: str) -> None:
        if self.say is not None:
            self.say(text)


def _share_tracker(replicas: ReplicatedPlan) -> ShareTracker | None:
    """With ``rows: auto`` replicas and ``replica_sync.rebalance_every`` > 0: the mid-run rebalance, else None."""
    if replicas.sync.rebalance_every == 0 or replicas.resolved:
        return None
    movable = [r.rows is None for r in replicas.replicas]
    return ShareTracker(movable, replicas.sync.rebalance_every) if sum(movable) >= 2 else None


__all__ = ["CheckpointParts", "DpGradSum", "ReplicaSet", "dp_grad_sum"]
