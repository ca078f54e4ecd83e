"""MoE dispatch and combine over CUDA symmetric memory, with no host read of the token counts.

The NCCL path (``hal.parallel.models.moe.dispatch``) must read the per-expert counts on the host before it can give
NCCL its splits; that read waits for everything queued before it, and on 4 x H200 it held the exchange to
0.35-0.45x of a raw all-to-all at 4096 tokens a rank (0.76x at best for any design that reads counts on the
host). Here every rank maps the same buffers (``torch.distributed._symmetric_memory``) and Triton kernels
(``hal.kernels.triton.moe_exchange``) do the whole exchange on the device: post the counts (and the slot
each rank receives in) into every peer's table, one barrier, then one launch in which every program works
out the routes from the table and stores its rows straight into their experts' blocks on the owning ranks,
one barrier. The rows land as the NCCL path lands
them (grouped by local expert, sources in rank order), so the experts' grouped matmul reads the same blocks
— with its offsets on the device, over a tensor sized for the worst case (every rank's rows to one rank:
ep x rows), which is this design's cost: memory, not time. ``choose`` keeps it to where that buffer is at
most ``MAX_BUFFER_BYTES``.

Where rows land: a forward exchange lands them in a durable slot (``exchange_slots``) that is handed out as
the result, with no copy, while the rank has one free (``HAL_MOE_EXCHANGE_POOL_MIB``, 1 GiB by default, for
each exchange shape); otherwise, and always in the backward, in one of two staging slots that alternate
between successive exchanges and are copied out. An exchange's stores into a staging slot come after the
barrier of the exchange before it, which every rank reaches only after copying that slot out the time
before — so no rank overwrites rows a peer has not copied out yet, with no extra barrier. Every rank of the
group must run the same exchanges in the same order (as with any collective), combine each dispatch before
its next exchange, and route the same number of rows (hal's micro-batches are one shape).

Needs: CUDA devices of one host with peer access, an NCCL group of one island, torch's symmetric memory,
Triton. ``agree`` says what is missing; ``HAL_MOE_EXCHANGE`` (auto | symmetric | all_to_all) forces a path.
"""
from __future__ import annotations

import importlib.util
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import CollectiveError
from .exchange_slots import DurableSlots, pool_mib, slot_count, tracking_problem

MAX_BUFFER_BYTES = 512 * 2**20  # one exchange buffer (two are kept); above it the all-to-all path runs
ENV = "HAL_MOE_EXCHANGE"
CHOICES = ("auto", "symmetric", "all_to_all")


def requested_path() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise CollectiveError(f"{ENV}={value!r} is not a choice; use one of {', '.join(CHOICES)}")
    return value


def group_problem(comm: Any) -> str | None:
    """What rules the symmetric exchange out for the whole group, the same on every rank (no agreement needed)."""
    if comm.layout.is_heterogeneous:
        return "the expert group spans islands (the bridge carries it)"
    if comm.device.type != "cuda":  # one island: every rank's device is of this type
        return f"the device is {comm.device.type}, not cuda"
    return None


def local_problem(comm: Any) -> str | None:
    """Why this rank cannot run the symmetric exchange (None: it can)."""
    if comm.native_group is None or comm.backend.ccl != "nccl":
        return f"the group's library is {comm.backend.ccl}, not nccl"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return f"torch {torch.__version__} has no symmetric memory"
    if not (hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")):
        return f"torch {torch.__version__}'s symmetric memory lacks empty/rendezvous"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'hetero-hal[kernels]')"
    return None


@dataclass(frozen=True)
class Agreement:
    """What every rank of a group agreed for one exchange shape: whether it can run, the most rows any rank routes,
    and the durable slots' budget."""

    problem: str | None
    max_rows: int
    pool_mib: int = 0  # the durable slots' budget: the least any rank asked for


_AGREED: dict[tuple[Any, ...], Agreement] = {}


def _group_key(comm: Any) -> tuple[Any, ...]:
    """A group's identity while the process lives: its ranks and its CCL group's name (ids of dead objects recur)."""
    return (comm.ranks, getattr(comm.native_group, "group_name", None) or id(comm))


