"""Triton kernels of the MoE exchange over symmetric memory (``hal.collectives.symmetric_exchange``).

Every rank of an expert-parallel group maps the same buffers ("slots"); the kernels address every slot of
every peer from one pointer, this rank's ``anchor``, plus a ``delta`` (in 16-byte units, so the compiler knows
every peer address is 16-byte aligned and vectorises the remote loads and stores — with a raw pointer loaded
per row it cannot, and the same exchange took up to 12 % longer on 4 x H200). No kernel here reads anything
on the host:

- ``post_counts``: this rank's per-expert counts, and the slots it receives rows and rows coming back in, into
  row ``me`` of every peer's (ep, E + 2) table;
- ``route``: one program turning the table into where each row goes — ``dest_base`` (this rank's row i of
  expert e lands at ``dest_base[e] + i`` on the rank holding e), the owner-side blocks (local expert j,
  source s) as ``blk_end`` and ``back_base`` (owner row r of block b goes back to ``back_base[b] + r`` on
  source s), ``offs`` (the cumulative rows per local expert, as ``torch._grouped_mm`` takes them), and each
  peer's posted slots as deltas;
- ``push_rows``: rows to their experts' ranks; ``push_back``: expert outputs back to their sources;
- ``copy_arrived``: the rows that arrived out of a shared slot (when the next exchange reuses it).

Rows are sorted by ``hal.parallel.models.moe.dispatch_key`` (local expert first, then the owning rank), and land
grouped by local expert, each source's rows in rank order: the layout the NCCL path gives, so both paths feed
the experts the same blocks. Every store is bounds-checked against the buffer's capacity.

On CPU tensors the kernels run under Triton's interpreter (TRITON_INTERPRET=1), where the "peers" are
tensors of one process: the tests check the addressing that way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLauncher, check_device, on_device

BLOCK_ROWS, BLOCK_COLS, WARPS = 128, 256, 8  # the best of eight tilings on 4 x H200 (hidden 2048, bf16)
ALIGN = 16  # bytes: the unit of a peer delta
NO_SLOT = tl.constexpr(-(1 << 62))  # a peer delta that stores nothing (a posted slot out of range)


@triton.jit
def _post_counts(load, table, table_delta, me, slot_rows, slot_back, E: tl.constexpr, EP: tl.constexpr,
                 VEC: tl.constexpr):
    """Program p: row ``me`` of peer p's (ep, E + 2) int32 table -- this rank's E counts, then the slots it
    receives in: rows (dispatch) and rows coming back (combine)."""
    p = tl.program_id(0)
    e = tl.arange(0, EP)
    c = tl.load(load + e, mask=e < E, other=0).to(tl.int32)
    c = tl.where(e == E, slot_rows, tl.where(e == E + 1, slot_back, c))
    peer = tl.load(table_delta + p) * VEC
    tl.store(table + (peer + me * (E + 2) + e), c, mask=e < E + 2)


@triton.jit
def _dest_of_keys(table, me, world, local, E: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr):
    """Over key positions kk (how rows are sorted: kk = j * world + r is rank r's local expert j, global expert
    r * local + j): (the global expert ek, kk < E, where on its owner this rank's rows of ek start, less this
    rank's rows before them -- so row i of ek lands at that + i)."""
    W: tl.constexpr = E + 2  # a table row: E counts, the rows' slot, the way back's slot
    s = tl.arange(0, WP)
    kk = tl.arange(0, EP)
    kv = kk < E
    ek = (kk % world) * local + kk // world
    C = tl.load(table + s[:, None] * W + ek[None, :], mask=(s[:, None] < world) & kv[None, :], other=0).to(tl.int64)
    colsum = tl.sum(C, axis=0)  # rows all sources send to key kk's expert
    before_me = tl.sum(tl.where(s[:, None] < me, C, 0), axis=0)  # rows lower ranks send it
    mine = tl.sum(tl.where(s[:, None] == me, C, 0), axis=0)
    in_start = tl.cumsum(mine, axis=0) - mine  # my rows before key kk (rows are sorted by key)
    # on the owner, the blocks of its earlier local experts: same owner (kk % world), lower key
    same_owner_lower = ((kk[None, :] % world) == (kk[:, None] % world)) & (kk[None, :] < kk[:, None])
    earlier = tl.sum(tl.where(same_owner_lower, colsum[None, :], 0), axis=1)
    return ek, kv, earlier + before_me - in_start


@triton.jit
def _posted_deltas(table, slot_deltas, world, slots, column, E: tl.constexpr, WP: tl.constexpr):
    """(ep,) the slot each peer posted in ``column`` (E: rows, E + 1: rows coming back), as deltas from this
    rank's anchor; NO_SLOT for a slot out of range."""
    s = tl.arange(0, WP)
    pm = s < world
    slot = tl.load(table + s * (E + 2) + column, mask=pm, other=0)
    ok = pm & (slot >= 0) & (slot < slots)
    return tl.load(slot_deltas + slot * world + s, mask=ok, other=NO_SLOT)


@triton.jit
def _store_route(table, slot_deltas, routes, offs, me, world, local, slots, E: tl.constexpr, EP: tl.constexpr,
                 WP: tl.constexpr):
    """The whole route, stored for combine and the backwards into ``routes`` (int64: dest_base (E), blk_end (E),
    back_base (E), dest_delta (ep), back_delta (ep); see ``split_routes``). Owner blocks: b = j * world + s, the
    rows source s sent to local expert j. ``slot_deltas`` (slots, ep): where each peer's slot is."""
    W: tl.constexpr = E + 2
    ek, kv, dest = _dest_of_keys(table, me, world, local, E, EP, WP)
    tl.store(routes + ek, dest, mask=kv)
    # this rank as owner: block b = (j, s) holds C[s, me * local + j] rows
    b = tl.arange(0, EP)
    j, src = b // world, b % world
    size = tl.load(table + src * W + me * local + j, mask=kv, other=0).to(tl.int64)
    ends = tl.cumsum(size, axis=0)
    # where source src keeps those rows: its rows before key j * world + me
    rows_of_src = tl.load(table + src[:, None] * W + ek[None, :], mask=kv[:, None] & kv[None, :], other=0).to(tl.int64)
    src_start = tl.sum(tl.where(b[None, :] < (j * world + me)[:, None], rows_of_src, 0), axis=1)
    tl.store(routes + E + b, ends, mask=kv)
    tl.store(routes + 2 * E + b, src_start - (ends - size), mask=kv)
    tl.store(offs + j, ends.to(tl.int32), mask=kv & (src == world - 1))
    s = tl.arange(0, WP)
    tl.store(routes + 3 * E + s, _posted_deltas(table, slot_deltas, world, slots, E, E, WP), mask=s < world)
    tl.store(routes + 3 * E + world + s, _posted_deltas(table, slot_deltas, world, slots, E + 1, E, WP), mask=s < world)


@triton.jit
def _route(table, slot_deltas, routes, offs, me, world, local, slots, E: tl.constexpr, EP: tl.constexpr,
           WP: tl.constexpr):
    """One program: the route alone (``route_and_push`` computes it on the way)."""
    _store_route(table, slot_deltas, routes, offs, me, world, local, slots, E, EP, WP)


@triton.jit
def _route_push_rows(table, slot_deltas, routes, offs, src, anchor, expert_of_row, n_rows, me, world, local, slots, capacity,
                     E: tl.constexpr, EP: tl.constexpr,
                     WP: tl.constexpr, H: tl.constexpr, VEC: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """Dispatch's routing and row movement in one launch: every program works out where its rows go from the
    table (a few hundred integers), and the first also stores the whole route for what comes after."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        _store_route(table, slot_deltas, routes, offs, me, world, local, slots, E, EP, WP)
    ek, kv, dest = _dest_of_keys(table, me, world, local, E, EP, WP)
    deltas = _posted_deltas(table, slot_deltas, world, slots, E, E, WP)
    s = tl.arange(0, WP)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rm = rows < n_rows
    e = tl.load(expert_of_row + rows, mask=rm, other=0)
    d = tl.sum(tl.where((ek[None, :] == e[:, None]) & kv[None, :], dest[None, :], 0), axis=1) + rows
    rm = rm & (d >= 0) & (d < capacity)
    delta = tl.sum(tl.where(s[None, :] == (e // local)[:, None], deltas[None, :], 0), axis=1)
    rm = rm & (delta != NO_SLOT)
    m = rm[:, None] & (cols[None, :] < H)
    x = tl.load(src + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m)
    tl.store(anchor + ((delta * VEC)[:, None] + d[:, None] * H + cols[None, :]), x, mask=m)


@triton.jit
def _push_rows(src, anchor, deltas, expert_of_row, routes, n_rows, local, capacity,
               H: tl.constexpr, VEC: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """Row i (of global expert e) to ``dest_base[e] + i`` (``routes``' first E) in the slot ``deltas`` (ep,) names
    on its expert's rank."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rm = rows < n_rows
    e = tl.load(expert_of_row + rows, mask=rm, other=0)
    d = tl.load(routes + e, mask=rm, other=0) + rows
    rm = rm & (d >= 0) & (d < capacity)
    delta = tl.load(deltas + e // local, mask=rm, other=NO_SLOT)
    rm = rm & (delta != NO_SLOT)
    m = rm[:, None] & (cols[None, :] < H)
    x = tl.load(src + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m)
    tl.store(anchor + ((delta * VEC)[:, None] + d[:, None] * H + cols[None, :]), x, mask=m)


@triton.jit
def _push_back(src, anchor, deltas, routes, world, capacity, H: tl.constexpr, VEC: tl.constexpr, NB: tl.constexpr,
               BP: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, POSTED: tl.constexpr):
    """Owner row r of block b (local expert, source s) to ``back_base[b] + r`` in the slot s receives in: the one s
    posted (``POSTED``: the route's back_delta) or the one ``deltas`` (ep,) names. NB = E blocks."""
    b = tl.arange(0, BP)
    ends = tl.load(routes + NB + b, mask=b < NB, other=0)
    total = tl.max(ends, axis=0)  # ends never decrease: the largest is the rows that arrived
    first = tl.program_id(0) * BR
    if first < total:
        rows = first + tl.arange(0, BR)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        rm = rows < total
        blk = tl.sum(tl.where((b[None, :] < NB) & (ends[None, :] <= rows[:, None]), 1, 0), axis=1)
        d = tl.load(routes + 2 * NB + blk, mask=rm, other=0) + rows
        rm = rm & (d >= 0) & (d < capacity)
        if POSTED:
            delta = tl.load(routes + 3 * NB + world + blk % world, mask=rm, other=NO_SLOT)
        else:
            delta = tl.load(deltas + blk % world, mask=rm, other=NO_SLOT)
        rm = rm & (delta != NO_SLOT)
        m = rm[:, None] & (cols[None, :] < H)
        x = tl.load(src + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m)
        tl.store(anchor + ((delta * VEC)[:, None] + d[:, None] * H + cols[None, :]), x, mask=m)


@triton.jit
def _copy_arrived(buf, out, offs, local, H: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    total = tl.load(offs + local - 1)
    first = tl.program_id(0) * BR
    if first < total:
        rows = first + tl.arange(0, BR)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        m = (rows < total)[:, None] & (cols[None, :] < H)
        at = rows.to(tl.int64)[:, None] * H + cols[None, :]
        tl.store(out + at, tl.load(buf + at, mask=m), mask=m)


# --- launchers ---------------------------------------------------------------------------------------------
def peer_deltas(pointers: list[int], anchor: int, device: torch.device) -> torch.Tensor:
    """(ep,) int64: peer p's copy of a buffer whose peers' addresses are ``pointers`` lies at ``anchor + delta[p] *
    ALIGN`` bytes, ``anchor`` being this rank's address the kernels are given (its own copy, or another buffer)."""
    deltas = [p - anchor for p in pointers]
    if any(d % ALIGN for d in deltas):
        raise ValueError(f"symmetric buffers are not {ALIGN}-byte aligned against each other: {deltas}")
    return torch.tensor([d // ALIGN for d in deltas], dtype=torch.int64, device=device)


(_post_counts_launch, _route_launch, _route_push_rows_launch, _push_rows_launch, _push_back_launch,
 _copy_arrived_launch) = (CachedLauncher(k) for k in (_post_counts, _route, _route_push_rows, _push_rows, _push_back,
                                                       _copy_arrived))


def launch_problem() -> str | None:
    """Why this process launches the exchange's kernels through Triton's own binding (None: cached launches)."""
    return _route_push_rows_launch.why_not_cached()


def _tiles(hidden: int) -> tuple[int, int]:
    return BLOCK_ROWS, min(BLOCK_COLS, triton.next_power_of_2(hidden))


def post_counts(load: torch.Tensor, table: torch.Tensor, table_delta: torch.Tensor, me: int,
                slots: tuple[int, int] = (0, 0)) -> None:
    """This rank's (E,) ``load`` and the ``slots`` it receives in (rows, rows coming back) into row ``me`` of every
    peer's (ep, E + 2) table."""
    check_device(_post_counts, load.device)
    E = table.shape[1] - 2
    with on_device(load.device):
        _post_counts_launch((table.shape[0],), load, table, table_delta, me, slots[0], slots[1], E,
                            triton.next_power_of_2(E + 2), ALIGN // table.element_size())


def _route_tensors(table: torch.Tensor, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes, offs): two allocations, no views (each costs host time; ``split_routes`` names the parts)."""
    world, E = table.shape[0], table.shape[1] - 2
    return (torch.empty(3 * E + 2 * world, dtype=torch.int64, device=table.device),
            torch.empty(local, dtype=torch.int32, device=table.device))


def split_routes(routes: torch.Tensor, experts: int, world: int) -> dict[str, torch.Tensor]:
    """The named parts of a route buffer: dest_base (E; this rank's row i of expert e lands at dest_base[e] + i on
    its owner), blk_end and back_base (E owner blocks, block b = j * world + s: cumulative rows, and where owner
    row r goes back to on s: back_base[b] + r), dest_delta and back_delta (ep: the slot each peer posted for rows
    and for rows coming back, as deltas from this rank's anchor)."""
    E = experts
    return {"dest_base": routes[:E], "blk_end": routes[E:2 * E], "back_base": routes[2 * E:3 * E],
            "dest_delta": routes[3 * E:3 * E + world], "back_delta": routes[3 * E + world:3 * E + 2 * world]}


def route(table: torch.Tensor, me: int, local: int, slot_deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes (3E + 2ep,) int64, offs (local,) int32) from the (ep, E + 2) table: where this rank's rows go, the
    owner blocks, where each peer receives (``split_routes``), and grouped_mm's offsets (``slot_deltas``: (slots,
    ep), by the slots the peers posted)."""
    check_device(_route, table.device)
    world, E = table.shape[0], table.shape[1] - 2
    routes, offs = _route_tensors(table, local)
    with on_device(table.device):
        _route_launch((1,), table, slot_deltas, routes, offs, me, world, local, slot_deltas.shape[0], E,
                      triton.next_power_of_2(E), triton.next_power_of_2(world))
    return routes, offs


def route_and_push(table: torch.Tensor, me: int, local: int, slot_deltas: torch.Tensor, rows: torch.Tensor,
                   anchor: torch.Tensor, expert_of_row: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` and ``push_rows`` in one launch (the host cost of a launch is most of a small exchange's): the
    rows go into the slots their owners posted; returns what ``route`` does."""
    check_device(_route_push_rows, rows.device)
    world, E = table.shape[0], table.shape[1] - 2
    n, hidden = rows.shape
    br, bh = _tiles(hidden)
    routes, offs = _route_tensors(table, local)
    with on_device(rows.device):
        _route_push_rows_launch((max(1, triton.cdiv(n, br)), triton.cdiv(hidden, bh)), table, slot_deltas, routes,
                                offs, rows, anchor, expert_of_row, n, me, world, local, slot_deltas.shape[0], capacity,
                                E, triton.next_power_of_2(E), triton.next_power_of_2(world), hidden,
                                ALIGN // rows.element_size(), br, bh, num_warps=WARPS)
    return routes, offs


def push_rows(rows: torch.Tensor, anchor: torch.Tensor, deltas: torch.Tensor, expert_of_row: torch.Tensor,
              routes: torch.Tensor, local: int, capacity: int) -> None:
    """Rows into the slot ``deltas`` (ep,) names on each expert's rank, by the route in ``routes``."""
    check_device(_push_rows, rows.device)
    n, hidden = rows.shape
    br, bh = _tiles(hidden)
    with on_device(rows.device):
        _push_rows_launch((triton.cdiv(n, br), triton.cdiv(hidden, bh)), rows, anchor, deltas, expert_of_row, routes,
                          n, local, capacity, hidden, ALIGN // rows.element_size(), br, bh, num_warps=WARPS)


def push_back(rows: torch.Tensor, anchor: torch.Tensor, deltas: torch.Tensor | None, routes: torch.Tensor, experts: int,
              world: int, capacity: int) -> None:
    """Expert outputs back to their sources: into the slots the sources posted (``deltas`` None), or the slot
    ``deltas`` (ep,) names on each."""
    check_device(_push_back, rows.device)
    n, hidden = rows.shape
    br, bh = _tiles(hidden)
    with on_device(rows.device):
        _push_back_launch((triton.cdiv(n, br), triton.cdiv(hidden, bh)), rows, anchor,
                          routes if deltas is None else deltas, routes, world, capacity, hidden,
                          ALIGN // rows.element_size(), experts, triton.next_power_of_2(experts), br, bh,
                          deltas is None, num_warps=WARPS)


def copy_arrived(buf: torch.Tensor, out: torch.Tensor, offs: torch.Tensor) -> None:
    check_device(_copy_arrived, out.device)
    n, hidden = out.shape
    br, bh = _tiles(hidden)
    with on_device(out.device):
        _copy_arrived_launch((triton.cdiv(n, br), triton.cdiv(hidden, bh)), buf, out, offs, offs.shape[0], hidden, br,
                             bh, num_warps=WARPS)
