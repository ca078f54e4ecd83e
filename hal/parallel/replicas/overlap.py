"""The replicas' gradient exchange run during the backward pass, not after it (``replica_sync.overlap: on``).

Why: across a slow bridge the exchange can take a third of a step (measured on H200s: docs/replicas.md). A
parameter's gradient is final once the step's last backward through it has accumulated into ``.grad``; buckets are
taken in backward order (``ReplicaExchange.mine``), so the last layers' buckets are ready while the first layers
still compute. Each bucket then goes in three parts, bucket after bucket in the one global order:

* **reduce inside** (the stage's ranks, its dp group: only tp-1 stages overlap): launched asynchronously by the
  gradient hook that completes the bucket, on the thread running the backward — as DDP's reducer does — so every
  CCL call of a rank comes from the thread that runs its other CCL calls, in one order on every rank;
* **across** (one worker thread, on a stream of its own): the speaker waits for its reduce, scales by its replica's
  token share and sums over the other replicas' speakers (``ReplicaExchange.bridge_sum``: the wire as set, fp8
  included) — host-staged copies and the bridge's own groups, no call on the stage's group;
* **hand back inside**: after the backward, the engine's thread broadcasts each bucket's sum from its speaker in
  the same order, every rank writing it into ``.grad``.

Before the first step the stage's group makes its first call and each speaker sums one empty bucket over the bridge,
so no communicator starts and no page-locked staging buffer is allocated while a CCL kernel is waiting on a peer
(either synchronizes the device: the suspects, with CCL calls from two threads, of the first design — the reduce
and hand-back from a worker thread — which stopped on two-GPU stages on H200s: docs/replicas.md).

A rank's stage overlaps when its gradients are its own (tp 1, no expert shards, no tied copy on another
stage, a schedule whose backward is not split into I and W: the split's W adds to ``.grad`` by hand, which no hook
sees); other stages — and any bucket whose parameters never reported — take the exchange after the backward, in the
same order, so mixed replicas still pair up. The result is the exchange's after the backward, up to the order of the
dp sum's additions. On cpu ranks the worker thread takes cores the backward computes on, so it pays only where the
bridge, not the cores, is the bottleneck.
"""
from __future__ import annotations

import contextlib
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


def overlappable(engine: PipelineEngine, mode: str = "on") -> str | None:
    """None when this rank's stage runs the exchange during its backward, else why not. ``mode``: the config's
    ``replica_sync.overlap`` (on: every stage that can; off: none)."""
    if mode == "off":
        return "replica_sync.overlap is off"
    if engine.layout.tp > 1:
        return "tp > 1 (full gradients are gathered over tp after the backward)"
    if engine.layout.ep > 1 or any(expert_shard(p) for p in engine.module.parameters()):
        return "experts (some receive no tokens in a step: their gradients are filled after the backward)"
    if engine.module.needs_tied_grad_sync:
        return "a tied embedding on two stages"
    if engine.schedule.splits_backward:
        return f"schedule {engine.schedule.name} splits the backward (its W halves add to .grad by hand)"
    return None