def agree(comm: Any, rows: int) -> Agreement:
    """Whether the group can run the symmetric exchange for ``rows`` rows a rank (every rank, all on one host), and
    the most rows any rank routes (the buffers' size). One gather over the group's host group per group and
    shape, so every rank takes the same path; a group whose ranks cannot use it says so with no gather."""
    key = (*_group_key(comm), rows)
    if key not in _AGREED and (problem := group_problem(comm)):
        _AGREED[key] = Agreement(problem, rows)
    if key not in _AGREED:
        try:
            budget: int | str = pool_mib()
        except CollectiveError as bad:  # said on every rank after the gather, so none is left waiting in it
            budget = str(bad)
        mine = (local_problem(comm), socket.gethostname(), rows, budget)
        everyone: list[Any] = [None] * comm.size
        dist.all_gather_object(everyone, mine, group=comm.layout.host_group)
        for r, (_, _, _, b) in zip(comm.ranks, everyone):
            if isinstance(b, str):
                raise CollectiveError(f"rank {r}: {b}")
        problems = [f"rank {r}: {p}" for r, (p, _, _, _) in zip(comm.ranks, everyone) if p]
        hosts = {h for _, h, _, _ in everyone}
        if not problems and len(hosts) > 1:
            problems = [f"the group spans {len(hosts)} hosts (symmetric memory here is one host's peer access)"]
        _AGREED[key] = Agreement("; ".join(problems) or None, max(e[2] for e in everyone), min(e[3] for e in everyone))
    return _AGREED[key]


def buffer_bytes(comm: Any, rows: int, hidden: int, dtype: torch.dtype) -> int:
    """One exchange buffer: every rank's ``rows`` could go to one rank."""
    return comm.size * rows * hidden * torch.empty((), dtype=dtype).element_size()


def choose(comm: Any, rows: int, hidden: int, dtype: torch.dtype) -> tuple[str, str]:
    """(path, why): ``symmetric`` or ``all_to_all`` (counts read on the host, the Communicator's all-to-alls) for
    an exchange of ``rows`` rows on this rank. The same on every rank."""
    asked = requested_path()
    if asked == "all_to_all":
        return "all_to_all", f"{ENV}=all_to_all"
    agreed = agree(comm, rows)
    if agreed.problem:
        if asked == "symmetric":
            raise CollectiveError(f"{ENV}=symmetric cannot run: {agreed.problem}; unset it to let hal choose")
        return "all_to_all", agreed.problem
    size = buffer_bytes(comm, agreed.max_rows, hidden, dtype)
    if asked == "auto" and size > MAX_BUFFER_BYTES:
        return "all_to_all", (f"the worst-case buffer ({size / 2**20:.0f} MiB) is over {MAX_BUFFER_BYTES / 2**20:.0f} MiB: "
                              "at this size the counts' host read costs little")
    return "symmetric", f"{ENV}={asked}"


_UNSET = torch.empty(0)  # a route tensor not computed yet (never read: dispatch sets them before returning)


@dataclass
class DeviceRoute:
    """Where one dispatch sent its rows, on the device, for combine and both backwards. ``routes`` and ``offsets``
    come from the dispatch's own launch (``route_and_push``; ``moe_exchange.split_routes`` names the parts): set
    once its rows have moved."""

    exchange: SymmetricExchange
    rows: int  # this rank's rows
    expert_of_row: torch.Tensor  # (rows,) global expert of each sorted row
    table: int  # the count table the dispatch posted into
    staging: int  # the staging slot of the dispatch (where the rows land without a durable slot)
    call: int  # the dispatch's exchange number: the combine must be the next
    received: torch.Tensor | None  # this rank's durable slot for the rows (None: staging), until dispatch hands it out
    back: torch.Tensor | None  # this rank's durable slot for the rows coming back (None: staging), until combine
    routes: torch.Tensor = _UNSET  # int64 dest_base, blk_end, back_base (E each), dest_delta, back_delta (ep each)
    offsets: torch.Tensor = _UNSET  # (local,) int32 cumulative rows per local expert: grouped_mm's offs


