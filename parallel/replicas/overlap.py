"""The replicas' gradient exchange run during the backward pass, not after it (``replica_sync.overlap: on``).

Why: across a slow bridge the exchange can take a third of a step (measured on H200s: docs/replicas.md). A
parameter's gradient is final once the step's last backward through it has accumulated into ``.grad``; buckets are
taken in backward order (``ReplicaExchange.mine``), so the last layers' buckets are ready while the first layers
still compute. Each bucket then goes through two threads, bucket after bucket in the one global order:

* **inside** (the stage's ranks, its dp group: only tp-1 stages overlap) — a reduce of the bucket's flat gradients
  to its speaker, and later the speaker's broadcast of the sum back, every rank writing it into ``.grad``. The calls
  go in one fixed order whatever the timing: reduce 0, reduce 1, hand-back 0, reduce 2, hand-back 1, ...
* **across** — the speaker scales by its replica's token share and sums over the other replicas' speakers
  (``ReplicaExchange.bridge_sum``: the wire as set, fp8 included).

So while one rank's speaker bridges a bucket, another rank's speaker can bridge the next. A rank's stage overlaps
when its gradients are its own (tp 1, no expert shards, no ZeRO-1, no tied copy on another stage, a schedule whose
backward is not split into I and W: the split's W adds to ``.grad`` by hand, which no hook sees); other stages — and
any bucket whose parameters never reported — take the exchange after the backward, in the same order, so mixed
replicas still pair up. The result is the exchange's after the backward, up to the order of the dp sum's additions.

Cpu stages, and accelerator stages of one rank (no CCL call from the threads: only the bridge): on H200s a stage of
two GPU ranks (NCCL reduce and hand-back from the inside thread) did not finish a step in any of five runs, while
one-rank GPU stages ran (2 x H200, a rank on cuda:1: once each thread starts on the rank's device;
docs/replicas.md). On cpu ranks it is exact (tested) but its threads take cores the backward computes on, so it pays
only where the bridge, not the cores, is the bottleneck.
"""
from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any, Sequence

import torch

from hal.parallel.models.layers import expert_shard

if TYPE_CHECKING:
    from hal.collectives.communicator import Communicator
    from hal.parallel.pipeline.engine import PipelineEngine
    from hal.parallel.replicas.sync import Bucket, ReplicaExchange

_DONE = object()


def overlappable(engine: "PipelineEngine", mode: str = "on") -> str | None:
    """None when this rank's stage runs the exchange during its backward, else why not. ``mode``: the config's
    ``replica_sync.overlap`` (on: every cpu stage that can; off: none)."""
    if mode == "off":
        return "replica_sync.overlap is off"
    if engine.device.type != "cpu" and engine.layout.dp * engine.layout.tp > 1:  # the config refuses it first
        return ("an accelerator stage of several ranks (its reduce and hand-back from the exchange threads did not "
                "finish a step on H200s in testing: docs/replicas.md)")
    if engine.layout.tp > 1:
        return "tp > 1 (full gradients are gathered over tp after the backward)"
    if engine.layout.ep > 1 or any(expert_shard(p) for p in engine.module.parameters()):
        return "experts (some receive no tokens in a step: their gradients are filled after the backward)"
    if not engine.reduce_dp_grads:
        return "ZeRO-1 (the optimizer reduce-scatters the gradients)"
    if engine.module.needs_tied_grad_sync:
        return "a tied embedding on two stages"
    if engine.schedule.splits_backward:
        return f"schedule {engine.schedule.name} splits the backward (its W halves add to .grad by hand)"
    return None


