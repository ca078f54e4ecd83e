"""Two micro-batches at once on one stage: a forward on a second thread while the rank's own runs a backward.

DualPipeV pairs, in its steady state, a forward of one chunk with a backward of the other (``schedules.action.Overlap``).
The two share nothing but the weights — one reads them, the other adds to their gradients — so they can run at the
same time. What that saves is host time: where a stage's host sets the pace (an accelerator at small micro-batches,
each op's launch costing more than its kernel), the backward's enqueueing, most of it C++ inside autograd's engine
and outside Python's lock, runs beside the forward's Python. The boundary transfers already run on their own streams.

Both threads enqueue on the rank's one compute stream. A second stream would let the kernels overlap as well, but
a tensor made on one stream and freed on the other must be announced to the allocator (``record_stream``) or its
memory is handed out again while still in use; autograd frees its saved tensors where nobody can announce them.

Where the pair cannot run at once it runs one after the other, and ``why_not`` says why: collectives inside a
stage's compute (tensor, sequence or expert parallelism, an MoE balancing sum over dp replicas) would reach the
communicator from two threads in an order that differs between its ranks, which deadlocks or mixes up tensors.
A compiled stage runs them in turn too: its layers' graphs are called from Python on both sides (the backward's too), so
the two threads mostly take turns holding the interpreter's lock (1 x H200, 6 layers of the 1.21B model at 1 row:
0.88-1.16x at once over four machines, median 0.93x, against 1.04-1.21x eager; ``benchmarks/pair_overlap.py``).
``HAL_PAIR_OVERLAP=1`` runs them at once there anyway, ``0`` runs every pair in turn. A cpu stage runs its pairs at
once: a small one is host-bound as an accelerator's is (4 layers of hidden 64 on this project's 2-core CI host: 1.67x).
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import TYPE_CHECKING, Callable, TypeVar

from hal.errors import ConfigError

if TYPE_CHECKING:  # names only: importing this stays light (the parent ``hal train`` describes its job with it)
    import torch

    from hal.backend import Backend
    from hal.parallel.config.plan import ParallelPlan
    from hal.parallel.config.topology import StageMesh

A = TypeVar("A")
B = TypeVar("B")

ENV = "HAL_PAIR_OVERLAP"  # 0: every pair in turn; 1: at once on every stage that can; unset: not on compiled stages


def why_not(tp: int, ep: int, balances_over_dp: bool, compiled: bool) -> str | None:
    """Why a stage runs its pairs one after the other (with the fix where there is one), or None where at once."""
    setting = os.environ.get(ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ConfigError(f"{ENV}={setting!r}: use 0 (every pair in turn), 1 (at once wherever a stage can) or leave "
                          "it unset (at once but on compiled stages)")
    if setting == "0":
        return f"{ENV}=0"
    if tp > 1 or ep > 1 or balances_over_dp:
        what = "tensor parallelism" if tp > 1 else "expert parallelism" if ep > 1 else "the MoE balancing sum over dp"
        return (f"{what}: collectives inside the stage's compute, which two threads would issue in different orders "
                "on its ranks")
    if compiled and setting != "1":
        return (f"compiled layers: both threads call their graphs from Python and take turns holding its lock, which "
                f"measured slower at once on most machines ({ENV}=1 runs them at once anyway)")
    return None


def stage_pairs(plan: "ParallelPlan", stage: "StageMesh", is_moe: bool) -> str | None:
    """How ``stage`` of ``plan`` runs its schedule's pairs, as its engine decides (``why_not``): "at once", or "in
    turn: " and why; None where the schedule pairs nothing there. What ``hal train`` says at its start and in its
    summary."""
    if not plan.schedule.pairs(plan.num_stages, plan.micro_batches, stage.index):
        return None
    why = why_not(stage.tp, stage.ep, is_moe and stage.dp > 1, stage.compile)
    return "at once" if why is None else f"in turn: {why}"


def in_brief(how: str) -> str:
    """``stage_pairs``'s answer in a few words, for a line or a table: "at once", or "in turn (its reason's name)"."""
    return how if how == "at once" else f"in turn ({how.split(': ')[1]})"


class PairRunner:
    """A worker thread on the rank's device: ``run(forward, backward)`` runs ``forward`` there and ``backward`` here."""

    def __init__(self, backend: "Backend", device: "torch.device") -> None:
        self.backend, self.device = backend, device
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.ran = 0  # pairs run at once since the engine was built

    def _start(self) -> concurrent.futures.ThreadPoolExecutor:
        def on_device() -> None:  # a new thread starts on device 0: put it on this rank's first
            if self.device.type != "cpu" and self.device.index is not None:
                self.backend.set_device(self.device.index)

        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hal-pair", initializer=on_device)

    def run(self, forward: Callable[[], A], backward: Callable[[], B]) -> tuple[A, B]:
        """Both results. The forward enqueues on this thread's current stream; an error in either is raised once
        both have finished (nothing of the pair is left running)."""
        if self._pool is None:
            self._pool = self._start()
        stream = self.backend.current_stream()

        def there() -> A:
            with self.backend.stream(stream):
                return forward()

        future = self._pool.submit(there)
        try:
            done = backward()
        except BaseException:
            concurrent.futures.wait([future])
            raise
        result = future.result()
        self.ran += 1
        return result, done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["ENV", "PairRunner", "in_brief", "stage_pairs", "why_not"]
