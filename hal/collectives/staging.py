"""The staging pipeline: moves tensors between ranks over the host CCL, chunk by chunk.

Device tensors cannot go on a host (gloo) wire directly, so each is copied through host buffers
(pinned for device copies), chunked and double-buffered so the device<->host copies overlap the
network (see ``StagingPipeline``). ``collectives.bridge`` builds the cross-island collectives on it.

Knobs (read once per communicator; every rank must agree, and the bridge checks that):
``HAL_BRIDGE_CHUNK_BYTES`` — size of one staged chunk on the wire (default 16 MiB: on an H100 host,
GPU rank to CPU rank over 8 channels, 16 MiB chunks moved 64 MiB-1 GiB messages at 2.8-4.3x one
stream, 4 MiB chunks at 2.4-2.7x: every chunk costs a round of Python and a gloo rendezvous);
``HAL_BRIDGE_STAGE`` — ``auto`` (stage device tensors only) or ``always`` (stage host tensors
too, through ordinary host buffers: runs the device code path on a CPU-only machine).
``HAL_BRIDGE_CHANNELS`` (how many host connections a message is striped over) is read by
``collectives.process_groups.init_distributed``, since it decides how many groups are made.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hal.backend import Backend

from . import failures
from .validation import CollectiveError

CHUNK_ENV = "HAL_BRIDGE_CHUNK_BYTES"
STAGE_ENV = "HAL_BRIDGE_STAGE"
DEFAULT_CHUNK_BYTES = 16 << 20
STAGE_MODES = ("auto", "always")


def wait_all(works: Sequence[Any], timeout: datetime.timedelta, what: str) -> None:
    """Wait for every work item; a timeout or a lost peer is one named error (``failures``) and aborts the groups."""
    failures.wait_all(works, timeout, f"bridge {what}", ())


def chunk_bytes_from_env() -> int:
    text = os.environ.get(CHUNK_ENV, "").strip()
    if not text:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 64:
        raise CollectiveError(f"{CHUNK_ENV}={text!r}: give the chunk size in bytes, at least 64 (e.g. {DEFAULT_CHUNK_BYTES})")
    return value


def stage_mode_from_env() -> str:
    mode = os.environ.get(STAGE_ENV, "auto").strip() or "auto"
    if mode not in STAGE_MODES:
        raise CollectiveError(f"{STAGE_ENV}={mode!r}: use one of {', '.join(STAGE_MODES)}")
    return mode


# --- the chunked, double-buffered pipeline --------------------------------------------------------
@dataclass
class Lane:
    """One tensor moving through the pipeline.

    ``reads``: the wire op reads each chunk (send, all-reduce); ``writes``: it writes each chunk
    (recv, all-reduce). ``post`` starts the wire op on one host chunk and returns its work.
    """

    flat: torch.Tensor  # 1-D contiguous view of this rank's tensor, on its device
    reads: bool
    writes: bool
    post: Callable[[torch.Tensor, int], Any]  # (host chunk, chunk index) -> work
    after: Callable[[torch.Tensor], None] | None = None  # applied to each host chunk once its wire op is done
    channel: int = 0  # the host channel (gloo group) its wire ops use: lanes of one channel share a thread
    slots: list[torch.Tensor] = field(default_factory=list)  # two host staging buffers (bytes)
    staged: list[Any] = field(default_factory=lambda: [None, None])  # event: chunk copied into slot
    drained: list[Any] = field(default_factory=lambda: [None, None])  # event: slot copied back out

    def chunks(self, elems: int) -> int:
        return -(-self.flat.numel() // elems)

    def span(self, k: int, elems: int) -> tuple[int, int]:
        start = k * elems
        return start, min(start + elems, self.flat.numel())


class StagingPipeline:
    """Moves lanes chunk by chunk over the wire, overlapping device↔host copies with the network.

    Two chunks of a lane are on the wire at once, so the network never waits for the host
    between chunks. Without staging (host tensors) they go straight from and into the tensor.
    With staging every lane has two host slots (double buffering): chunk k travels from slot
    k%2; when chunk k-1 is done, its slot is refilled with chunk k+1 (device→host, one side
    stream) or drained into the tensor (host→device, another) while chunk k is still on the
    wire. Chunk k of every lane is posted in round k on every rank before chunk k-1 is awaited,
    so matched sends and receives always meet and the rounds cannot deadlock.
    """

    def __init__(self, backend: Backend, stage: bool, chunk_bytes: int, pool: list[torch.Tensor], streams: list[Any]) -> None:
        self.backend = backend
        self.stage = stage
        self.chunk_bytes = chunk_bytes
        self.pool = pool  # host staging buffers kept across calls (pinning is expensive)
        self.streams = streams  # the two copy streams, made once per bridge

    def run(self, lanes: Sequence[Lane], timeout: datetime.timedelta, what: str, ready: Any = None) -> None:
        """Move ``lanes``; ``ready``: an event the tensors' producers recorded (made here when None)."""
        lanes = [lane for lane in lanes if lane.flat.numel()]
        if not lanes:
            return
        if self.stage:
            self._prepare_staging(lanes, ready)
        previous: list[tuple[Lane, int, Any]] = []
        for k in range(max(self._chunks(lane) for lane in lanes)):
            current = [(lane, k, self._post(lane, k)) for lane in lanes if k < self._chunks(lane)]
            self._retire(previous, timeout, what)  # chunk k-1 finishes while chunk k is on the wire
            previous = current
        self._retire(previous, timeout, what)
        if self.stage:
            for lane in lanes:
                for event in lane.drained:
                    if event is not None:
                        event.synchronize()

    def _elems(self, lane: Lane) -> int:
        return max(1, self.chunk_bytes // lane.flat.element_size())

    def _chunks(self, lane: Lane) -> int:
        return lane.chunks(self._elems(lane))

    def _host_chunk(self, lane: Lane, k: int) -> torch.Tensor:
        """Where chunk k is on the host: its slot, or the tensor itself when nothing is staged."""
        if self.stage:
            return self._slot_view(lane, k)
        start, stop = lane.span(k, self._elems(lane))
        return lane.flat[start:stop]

    def _post(self, lane: Lane, k: int) -> Any:
        """Put chunk k on the wire: from the tensor itself, or from its slot once that is ready."""
        if not self.stage:
            return lane.post(self._host_chunk(lane, k), k)
        s = k % 2
        if lane.reads:
            lane.staged[s].synchronize()  # chunk k has reached host memory
        elif lane.drained[s] is not None:
            lane.drained[s].synchronize()  # chunk k-2 has left this slot
        return lane.post(self._host_chunk(lane, k), k)

    def _retire(self, posted: Sequence[tuple[Lane, int, Any]], timeout: datetime.timedelta, what: str) -> None:
        """Wait for chunk j of each lane, then drain its slot and refill it with chunk j+2."""
        wait_all([work for _, _, work in posted], timeout, what)
        for lane, j, _ in posted:
            if lane.after is not None:
                lane.after(self._host_chunk(lane, j))
        if not self.stage:
            return
        d2h, h2d = self.streams
        for lane, j, _ in posted:
            if lane.writes:
                self._stage_in(lane, j, h2d)
            if lane.reads and j + 2 < self._chunks(lane):
                self._stage_out(lane, j + 2, d2h)

    def _prepare_staging(self, lanes: Sequence[Lane], ready: Any = None) -> None:
        be = self.backend
        if not self.streams:
            self.streams.extend([be.Stream(), be.Stream()])
        if ready is None:
            ready = producers_done(be)
        for stream in self.streams:
            ready.wait(stream)
        self._assign_slots(lanes)
        for lane in lanes:
            for k in range(min(2, self._chunks(lane)) if lane.reads else 0):
                self._stage_out(lane, k, self.streams[0])

    def _assign_slots(self, lanes: Sequence[Lane]) -> None:
        needed = 2 * len(lanes)
        while len(self.pool) < needed:
            self.pool.append(self._new_slot())
        for i, lane in enumerate(lanes):
            lane.slots = self.pool[2 * i : 2 * i + 2]

    def _new_slot(self) -> torch.Tensor:
        buf = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        # Page-locked memory lets device copies run asynchronously; the host backend has no device.
        return self.backend.pinned(buf)

    def _slot_view(self, lane: Lane, k: int) -> torch.Tensor:
        start, stop = lane.span(k, self._elems(lane))
        size = (stop - start) * lane.flat.element_size()
        return lane.slots[k % 2][:size].view(lane.flat.dtype)

    def _stage_out(self, lane: Lane, k: int, stream: Any) -> None:
        """Device→host copy of chunk k into its slot, queued on ``stream``."""
        s = k % 2
        if lane.drained[s] is not None:
            lane.drained[s].wait(stream)  # the slot's previous chunk must have been copied back first
        start, stop = lane.span(k, self._elems(lane))
        with self.backend.stream(stream):
            self._slot_view(lane, k).copy_(lane.flat[start:stop], non_blocking=True)
            event = self.backend.Event()
            event.record(stream)
        lane.staged[s] = event

    def _stage_in(self, lane: Lane, k: int, stream: Any) -> None:
        """Host→device copy of chunk k out of its slot, queued on ``stream``."""
        s = k % 2
        start, stop = lane.span(k, self._elems(lane))
        with self.backend.stream(stream):
            lane.flat[start:stop].copy_(self._slot_view(lane, k), non_blocking=True)
            event = self.backend.Event()
            event.record(stream)
        lane.drained[s] = event


def producers_done(backend: Backend) -> Any:
    """An event on the calling thread's current stream: the side streams wait for it before touching the tensors."""
    ready = backend.Event()
    ready.record(backend.current_stream())
    return ready


class Channels:
    """Runs each host channel's lanes in its own thread, so the channels' transfers overlap.

    Why threads: a gloo send writes into its socket from the thread that posts it, so one thread
    posting every stripe writes them one after the other, at one stream's speed, however many
    connections there are. Each channel has its own thread, staging buffers and copy streams;
    lanes of one channel stay on one thread (a gloo group is used from one thread at a time).
    """

    def __init__(self, backend: Backend, stage: bool, chunk_bytes: int, count: int, device_index: int | None) -> None:
        self.backend, self.stage, self.chunk_bytes = backend, stage, chunk_bytes
        self.pools: list[list[torch.Tensor]] = [[] for _ in range(count)]
        self.streams: list[list[Any]] = [[] for _ in range(count)]
        self.device_index = device_index
        self._executor: Any = None

    def pipeline(self, channel: int) -> StagingPipeline:
        return StagingPipeline(self.backend, self.stage, self.chunk_bytes, self.pools[channel], self.streams[channel])

    def run(self, lanes: Sequence[Lane], timeout: datetime.timedelta, what: str) -> None:
        by_channel: dict[int, list[Lane]] = {}
        for lane in lanes:
            if lane.flat.numel():
                by_channel.setdefault(lane.channel, []).append(lane)
        if len(by_channel) <= 1:
            for channel, group in by_channel.items():
                self.pipeline(channel).run(group, timeout, what)
            return
        ready = producers_done(self.backend) if self.stage else None
        futures = [self._pool().submit(self.pipeline(c).run, group, timeout, what, ready) for c, group in by_channel.items()]
        errors = []
        for future in futures:  # every channel finishes (or fails within its timeout) before the call returns
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the first one is raised below
                errors.append(exc)
        if errors:
            raise errors[0]

    def _pool(self) -> Any:
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(len(self.pools), thread_name_prefix="hal-bridge-channel",
                                                initializer=self._enter_thread)
        return self._executor

    def _enter_thread(self) -> None:
        """A new thread starts on device 0 and the default stream: put it on this rank's device."""
        if self.device_index is not None and self.backend.device_type != "cpu":
            self.backend.set_device(self.device_index)


def tag_poster(fn: Callable[..., Any], peer: int, group: dist.ProcessGroup | None, index: int) -> Callable[[torch.Tensor, int], Any]:
    """Chunks alternate between two tags per operation, so the two in flight can never be confused."""

    def post(chunk: torch.Tensor, k: int) -> Any:
        return fn(chunk, peer, group=group, tag=2 * index + k % 2)

    return post
