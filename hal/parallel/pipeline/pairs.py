"""Two micro-batches at once on one stage: a forward on a second thread while the rank's own runs a backward.

DualPipeV pairs, in its steady state, a forward of one chunk with a backward of the other (``schedules.action.Overlap``).
The two share nothing but the weights — one reads them, the other adds to their gradients — so they can run at the
same time. What that saves is host time: where a stage's host sets the pace (an accelerator at small micro-batches,
each op's launch costing more than its kernel), the backward's enqueueing, most of it C++ inside autograd's engine
and outside Python's lock, runs beside the forward's Python. The boundary transfers already run on their own streams.

Both threads enqueue on the rank's one compute stream. A second stream would let the kernels overlap as well, but
a tensor made on one stream and freed on the other must be announced to the allocator (``record_stream``) or its
memory is handed out again while still in use; autograd frees its saved tensors where nobody can announce them.
Where a stage runs its pairs in turn instead, and why, is ``hal.parallel.schedules.pairs``.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable, TypeVar

import torch

from hal.backend import Backend

A = TypeVar("A")
B = TypeVar("B")

class PairRunner:
    """A worker thread on the rank's device: ``run(forward, backward)`` runs ``forward`` there and ``backward`` here."""

    def __init__(self, backend: Backend, device: torch.device) -> None:
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


__all__ = ["PairRunner"]