class BackwardOverlap:
    """This rank's exchange of one step, started by gradient hooks (see the module doc). Built collectively."""

    def __init__(self, exchange: ReplicaExchange, engine: PipelineEngine, replicas: Sequence[Any],
                 mode: str = "on") -> None:
        """``replicas``: every replica's Topology, in replica order (as ``ReplicaExchange`` takes them). Every rank of
        the world builds it together: each stage that overlaps gets a group of its own (the reduce and hand-back),
        made on every rank, as torch's rule for new groups asks; then the groups and the bridge are warmed up."""
        import torch.distributed as dist

        from hal.parallel.pipeline.mesh import make_groups

        self.exchange, self.engine = exchange, engine
        world = exchange.world
        self.why_not = overlappable(engine, mode)
        everyone: list[Any] = [None] * world.size
        dist.all_gather_object(everyone, self.why_not is None)  # the default group: gloo on every rank
        self.eligible = self.why_not is None
        self._group: Communicator | None = None  # the stage's ranks (its dp group), for the reduce and hand-back
        stages = [list(stage.ranks) for topology in replicas for stage in topology.stages  # the same order everywhere
                  if len(stage.ranks) > 1 and all(everyone[r] for r in stage.ranks)]
        for group in make_groups(world, stages, validate=False).values():  # a second group beside the mesh's: its own stream
            if group is not None:
                self._group = group
        if self._group is not None:  # the group's communicator starts now, not under a waiting kernel (module doc)
            self._group.all_reduce(torch.zeros(1, device=engine.device))
        if any(everyone):
            exchange.warm_up()  # every rank, in the one order: the bridge's staging buffers exist before a step
        self.params = dict(engine.module.named_parameters())
        self.mine: list[Bucket] = list(exchange.mine) if self.eligible else []
        self._names = [[n for n in b.names if n in self.params] for b in self.mine]
        self._names_of = {id(p): n for n, p in self.params.items()}
        self._lock = threading.Lock()
        self._armed = False
        self._stream: Any = None  # the worker's own stream (made on its first step)
        self.early = 0  # buckets started from the hooks in the last step (before the backward ended)
        if self.eligible:
            for p in self.params.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._accumulated)

    # --- one step -------------------------------------------------------------------------------------------
    def begin(self, weight: float) -> None:
        """Arm the hooks for a step of ``engine.micro_batches`` backwards per parameter; start the worker."""
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
        self._queue: queue.Queue[Any] = queue.Queue()
        self._flats: list[torch.Tensor] = []
        self._reduces: list[Any] = []  # per bucket: its reduce's handle (None: a stage of one rank)
        self._bridged: list[threading.Event] = []
        self._summed: list[Any] = []  # per bucket: an event on the worker's stream after its sum (None: nothing to wait)
        self._worker = threading.Thread(target=self._across, daemon=True, name="hal-replica-across")
        self._worker.start()
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
        """Start every bucket, in order, whose parameters are all final (``early``: from a hook); under the lock.
        Starting one: pack its gradients, launch the reduce to its speaker, hand it to the worker."""
        while self._next < len(self.mine) and (not early or all(n in self._ready for n in self._names[self._next])):
            index = self._next
            bucket = self.mine[index]
            flat = bucket.pack({n: self.params[n].grad for n in bucket.names}, self.engine.device)
            packed = None  # the pack's end on this thread's stream: the worker's stream waits for it (no reduce may)
            if self.engine.device.type != "cpu":
                packed = self.engine.backend.Event()
                packed.record(self.engine.backend.current_stream())
            reduced = self._group.reduce(flat, self._speaker(index), "sum", async_op=True) if self._group else None
            self._flats.append(flat)
            self._reduces.append(reduced)
            self._bridged.append(threading.Event())
            self._summed.append(None)
            self._queue.put((index, packed, reduced))
            self._next += 1
            self.early += early

    def finish(self) -> None:
        """After the backward: start what the hooks did not; hand each bucket's sum back, in order, once bridged."""
        if not self.eligible:
            return
        with self._lock:
            self._armed = False
            self._release(early=False)
        self._queue.put(_DONE)
        try:
            for index in range(len(self.mine)):
                self._bridged[index].wait()
                if self._error is not None:
                    break
                if self._reduces[index] is not None:  # a listener's buffer is read by its reduce: let it end first
                    self._reduces[index].wait()
                if self._summed[index] is not None:  # the sum was written on the worker's stream
                    self._summed[index].wait(self.engine.backend.current_stream())
                self._hand_back(index, self._flats[index])
        finally:
            self._queue.put(_DONE)  # a worker still waiting ends (a second DONE is harmless)
            self._worker.join()
            self._flats, self._reduces = [], []
        if self._error is not None:
            raise self._error

    # --- the worker -----------------------------------------------------------------------------------------
    def _across(self) -> None:
        """The bridge sums, bucket after bucket (this rank's speaker buckets only do anything), on the rank's device
        and a stream of the worker's own: a new thread starts on device 0 and the default stream, and what it waits
        for (the reduce) must hold back only its own work, not the backward's."""
        backend, device = self.engine.backend, self.engine.device
        if device.type != "cpu" and device.index is not None:
            backend.set_device(device.index)
        if device.type != "cpu" and self._stream is None:
            self._stream = backend.Stream()
        with backend.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            while True:
                item = self._queue.get()
                if item is _DONE:
                    return
                index, packed, reduced = item
                try:
                    if self._error is None:
                        self._summed[index] = self._cross(index, packed, reduced)
                except BaseException as exc:  # handed to finish()
                    self._error = self._error or exc
                finally:
                    self._bridged[index].set()

    def _speaker(self, index: int) -> int:
        return self.mine[index].speakers[self.exchange.replica]

    def _cross(self, index: int, packed: Any, reduced: Any) -> Any:
        """The speaker's part of bucket ``index``: wait for its pack and reduce, sum across; returns an event after
        the sum."""
        if self.exchange.world.rank != self._speaker(index):
            return None
        if packed is not None:
            packed.wait(self._stream)  # a stage of one rank has no reduce to order the worker after the pack
        if reduced is not None:
            reduced.wait()  # on an accelerator: this stream waits for the reduce, the host does not
        flat = self._flats[index]
        flat.mul_(self.weight)
        self.exchange.bridge_sum(self.mine[index], flat)
        if self._stream is None:
            return None
        done = self.engine.backend.Event()
        done.record(self._stream)
        return done

    def _hand_back(self, index: int, flat: torch.Tensor) -> None:
        if self._group is not None:
            self._group.broadcast(flat, self._speaker(index))
        for name, part in self.mine[index].parts(flat):
            p = self.params[name]
            if p.grad is None:
                p.grad = part.view(p.shape).to(p.dtype, copy=True)
            else:
                p.grad.copy_(part.view(p.shape))
