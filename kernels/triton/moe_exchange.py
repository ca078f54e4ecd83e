"""Triton kernels of the MoE exchange over symmetric memory (``hal.collectives.symmetric_exchange``).

Every rank of an expert-parallel group maps the same buffers; a peer's copy of a buffer is this rank's
pointer plus a per-peer ``delta`` (in 16-byte units, so the compiler knows every peer address is 16-byte
aligned and vectorises the remote loads and stores — with a raw pointer loaded per row it cannot, and the
same exchange took up to 12 % longer on 4 x H200). No kernel here reads anything on the host:

- ``post_counts``: this rank's per-expert counts into row ``me`` of every peer's (ep, E) count table;
- ``route``: one program turning the table into where each row goes — ``dest_base`` (this rank's row i of
  expert e lands at ``dest_base[e] + i`` on the rank holding e), the owner-side blocks (local expert j,
  source s) as ``blk_end`` and ``back_base`` (owner row r of block b goes back to ``back_base[b] + r`` on
  source s), and ``offs`` (the cumulative rows per local expert, as ``torch._grouped_mm`` takes them);
- ``push_rows``: rows to their experts' ranks; ``push_back``: expert outputs back to their sources;
- ``copy_arrived``: the rows that arrived out of the shared buffer (which the next exchange reuses).

Rows are sorted by ``hal.parallel.moe.dispatch_key`` (local expert first, then the owning rank), and land
grouped by local expert, each source's rows in rank order: the layout the NCCL path gives, so both paths feed
the experts the same blocks. Every store is bounds-checked against the buffer's capacity.

On CPU tensors the kernels run under Triton's interpreter (TRITON_INTERPRET=1), where the "peers" are
tensors of one process: the tests check the addressing that way.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .launch import check_device, on_device

BLOCK_ROWS, BLOCK_COLS, WARPS = 128, 256, 8  # the best of eight tilings on 4 x H200 (hidden 2048, bf16)
ALIGN = 16  # bytes: the unit of a peer delta


@triton.jit
def _post_counts(load, table, table_delta, me, E: tl.constexpr, EP: tl.constexpr, VEC: tl.constexpr):
    """Program p: this rank's (E,) counts into row ``me`` of peer p's (ep, E) int32 table."""
    p = tl.program_id(0)
    e = tl.arange(0, EP)
    m = e < E
    c = tl.load(load + e, mask=m, other=0).to(tl.int32)
    peer = tl.load(table_delta + p) * VEC
    tl.store(table + (peer + me * E + e), c, mask=m)


@triton.jit
def _route(table, dest_base, blk_end, back_base, offs, me, world, local,
           E: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr):
    """One program. Key order (how rows are sorted): position kk = j * world + r is rank r's local expert j,
    global expert r * local + j. Owner blocks: b = j * world + s, the rows source s sent to local expert j."""
    s = tl.arange(0, WP)
    kk = tl.arange(0, EP)
    kv = kk < E
    ek = (kk % world) * local + kk // world  # the global expert at key position kk
    C = tl.load(table + s[:, None] * E + ek[None, :], mask=(s[:, None] < world) & kv[None, :], other=0).to(tl.int64)
    colsum = tl.sum(C, axis=0)  # rows all sources send to key kk's expert
    before_me = tl.sum(tl.where(s[:, None] < me, C, 0), axis=0)  # rows lower ranks send it
    mine = tl.sum(tl.where(s[:, None] == me, C, 0), axis=0)
    in_start = tl.cumsum(mine, axis=0) - mine  # my rows before key kk (rows are sorted by key)
    # on the owner, the blocks of its earlier local experts: same owner (kk % world), lower key
    same_owner_lower = ((kk[None, :] % world) == (kk[:, None] % world)) & (kk[None, :] < kk[:, None])
    earlier = tl.sum(tl.where(same_owner_lower, colsum[None, :], 0), axis=1)
    tl.store(dest_base + ek, earlier + before_me - in_start, mask=kv)
    # this rank as owner: block b = (j, s) holds C[s, me * local + j] rows
    b = kk
    j, src = b // world, b % world
    size = tl.load(table + src * E + me * local + j, mask=kv, other=0).to(tl.int64)
    ends = tl.cumsum(size, axis=0)
    # where source src keeps those rows: its rows before key j * world + me
    rows_of_src = tl.load(table + src[:, None] * E + ek[None, :], mask=kv[:, None] & kv[None, :], other=0).to(tl.int64)
    src_start = tl.sum(tl.where(kk[None, :] < (j * world + me)[:, None], rows_of_src, 0), axis=1)
    tl.store(blk_end + b, ends, mask=kv)
    tl.store(back_base + b, src_start - (ends - size), mask=kv)
    tl.store(offs + j, ends.to(tl.int32), mask=kv & (src == world - 1))


@triton.jit
def _push_rows(src, buf, buf_delta, expert_of_row, dest_base, n_rows, local, capacity,
               H: tl.constexpr, VEC: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rm = rows < n_rows
    e = tl.load(expert_of_row + rows, mask=rm, other=0)
    d = tl.load(dest_base + e, mask=rm, other=0) + rows
    rm = rm & (d >= 0) & (d < capacity)
    peer = tl.load(buf_delta + e // local, mask=rm, other=0) * VEC
    m = rm[:, None] & (cols[None, :] < H)
    x = tl.load(src + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m)
    tl.store(buf + (peer[:, None] + d[:, None] * H + cols[None, :]), x, mask=m)


@triton.jit
def _push_back(src, buf, buf_delta, blk_end, back_base, world, capacity,
               H: tl.constexpr, VEC: tl.constexpr, NB: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr,
               BH: tl.constexpr):
    b = tl.arange(0, BP)
    ends = tl.load(blk_end + b, mask=b < NB, other=0)
    total = tl.max(ends, axis=0)  # ends never decrease: the largest is the rows that arrived
    first = tl.program_id(0) * BR
    if first < total:
        rows = first + tl.arange(0, BR)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        rm = rows < total
        blk = tl.sum(tl.where((b[None, :] < NB) & (ends[None, :] <= rows[:, None]), 1, 0), axis=1)
        d = tl.load(back_base + blk, mask=rm, other=0) + rows
        rm = rm & (d >= 0) & (d < capacity)
        peer = tl.load(buf_delta + blk % world, mask=rm, other=0) * VEC
        m = rm[:, None] & (cols[None, :] < H)
        x = tl.load(src + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m)
        tl.store(buf + (peer[:, None] + d[:, None] * H + cols[None, :]), x, mask=m)


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
def peer_deltas(pointers: list[int], mine: int, device: torch.device) -> torch.Tensor:
    """(ep,) int64: peer p's copy of this rank's buffer at ``mine`` is ``mine + delta[p] * ALIGN`` bytes."""
    deltas = [p - mine for p in pointers]
    if any(d % ALIGN for d in deltas):
        raise ValueError(f"symmetric buffers are not {ALIGN}-byte aligned against each other: {deltas}")
    return torch.tensor([d // ALIGN for d in deltas], dtype=torch.int64, device=device)


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int = 4) -> None:
    """Triton's ordinary launch (it binds and specialises every argument: 25-35 us of host time a launch on the
    4 x H200 host, the bulk of this exchange's host cost; see the module's note)."""
    kernel[grid](*args, num_warps=num_warps)


def _tiles(hidden: int) -> tuple[int, int]:
    return BLOCK_ROWS, min(BLOCK_COLS, triton.next_power_of_2(hidden))


def post_counts(load: torch.Tensor, table: torch.Tensor, table_delta: torch.Tensor, me: int) -> None:
    check_device(_post_counts, load.device)
    E = table.shape[1]
    with on_device(load.device):
        _launch(_post_counts, (table.shape[0],), load, table, table_delta, me, E, triton.next_power_of_2(E),
                ALIGN // table.element_size())


def route(table: torch.Tensor, me: int, local: int) -> tuple[torch.Tensor, ...]:
    """(dest_base (E,), blk_end (E,), back_base (E,), offs (local,) int32) from the (ep, E) count table."""
    check_device(_route, table.device)
    world, E = table.shape
    dev = table.device
    dest_base, blk_end, back_base = torch.empty(3, E, dtype=torch.int64, device=dev).unbind(0)  # one allocation
    offs = torch.empty(local, dtype=torch.int32, device=dev)
    with on_device(dev):
        _launch(_route, (1,), table, dest_base, blk_end, back_base, offs, me, world, local, E, triton.next_power_of_2(E),
               triton.next_power_of_2(world))
    return dest_base, blk_end, back_base, offs


def push_rows(rows: torch.Tensor, buf: torch.Tensor, buf_delta: torch.Tensor, expert_of_row: torch.Tensor,
              dest_base: torch.Tensor, local: int) -> None:
    check_device(_push_rows, rows.device)
    n, hidden = rows.shape
    br, bh = _tiles(hidden)
    with on_device(rows.device):
        _launch(_push_rows, (triton.cdiv(n, br), triton.cdiv(hidden, bh)), rows, buf, buf_delta, expert_of_row, dest_base, n, local,
              buf.shape[0], hidden, ALIGN // rows.element_size(), br, bh, num_warps=WARPS)


def push_back(rows: torch.Tensor, buf: torch.Tensor, buf_delta: torch.Tensor, blk_end: torch.Tensor,
              back_base: torch.Tensor, world: int) -> None:
    check_device(_push_back, rows.device)
    n, hidden = rows.shape
    br, bh = _tiles(hidden)
    blocks = blk_end.shape[0]
    with on_device(rows.device):
        _launch(_push_back, (triton.cdiv(n, br), triton.cdiv(hidden, bh)), rows, buf, buf_delta, blk_end, back_base, world,
              buf.shape[0], hidden, ALIGN // rows.element_size(), blocks, triton.next_power_of_2(blocks), br, bh,
              num_warps=WARPS)


def copy_arrived(buf: torch.Tensor, out: torch.Tensor, offs: torch.Tensor) -> None:
    check_device(_copy_arrived, out.device)
    n, hidden = out.shape
    br, bh = _tiles(hidden)
    with on_device(out.device):
        _launch(_copy_arrived, (triton.cdiv(n, br), triton.cdiv(hidden, bh)), buf, out, offs, offs.shape[0], hidden, br, bh,
              num_warps=WARPS)