class SymmetricExchange:
    """The shared slots of one expert group for one shape of exchange (the most rows a rank routes, hidden, dtype):
    two staging slots that alternate between exchanges, and durable slots (``exchange_slots``) the forward
    exchanges hand out as their results."""

    def __init__(self, comm: Any, rows: int, hidden: int, dtype: torch.dtype, experts: int, pool_mib: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from hal.kernels.triton import moe_exchange

        self.kernels = moe_exchange
        self.comm, self.rows, self.hidden, self.dtype = comm, rows, hidden, dtype
        self.ep, self.me, self.experts = comm.size, comm.group_rank, experts
        self.local = experts // self.ep
        self.capacity = self.ep * rows
        name = comm.native_group.group_name
        device = comm.device
        size = torch.empty((), dtype=dtype).element_size() * hidden
        durable = 0 if tracking_problem() else slot_count(pool_mib, self.capacity * size, rows * size)
        shapes = [(self.capacity, hidden)] * (2 + durable) + [(rows, hidden)] * durable
        self.slots = [symm_mem.empty(shape, dtype=dtype, device=device) for shape in shapes]
        self.tables = [symm_mem.empty((self.ep, experts + 2), dtype=torch.int32, device=device) for _ in range(2)]
        self.slot_handles = [symm_mem.rendezvous(b, name) for b in self.slots]
        self.table_handles = [symm_mem.rendezvous(t, name) for t in self.tables]
        self.anchor = self.slots[0]  # the kernels reach every peer's every slot from here
        anchor = self.slot_handles[0].buffer_ptrs[self.me]
        self.slot_deltas = torch.stack([moe_exchange.peer_deltas(list(h.buffer_ptrs), anchor, device)
                                        for h in self.slot_handles])  # (slots, ep)
        self.staging_deltas = [self.slot_deltas[0], self.slot_deltas[1]]  # made once: a view costs host time a call
        self.table_deltas = [moe_exchange.peer_deltas(list(h.buffer_ptrs), h.buffer_ptrs[self.me], device)
                             for h in self.table_handles]
        self.durable_rows = DurableSlots(self.slots[2:2 + durable], 2)
        self.durable_back = DurableSlots(self.slots[2 + durable:], 2 + durable)
        self.pool_bytes = durable * (self.capacity + rows) * size
        self.calls = 0  # exchanges run (each takes the next staging slot)
        self.copied = 0  # forward exchanges that landed in staging (every durable slot held) and copied out
        self._next_table = 0

    def _take_staging(self) -> int:
        """Staging slots alternate by exchange on every rank, used or not: a staging slot is stored into only
        after the barrier of the exchange before, which every rank reaches after copying it out last time."""
        self.calls += 1
        return (self.calls - 1) % 2

    # --- the exchanges ------------------------------------------------------------------------------------
    def dispatch(self, rows: torch.Tensor, expert_of_row: torch.Tensor, load: torch.Tensor) -> tuple[torch.Tensor, DeviceRoute]:
        """``rows`` sorted by ``dispatch_key``, ``expert_of_row`` their global experts, ``load`` the (E,) counts:
        the rows this rank's experts get, (ep x rows, hidden) with the first ``route.offsets[-1]`` valid."""
        if rows.dim() != 2 or rows.shape[0] > self.rows or rows.shape[1] != self.hidden or rows.dtype != self.dtype:
            raise CollectiveError(f"moe exchange: rows {tuple(rows.shape)} {rows.dtype} do not fit the buffers "
                                  f"(up to {self.rows} rows of {self.hidden}, {self.dtype}); route one shape a call")
        t = self._next_table
        self._next_table ^= 1
        staging = self._take_staging()
        back_staging = self.calls % 2  # the staging slot the combine (the next exchange) takes
        received, back = self.durable_rows.take(), self.durable_back.take()
        posted = (received[0] if received else staging, back[0] if back else back_staging)
        self.kernels.post_counts(load.contiguous(), self.tables[t], self.table_deltas[t], self.me, posted)
        self.table_handles[t].barrier(channel=0)
        route = DeviceRoute(self, rows.shape[0], expert_of_row.contiguous(), t, staging, self.calls,
                            received[1] if received else None, back[1] if back else None)
        return _move(rows, route, out=True), route

    def combine(self, out_local: torch.Tensor, route: DeviceRoute) -> torch.Tensor:
        """The experts' outputs (dispatch's arrival layout) back in the rows' places on their ranks: (rows, hidden)."""
        return _move(out_local, route, out=False)

    def push(self, rows: torch.Tensor, route: DeviceRoute, *, posted: bool) -> torch.Tensor:
        """Rows to their experts' ranks: into the slots the owners posted (dispatch), or into staging (a backward)."""
        if posted:  # dispatch: the route is worked out in the same launch that moves the rows
            i, received = route.staging, route.received
            route.received = None  # from here the result holds the durable slot, and frees it when it goes
            route.routes, route.offsets = self.kernels.route_and_push(
                self.tables[route.table], self.me, self.local, self.slot_deltas, rows.contiguous(), self.anchor,
                route.expert_of_row, self.capacity)
        else:
            i = self._take_staging()
            received = None
            self.kernels.push_rows(rows.contiguous(), self.anchor, self.staging_deltas[i], route.expert_of_row,
                                   route.routes, self.local, self.capacity)
        self.slot_handles[i].barrier(channel=0)
        if received is not None:
            return received
        self.copied += posted
        arrived = torch.empty((self.capacity, self.hidden), dtype=self.dtype, device=rows.device)
        self.kernels.copy_arrived(self.slots[i], arrived, route.offsets)
        return arrived

    def push_back(self, out_local: torch.Tensor, route: DeviceRoute, *, posted: bool) -> torch.Tensor:
        """Expert outputs back to their sources: into the slots the sources posted (combine), or staging (a backward)."""
        i = self._take_staging()
        if posted:
            if self.calls != route.call + 1:  # the same on every rank: ranks run the same exchanges
                raise CollectiveError("moe exchange: another exchange ran between a dispatch and its combine on one "
                                      "buffer set; combine each dispatch before the next exchange")
            deltas, back = None, route.back  # the slots the sources posted (in the route)
            route.back = None
        else:
            deltas, back = self.staging_deltas[i], None
        self.kernels.push_back(out_local.contiguous(), self.anchor, deltas, route.routes, self.experts, self.ep,
                               self.rows)
        self.slot_handles[i].barrier(channel=0)
        if back is not None:
            return back[: route.rows]
        self.copied += posted
        return self.slots[i][: route.rows].clone()


def _move(x: torch.Tensor, route: DeviceRoute, *, out: bool) -> torch.Tensor:
    """A forward row movement (``out``: dispatch's, else combine's); an autograd node only where a gradient is needed
    (its host cost)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Move.apply(x, route, out)
    return _moved(x, route, out)


def _moved(x: torch.Tensor, route: DeviceRoute, out: bool) -> torch.Tensor:
    return route.exchange.push(x, route, posted=True) if out else route.exchange.push_back(x, route, posted=True)


class _Move(torch.autograd.Function):
    """Dispatch's or combine's row movement; the backward sends the gradients the other way, through staging."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, route: DeviceRoute, out: bool) -> torch.Tensor:
        ctx.route, ctx.out = route, out
        return _moved(x, route, out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ex = ctx.route.exchange
        moved = ex.push_back(grad, ctx.route, posted=False) if ctx.out else ex.push(grad, ctx.route, posted=False)
        return moved, None, None


_EXCHANGES: dict[tuple[Any, ...], SymmetricExchange] = {}


def exchange_for(comm: Any, rows: int, hidden: int, dtype: torch.dtype, experts: int) -> SymmetricExchange:
    """The group's buffers for this shape, made on first use (a collective: every rank of the group calls it), sized
    for the most rows any rank routes."""
    agreed = agree(comm, rows)
    if agreed.problem:
        raise CollectiveError(f"moe exchange: the symmetric exchange cannot run: {agreed.problem}")
    key = (*_group_key(comm), agreed.max_rows, hidden, dtype)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = SymmetricExchange(comm, agreed.max_rows, hidden, dtype, experts, agreed.pool_mib)
    return _EXCHANGES[key]


def tally() -> dict[str, int]:
    """Every exchange of this process so far: exchanges run, forward halves that copied out of staging (every
    durable slot held), and the durable slots' bytes."""
    live = list(_EXCHANGES.values())
    return {"exchanges": sum(e.calls for e in live), "copied": sum(e.copied for e in live),
            "pool_bytes": sum(e.pool_bytes for e in live)}