class BackwardOverlap:
    """This rank's exchange of one step, started by gradient hooks (see the module doc). Built collectively."""

    def __init__(self, exchange: "ReplicaExchange", engine: "PipelineEngine", replicas: Sequence[Any],
                 mode: str = "on") -> None:
        """``replicas``: every replica's Topology, in replica order (as ``ReplicaExchange`` takes them). Every rank of
        the world builds it together: each stage that overlaps gets a group of its own (the reduce and hand-back),
        made on every rank, as torch's rule for new groups asks."""
        import torch.distributed as dist

        from hal.collectives.communicator import Communicator
        from hal.collectives.process_groups import make_layout

        self.exchange, self.engine = exchange, engine
        world = exchange.world
        self.why_not = overlappable(engine, mode)
        everyone: list[Any] = [None] * world.size
        dist.all_gather_object(everyone, self.why_not is None)  # the default group: gloo on every rank
        self.eligible = self.why_not is None
        self._group: "Communicator | None" = None  # the stage's ranks (its dp group), for the reduce and hand-back
        for topology in replicas:  # every rank walks the same stages in the same order
            for stage in topology.stages:
                ranks = list(stage.ranks)
                if len(ranks) < 2 or not all(everyone[r] for r in ranks):
                    continue
                layout = make_layout(world, ranks)  # on every rank: torch's new_group rule
                if world.rank in ranks:
                    self._group = Communicator(layout, world, validate=False)
        if self.eligible:
            engine.grads_summed_elsewhere = True  # the dp sum is the reduce below, bucket by bucket
        self.params = dict(engine.module.named_parameters())
        self.mine: list["Bucket"] = list(exchange.mine) if self.eligible else []
        self._names = [[n for n in b.names if n in self.params] for b in self.mine]
        self._names_of = {id(p): n for n, p in self.params.items()}
        self._lock = threading.Lock()
        self._armed = False
        self.early = 0  # buckets started from the hooks in the last step (before the backward ended)
        if self.eligible:
            for p in self.params.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._accumulated)

    # --- one step -------------------------------------------------------------------------------------------
    def begin(self, weight: float) -> None:
        """Arm the hooks for a step of ``engine.micro_batches`` backwards per parameter; start the threads."""
        if not self.eligible:
            return
        self.weight = weight
        self._expected = self.engine.micro_batches
        self._counts: dict[int, int] = {}
        self._ready: set[str] = set()
        self._next = 0
        self.early = 0
        self.exchange.bytes_sent = 0
        self._error: BaseException | None = None
        self._queues: list["queue.Queue[Any]"] = [queue.Queue(), queue.Queue()]
        self._bridged: dict[int, threading.Event] = {}
        self._threads = [threading.Thread(target=self._on_this_device, args=(body,), daemon=True, name=f"hal-replica-{name}")
                         for name, body in (("inside", self._inside), ("across", self._across))]
        for t in self._threads:
            t.start()
        self._armed = True

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        with self._lock:
            key = id(param)
            self._counts[key] = self._counts.get(key, 0) + 1
            if self._counts[key] == self._expected:
                self._ready.add(self._names_of[key])
                self._release(early=True)

    def _release(self, early: bool) -> None:
        """Queue every bucket, in order, whose parameters are all final (``early``: from a hook); under the lock."""
        while self._next < len(self.mine) and (not early or all(n in self._ready for n in self._names[self._next])):
            self._queues[0].put(self._next)
            self._next += 1
            self.early += early

    def finish(self) -> None:
        """After the backward: queue what the hooks did not, wait for every bucket to be summed and written back."""
        if not self.eligible:
            return
        with self._lock:
            self._armed = False
            self._release(early=False)
            self._queues[0].put(_DONE)
        for t in self._threads:
            t.join()
        if self._error is not None:
            raise self._error

    # --- the two threads ------------------------------------------------------------------------------------
    def _on_this_device(self, body: Any) -> None:
        """A new thread starts on device 0 (and its default stream): put it on this rank's device first, or its
        allocations, events and collectives of a rank on device k > 0 land on device 0."""
        device = self.engine.device
        if device.type != "cpu" and device.index is not None:
            self.engine.backend.set_device(device.index)
        body()

    def _inside(self) -> None:
        """The stage's CCL calls, in one order on every rank of it whatever the timing: reduce(0), reduce(1),
        hand-back(0), reduce(2), hand-back(1), ... (CCL calls of one device issued in different orders on different
        ranks may deadlock); the hand-back of a bucket waits for its bridge sum (the other thread)."""
        pending = None
        while True:
            item = self._queues[0].get()
            if item is not _DONE and self._error is None:
                try:
                    flat = self._sum_inside(item)
                    self._bridged[item] = threading.Event()
                    self._queues[1].put((item, flat))
                except BaseException as exc:  # handed to finish()
                    self._error = self._error or exc
            if pending is not None:
                self._hand_back_when_bridged(*pending)
            pending = (item, flat) if item is not _DONE and self._error is None else None
            if item is _DONE:
                self._queues[1].put(_DONE)
                return

    def _hand_back_when_bridged(self, index: int, flat: torch.Tensor) -> None:
        self._bridged[index].wait()
        if self._error is not None:
            return
        try:
            self._hand_back(index, flat)
        except BaseException as exc:
            self._error = self._error or exc

    def _across(self) -> None:
        """The bridge sums, bucket after bucket (this rank's speaker buckets only do anything)."""
        while True:
            item = self._queues[1].get()
            if item is _DONE:
                return
            index, flat = item
            try:
                if self._error is None:
                    self._cross(index, flat)
            except BaseException as exc:
                self._error = self._error or exc
            finally:
                self._bridged[index].set()

    def _speaker(self, index: int) -> int:
        return self.mine[index].speakers[self.exchange.replica]

    def _sum_inside(self, index: int) -> torch.Tensor:
        bucket = self.mine[index]
        flat = bucket.pack({n: self.params[n].grad for n in bucket.names}, self.engine.device)
        if self._group is not None:
            self._group.reduce(flat, self._speaker(index), "sum")
        return flat

    def _cross(self, index: int, flat: torch.Tensor) -> None:
        if self.exchange.world.rank == self._speaker(index):
            flat.mul_(self.weight)
            self.exchange.bridge_sum(self.mine[index], flat)

    def _hand_back(self, index: int, flat: torch.Tensor) -> None:
        if self._group is not None:
            self._group.broadcast(flat, self._speaker(index))
        for name, part in self.mine[index].parts(flat):
            p = self.params[name]
            if p.grad is None:
                p.grad = part.view(p.shape).to(p.dtype, copy=True)
            else:
                p.grad.copy_(part.view(p.shape))
