"""The bridge: collectives over a group that spans islands of different backends.

A group whose ranks run different backends (CUDA + Ascend on a cluster; CUDA + CPU on one GPU
machine; CPU islands declared for tests) has no single CCL that every rank can join. The bridge
makes it look like any other group, behind the same ``Communicator`` methods:

* ``all_reduce`` / ``reduce_scatter`` / ``all_gather`` are hierarchical: the native CCL works
  inside each island (``island.group``), the island leaders exchange over the host CCL
  (``layout.leaders_group``, gloo), and each leader broadcasts the result back into its island.
  Only one copy of the data per island crosses the slow host path. Where each island has one rank in
  the group (the replicas' speakers: ``parallel.replicas.sync``), the leaders' sum is striped over the
  host channels as point-to-point messages are, and an all-gather is sent as such messages.
* point-to-point across islands goes over the host group, staged through pinned host memory,
  chunked and double-buffered (``collectives.staging``); inside an island it stays native. A message
  of several chunks is striped over the layout's host channels (``HAL_BRIDGE_CHANNELS`` gloo groups
  over the same ranks, default 8): each channel has its own TCP connections, gloo thread and (on
  this rank) posting thread (``staging.Channels``), so the stripes travel at once, as NCCL's socket
  transport spreads one message over several sockets.
  ``HAL_BRIDGE_CHANNELS=1`` keeps the single stream.
* ``all_to_all``, ``broadcast``, ``reduce``, ``gather``, ``scatter`` copy to the host, run the
  gloo op over ``layout.host_group`` and copy back: correct and simple; they are rarely hot.

Every call is synchronous: the data is in place when it returns. Results equal the flat
(single-island) path bitwise for integer dtypes and for max/min/product of exactly representable
values. Float sums add in a different order (island first, then across islands), so a float
``sum``/``avg`` may differ from the flat path in the last bits; integer-valued floats are exact.
Every rank of the group gets the same bits, whatever its device (``avg`` divides once, on the host).

The knobs ``HAL_BRIDGE_CHUNK_BYTES`` and ``HAL_BRIDGE_STAGE`` are described in ``collectives.staging``;
``HAL_BRIDGE_CHANNELS`` is read once by ``init_distributed`` (every rank must agree: it makes groups).
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hal.backend import Backend
from hal.backend_registry import get_backend
from hal.downgrades import Downgrade, record_downgrade

from .p2p import P2P
from .process_groups import Island, Layout
from .staging import CHUNK_ENV, Channels, Lane, StagingPipeline, chunk_bytes_from_env, stage_mode_from_env, tag_poster, wait_all
from .validation import CollectiveError, all_gather_single

HostRoute = Callable[[str, torch.Tensor, "str | None"], bool]  # (op, tensor, reduce op) -> go through the host?

_DIST_OPS = {
    "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}  # fmt: skip


MIN_STRIPE_BYTES = 4 << 20  # parts smaller than this cost more in per-message overhead than they gain


def stripe_ranges(numel: int, element_size: int, channels: int) -> list[tuple[int, int]]:
    """The element ranges one message travels in: at most one per channel, equal, at least 4 MiB each.

    Both ends compute it from what they agree on (size, dtype, channel count), so the stripes pair
    up; each stripe is then chunked on its own channel. A message under 8 MiB, or one channel, is one stripe.
    """
    count = max(1, min(channels, numel * element_size // MIN_STRIPE_BYTES))
    per = -(-numel // count)
    return [(start, min(numel, start + per)) for start in range(0, numel, per)] if numel else [(0, 0)]


# --- the bridge ----------------------------------------------------------------------------------------
class Bridge:
    """Runs a Communicator's calls when its group spans several islands (see the module doc).

    It is given what it needs (layout, rank, device, timeout, the CCL-gap check), so it never
    imports the communicator that owns it.
    """

    def __init__(
        self,
        layout: Layout,
        rank: int,
        backend: Backend,
        device: torch.device,
        timeout: datetime.timedelta,
        host_route: HostRoute,
    ) -> None:
        """``host_route`` tells whether the island's CCL has a gap for a call (the communicator's check)."""
        self.layout = layout
        self.rank = rank
        self.backend = backend
        self.device = device
        self.timeout = timeout
        self._host_route = host_route
        self.island: Island = self.layout.island_of(self.rank)
        self.is_leader = self.rank == self.island.leader
        self.islands = tuple(sorted(self.layout.islands, key=lambda i: i.leader))  # leaders-group order
        self.chunk_bytes = chunk_bytes_from_env()
        self.stage_mode = stage_mode_from_env()
        self._agree_on_settings()
        self._channels = Channels(backend, self.stages, self.chunk_bytes, len(layout.channels), device.index)

    @property
    def stages(self) -> bool:
        """Whether this rank copies through host buffers (device tensors, or ``HAL_BRIDGE_STAGE=always``)."""
        return self.device.type != "cpu" or self.stage_mode == "always"

    def _agree_on_settings(self) -> None:
        """Every rank must chunk alike, or sends and receives would not pair up: check it once."""
        mine = torch.tensor([self.chunk_bytes], dtype=torch.int64)
        seen = torch.empty(self.layout.size, dtype=torch.int64)
        wait_all([all_gather_single(seen, mine, group=self.layout.host_group, async_op=True)], self.timeout, "setup")
        values = seen.tolist()
        if len(set(values)) != 1:
            where = "; ".join(f"rank {r}: {v}" for r, v in zip(self.layout.ranks, values))
            raise CollectiveError(f"{CHUNK_ENV} differs between ranks ({where}); set the same value on every rank")

    def _pipeline(self) -> StagingPipeline:
        return self._channels.pipeline(0)

    # --- all_reduce / reduce_scatter / all_gather: hierarchical -----------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce inside the island, across leaders, broadcast back; in place.

        ``avg`` runs as ``sum`` at every level; the leaders divide by the group size on the host
        before the broadcast back, so every rank gets the same bits (a device division may round
        differently: CUDA divides by a scalar through its reciprocal). Float sums may differ from
        the flat path in the last bits (addition order).
        """
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._hierarchical_reduce(work, op)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """This rank's slice of the hierarchical all-reduce of a copy.

        Uneven islands make the leaders' share of the result uneven too, so the leaders all-reduce
        the whole tensor (same volume as one ring pass more) rather than run a reduce-scatter.
        """
        work = tensor.contiguous().clone()
        self._hierarchical_reduce(work, op)
        rows = work.shape[0] // self.layout.size
        index = self.layout.ranks.index(self.rank)
        return work[index * rows : (index + 1) * rows].clone()

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's rows, concatenated in group-rank order (islands may interleave ranks)."""
        if self.layout.size == len(self.islands):
            return self._all_gather_by_messages(tensor, sizes)
        ranks = self.layout.ranks
        rows_of = dict(zip(ranks, sizes))
        block = self._island_all_gather(tensor.contiguous(), [rows_of[r] for r in self.island.ranks])
        out = tensor.new_empty((sum(sizes), *tensor.shape[1:]))
        if self.is_leader:
            pieces = self._leaders_exchange_blocks(block, rows_of)
            self._fill(out, torch.cat([pieces[r] for r in ranks]))
        self._island_broadcast(out)
        return out

    def _all_gather_by_messages(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """One rank an island (the replicas' speakers): every rank's rows go to every other as bridged point-to-point
        messages — staged through pinned memory and striped over the host channels — where the leaders' gloo
        all-gather would be one unstaged stream."""
        ranks = self.layout.ranks
        me = ranks.index(self.rank)
        mine = tensor.detach().contiguous()
        out = tensor.new_empty((sum(sizes), *tensor.shape[1:]))
        pieces = list(out.split(sizes))
        pieces[me].copy_(mine)
        sends = [P2P("send", mine, r) for r in ranks if r != self.rank and sizes[me]]
        recvs = [P2P("recv", pieces[i], r) for i, r in enumerate(ranks) if r != self.rank and sizes[i]]
        self.batch_p2p(sends + recvs)
        return out

    def _hierarchical_reduce(self, work: torch.Tensor, op: str) -> None:
        """``op`` over the group into ``work`` on every rank (``avg``: sums, divided once on the host)."""
        if work.numel() == 0:
            return
        self._island_reduce(work, "sum" if op == "avg" else op)
        if self.is_leader:
            self._leaders_all_reduce(work, op)
        self._island_broadcast(work)

    def _leaders_all_reduce(self, work: torch.Tensor, op: str) -> None:
        group, dist_op, size = self.layout.leaders_group, _DIST_OPS["sum" if op == "avg" else op], self.layout.size

        def poster(on: dist.ProcessGroup | None) -> Callable[[torch.Tensor, int], Any]:
            return lambda chunk, k: dist.all_reduce(chunk, op=dist_op, group=on, async_op=True)

        def average(chunk: torch.Tensor) -> None:
            chunk.div_(size)  # on the host, identically on every leader, as the flat gloo path does

        flat = work.view(-1)
        after = average if op == "avg" else None
        if self.layout.size == len(self.islands) and len(self.layout.channels) > 1:
            # every rank of the group leads its island (one rank an island, as the replicas' speakers are): each host
            # channel joins exactly the leaders, so the message's stripes are summed over the channels at once
            lanes = [Lane(flat[start:stop], True, True, poster(channel), after=after, channel=index)
                     for index, (channel, (start, stop)) in
                     enumerate(zip(self.layout.channels, self.stripes(flat.numel(), flat.element_size())))]
            self._channels.run(lanes, self.timeout, "all_reduce (leaders)")
            return
        self._pipeline().run([Lane(flat, True, True, poster(group), after=after)], self.timeout, "all_reduce (leaders)")

    def _leaders_exchange_blocks(self, block: torch.Tensor, rows_of: dict[int, int]) -> dict[int, torch.Tensor]:
        """All-gather every island's block between leaders; returns each rank's rows (host)."""
        block_rows = [sum(rows_of[r] for r in island.ranks) for island in self.islands]
        longest = max(block_rows)
        host = block.detach().cpu()
        if host.shape[0] < longest:
            host = torch.cat([host, host.new_zeros((longest - host.shape[0], *host.shape[1:]))])
        gathered = [torch.empty_like(host) for _ in self.islands]
        if longest:
            work = dist.all_gather(gathered, host, group=self.layout.leaders_group, async_op=True)
            wait_all([work], self.timeout, "all_gather (leaders)")
        pieces: dict[int, torch.Tensor] = {}
        for island, got, n in zip(self.islands, gathered, block_rows):
            split = list(got[:n].split([rows_of[r] for r in island.ranks]))
            pieces.update(zip(island.ranks, split))
        return pieces

    # --- inside one island: the native CCL ---------------------------------------------------------
    def _native(self, what: str, tensor: torch.Tensor, reduce_op: str | None = None) -> torch.Tensor:
        """The tensor to hand the island's CCL: itself, or a host copy where the CCL has a gap."""
        host_route = self._host_route(what, tensor, reduce_op)
        if not host_route and reduce_op is not None and reduce_op not in get_backend(self.island.backend).ccl_reduce_ops:
            record_downgrade(Downgrade("ccl", f"{what} {reduce_op} on {self.island.backend}", reduce_op, "host gloo",
                                       f"{self.island.backend}'s CCL has no {reduce_op} reduction"))
            host_route = True
        return tensor.detach().cpu() if host_route and tensor.device.type != "cpu" else tensor

    def _island_reduce(self, work: torch.Tensor, op: str) -> None:
        if len(self.island.ranks) == 1:
            return
        buf = self._native("all_reduce", work, op)
        task = dist.reduce(buf, dst=self.island.leader, op=_DIST_OPS[op], group=self.island.group, async_op=True)
        wait_all([task], self.timeout, "reduce (island)")
        if buf is not work and self.is_leader:
            work.copy_(buf)

    def _island_broadcast(self, work: torch.Tensor) -> None:
        if len(self.island.ranks) == 1 or work.numel() == 0:
            return
        buf = self._native("broadcast", work)
        task = dist.broadcast(buf, src=self.island.leader, group=self.island.group, async_op=True)
        wait_all([task], self.timeout, "broadcast (island)")
        if buf is not work:
            work.copy_(buf)

    def _island_all_gather(self, tensor: torch.Tensor, island_rows: list[int]) -> torch.Tensor:
        """The island members' rows concatenated in island order (uneven rows padded on the wire)."""
        if len(self.island.ranks) == 1:
            return tensor
        longest = max(island_rows)
        if longest == 0:
            return tensor
        buf = self._native("all_gather", tensor)
        if buf.shape[0] < longest:
            buf = torch.cat([buf, buf.new_zeros((longest - buf.shape[0], *buf.shape[1:]))])
        out = buf.new_empty((longest * len(island_rows), *buf.shape[1:]))
        task = all_gather_single(out, buf.contiguous(), group=self.island.group, async_op=True)
        wait_all([task], self.timeout, "all_gather (island)")
        return torch.cat([p[:n] for p, n in zip(out.split(longest), island_rows)])

    # --- host-staged ops over the host group -------------------------------------------------------
    def all_to_all(self, tensor: torch.Tensor, input_splits: Sequence[int] | None, output_splits: Sequence[int] | None) -> torch.Tensor:
        host = self._to_host(tensor)
        rows = sum(output_splits) if output_splits is not None else tensor.shape[0]
        out = host.new_empty((rows, *host.shape[1:]))
        task = dist.all_to_all_single(
            out, host, output_split_sizes=None if output_splits is None else list(output_splits),
            input_split_sizes=None if input_splits is None else list(input_splits),
            group=self.layout.host_group, async_op=True,
        )
        wait_all([task], self.timeout, "all_to_all")
        return out.to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        host = self._to_host(tensor) if self.rank == src else self._host_like(tensor)
        wait_all([dist.broadcast(host, src=src, group=self.layout.host_group, async_op=True)], self.timeout, "broadcast")
        return self._fill(tensor, host)

    def reduce(self, tensor: torch.Tensor, dst: int, op: str) -> torch.Tensor:
        """Reduce onto ``dst``; the other ranks' tensors are left as they were."""
        host = self._to_host(tensor).clone()
        task = dist.reduce(host, dst=dst, op=_DIST_OPS["sum" if op == "avg" else op], group=self.layout.host_group, async_op=True)
        wait_all([task], self.timeout, "reduce")
        if self.rank == dst:
            if op == "avg":
                host.div_(self.layout.size)
            self._fill(tensor, host)
        return tensor

    def gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        host = self._to_host(tensor)
        out = [torch.empty_like(host) for _ in self.layout.ranks] if self.rank == dst else None
        wait_all([dist.gather(host, out, dst=dst, group=self.layout.host_group, async_op=True)], self.timeout, "gather")
        return None if out is None else [o.to(tensor.device) for o in out]

    def scatter(self, out: torch.Tensor, chunks: Sequence[torch.Tensor] | None, src: int) -> torch.Tensor:
        host = self._host_like(out)
        send = [self._to_host(c) for c in chunks] if self.rank == src and chunks is not None else None
        wait_all([dist.scatter(host, send, src=src, group=self.layout.host_group, async_op=True)], self.timeout, "scatter")
        return self._fill(out, host)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu").contiguous()

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype)

    @staticmethod
    def _fill(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        if source is not target:
            target.copy_(source)
        return target

    # --- point to point -------------------------------------------------------------------------
    def batch_p2p(self, ops: Sequence[P2P]) -> list[torch.Tensor]:
        """Native inside the island; across islands chunked through (pinned) host memory.

        Same-island operations are posted first (they do not block), then the cross-island lanes
        run round by round. Received tensors come back in the order of the recv operations.
        """
        native = [p for p in ops if self.layout.island_of(p.peer) is self.island]
        bridged = [p for p in ops if self.layout.island_of(p.peer) is not self.island]
        native_bufs = [self._native(p.kind, p.tensor) for p in native]
        works = self._post_native(native, native_bufs)
        lanes, copy_backs = self._p2p_lanes(bridged)
        self._channels.run(lanes, self.timeout, "send/recv")
        wait_all(works, self.timeout, "send/recv (island)")
        for p, buf in zip(native, native_bufs):
            if p.kind == "recv" and buf is not p.tensor:
                p.tensor.copy_(buf)
        for target, flat in copy_backs:
            target.copy_(flat.view(target.shape))
        return [p.tensor for p in ops if p.kind == "recv"]

    def _post_native(self, ops: Sequence[P2P], bufs: Sequence[torch.Tensor]) -> list[Any]:
        if not ops:
            return []
        group = self.island.group
        torch_ops = [
            dist.P2POp(dist.isend if p.kind == "send" else dist.irecv, buf.contiguous() if p.kind == "send" else buf, p.peer, group=group)
            for p, buf in zip(ops, bufs)
        ]
        return list(dist.batch_isend_irecv(torch_ops))

    def _p2p_lanes(self, ops: Sequence[P2P]) -> tuple[list[Lane], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Lanes for the cross-island ops: one per stripe (``stripes``), each on its own host channel.

        An op is numbered among this rank's ops of that kind with that peer; the number makes its
        tags, which stay distinct within each channel's group.
        """
        lanes: list[Lane] = []
        copy_backs: list[tuple[torch.Tensor, torch.Tensor]] = []
        counts: dict[tuple[str, int], int] = {}
        channels = self.layout.channels
        for p in ops:
            tag = counts.get((p.kind, p.peer), 0)
            counts[(p.kind, p.peer)] = tag + 1
            if p.kind == "send":
                flat = p.tensor.detach().contiguous().view(-1)
            else:
                flat = p.tensor.view(-1) if p.tensor.is_contiguous() else torch.empty(p.tensor.numel(), dtype=p.tensor.dtype, device=p.tensor.device)
                if not p.tensor.is_contiguous():
                    copy_backs.append((p.tensor, flat))
            fn = dist.isend if p.kind == "send" else dist.irecv
            stripes = self.stripes(flat.numel(), flat.element_size())
            for index, (channel, (start, stop)) in enumerate(zip(channels, stripes)):
                post = tag_poster(fn, p.peer, channel, tag)
                lanes.append(Lane(flat[start:stop], p.kind == "send", p.kind == "recv", post, channel=index))
        return lanes, copy_backs

    def stripes(self, numel: int, element_size: int) -> list[tuple[int, int]]:
        """This bridge's stripes of a message (``stripe_ranges`` over its channels)."""
        return stripe_ranges(numel, element_size, len(self.layout.channels))
