"""One background thread that runs a communicator's bridged point-to-point calls in the order they were posted.

Why: a bridged transfer (across islands, through host memory over gloo) completes inside the call — a receive
waits for its peer's send, a send for its peer's receive — so a pipeline stage that posts a receive for data it
needs later would stop there, and stages would move in lockstep however well their order was planned. Run on
this thread, the call returns a handle at once and the stage computes on; the one thread keeps the calls in
posting order, which is what the two ends of a link agree on. The thread is a daemon: a rank that fails does not
hang at exit behind a transfer whose peer is gone (that transfer's own timeout ends it).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class SerialWorker:
    """Runs submitted callables one after another on one daemon thread; ``submit`` returns their Future."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((job, future))
        return future

    def close(self) -> None:
        """Let the thread end after the jobs already submitted."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
