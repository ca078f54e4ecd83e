"""Boundary resharding T^(k→k+1): stage k's output layout becomes stage k+1's input layout.

An activation at a stage boundary has the logical shape (B, S, *tail) for one micro-batch. A stage
lays it out over its ranks (``Layout``): rows split into ``dp`` contiguous chunks; under sequence
parallelism (``sp``) each replica's rows are further split along S into ``tp`` contiguous chunks,
otherwise every tp rank of a replica holds the full (B/dp, S, *tail) block (replicated). Inside a
stage, rank = ranks[dp_index * tp + tp_index] (ranks = offset .. offset + dp*tp - 1 by default).

Planning is pure (``plan_transfers``/``backward_transfers``): every receiver gets exactly the
intersection of its block with each holder's block, never more. Execution (``p2p_ops``, ``exchange``,
``send_activation``/``recv_activation``) packs every piece for one peer into one contiguous message
and posts all sends and receives of a boundary in one ``Communicator.batch_p2p`` — no ordering
deadlocks, and a boundary between islands of different backends goes through the collectives bridge
without asking. ``Boundary`` ties a forward and a backward plan together and offers an autograd
pair (``send`` returns a token whose ``backward()`` receives the gradient; ``recv`` returns a tensor
whose backward sends the gradient back).

Replicas (why the rules are what they are):

* Forward, replicated source (no sp, tp > 1): every tp rank holds the same values, so each piece is
  taken from ONE of them; pieces go to the least-loaded replica (ties rotate by receiver index), so the
  replicas share the sending work and the choice is the same on every process.
* Forward, replicated destination (no sp, tp > 1): every tp rank of the replica is a receiver and gets
  its full block (Megatron TP without sp needs the full input on every tp rank).
* Backward, replicated source: each source tp rank receives the gradient of its WHOLE block, not only
  of the pieces it sent — its replicated output fed a TP region whose backward needs the full
  gradient on every tp rank (the row-parallel all-reduce's backward is the identity).
* Backward, replicated destination: ``grad_rule`` says what the dst replicas hold.
  ``"identical"`` (default, Megatron without sp): the first TP layer's input gradient is already
  all-reduced across the TP group, every replica holds the same full gradient, so ONE copy per piece is
  sent back (load-balanced like the forward) and nothing is summed. ``"partial"``: each replica holds a
  partial gradient (the model left the TP reduction to the boundary); every replica sends its piece and
  the receiver sums them. Under sp there are no replicas and both rules coincide.

Gradient scaling: resharding never scales. The convention the engine must keep is that the gradient
crossing a boundary is the gradient of the ONE global loss — the loss of a micro-batch is its token
sum divided by the token count of the whole (global) micro-batch, not of the local dp shard — so the
per-element activation gradient is the same whatever dp split either stage uses, and a plain copy is
correct even when dp_k != dp_{k+1}. (With a per-shard mean each element's gradient would be dp_last
times too large on stages with another dp.) Weight gradients inside a stage are then SUMMED over its dp
replicas, not averaged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch

from hal.collectives import P2P, Communicator, Handle
from hal.errors import ConfigError

GradRule = Literal["identical", "partial"]
Range = tuple[int, int]  # half-open [start, stop)


@dataclass(frozen=True)
class Block:
    """The part of the logical (B, S) plane one rank holds: rows ``batch``, positions ``seq``."""

    batch: Range
    seq: Range

    @property
    def shape(self) -> tuple[int, int]:
        return (self.batch[1] - self.batch[0], self.seq[1] - self.seq[0])

    @property
    def volume(self) -> int:
        rows, length = self.shape
        return rows * length

    def intersect(self, other: Block) -> Block | None:
        b = (max(self.batch[0], other.batch[0]), min(self.batch[1], other.batch[1]))
        s = (max(self.seq[0], other.seq[0]), min(self.seq[1], other.seq[1]))
        return Block(b, s) if b[0] < b[1] and s[0] < s[1] else None


@dataclass(frozen=True)
class Layout:
    """One side of a boundary: ``dp`` × ``tp`` ranks (dp-major), sequence-split across tp when ``sp``.

    Not to be confused with ``collectives.Layout`` (a set of ranks and their islands): this one says
    which slice of an activation each rank holds.
    """

    dp: int
    tp: int
    sp: bool
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ConfigError(f"layout dp={self.dp} tp={self.tp}: both degrees must be at least 1")
        if len(self.ranks) != self.dp * self.tp or len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"layout dp={self.dp} tp={self.tp} needs {self.dp * self.tp} distinct ranks, got {list(self.ranks)}")

    @staticmethod
    def contiguous(dp: int, tp: int, sp: bool, offset: int) -> Layout:
        """The stage convention: ranks offset .. offset + dp*tp - 1, rank = offset + d*tp + t."""
        return Layout(dp, tp, sp, tuple(range(offset, offset + dp * tp)))

    @property
    def replicated(self) -> bool:
        """True when several tp ranks hold the same values (no sp, tp > 1)."""
        return not self.sp and self.tp > 1

    def coord(self, rank: int) -> tuple[int, int]:
        """(dp index, tp index) of a global rank."""
        return divmod(self.ranks.index(rank), self.tp)

    def rank_at(self, d: int, t: int) -> int:
        return self.ranks[d * self.tp + t]

    def block(self, rank: int, batch: int, seq: int) -> Block:
        d, t = self.coord(rank)
        rows = batch // self.dp
        if not self.sp:
            return Block((d * rows, (d + 1) * rows), (0, seq))
        length = seq // self.tp
        return Block((d * rows, (d + 1) * rows), (t * length, (t + 1) * length))

    def check(self, batch: int, seq: int, side: str) -> None:
        if batch % self.dp:
            raise ConfigError(f"{side} stage: micro-batch {batch} is not divisible by its dp {self.dp}")
        if self.sp and seq % self.tp:
            raise ConfigError(f"{side} stage: sequence {seq} is not divisible by its tp {self.tp} (sequence parallel)")


@dataclass(frozen=True)
class Transfer:
    """One piece: ``src_rank`` sends rows ``batch`` × positions ``seq`` (global ranges) to ``dst_rank``.

    The blocks both ranks hold travel with it, so either side can find the piece in its local tensor
    from the transfer list alone.
    """

    src_rank: int
    dst_rank: int
    batch: Range
    seq: Range
    src_block: Block
    dst_block: Block

    @property
    def piece(self) -> Block:
        return Block(self.batch, self.seq)

    def local(self, block: Block) -> tuple[slice, slice]:
        """Index of this piece inside the local tensor of the rank holding ``block``."""
        b0, s0 = block.batch[0], block.seq[0]
        return slice(self.batch[0] - b0, self.batch[1] - b0), slice(self.seq[0] - s0, self.seq[1] - s0)


def _plan(holders: Layout, needers: Layout, batch: int, seq: int, every_replica: bool) -> list[Transfer]:
    """Each needer's block from the holders' blocks; one replica per piece unless ``every_replica``."""
    if set(holders.ranks) & set(needers.ranks):
        raise ConfigError(
            f"boundary ranks overlap ({sorted(set(holders.ranks) & set(needers.ranks))}): stages own disjoint ranks"
        )
    holders.check(batch, seq, "sending")
    needers.check(batch, seq, "receiving")
    load = dict.fromkeys(holders.ranks, 0)
    transfers: list[Transfer] = []
    for j, dst in enumerate(needers.ranks):
        want = needers.block(dst, batch, seq)
        for d in range(holders.dp):
            if holders.sp or holders.tp == 1 or every_replica:
                candidates = [holders.rank_at(d, t) for t in range(holders.tp)]
            else:  # replicated: choose one, least loaded, ties rotating by receiver
                options = [holders.rank_at(d, t) for t in range(holders.tp)]
                candidates = [min(options, key=lambda r: (load[r], (holders.coord(r)[1] - j) % holders.tp))]
            for src in candidates:
                have = holders.block(src, batch, seq)
                piece = have.intersect(want)
                if piece is None:
                    continue
                load[src] += piece.volume
                transfers.append(Transfer(src, dst, piece.batch, piece.seq, have, want))
    return transfers


def plan_transfers(src: Layout, dst: Layout, batch: int, seq: int) -> list[Transfer]:
    """Forward pieces from stage k (``src``) to stage k+1 (``dst``) for a (batch, seq) micro-batch.

    Every dst rank's block is covered exactly once; nothing outside it is sent. Deterministic, so
    every process computes the same list (execution relies on that for message order).
    """
    return _plan(src, dst, batch, seq, every_replica=False)


def backward_transfers(src: Layout, dst: Layout, batch: int, seq: int, grad_rule: GradRule = "identical") -> list[Transfer]:
    """Gradient pieces from stage k+1 (``dst``, holding grads) back to stage k (``src``).

    Transfers name the gradient's sender as ``src_rank`` (a dst-stage rank). Each src rank receives
    its whole block; under ``grad_rule="partial"`` a replicated dst sends every replica's piece and
    the receiver must sum (``accumulate=True``), see the module docstring.
    """
    if grad_rule not in ("identical", "partial"):
        raise ConfigError(f"grad_rule {grad_rule!r} is unknown; use 'identical' or 'partial'")
    return _plan(dst, src, batch, seq, every_replica=grad_rule == "partial")


# --- execution -----------------------------------------------------------------------------------
@dataclass
class PostedOps:
    """P2P operations of one rank for one transfer list, and how to finish once they complete.

    The engine may post ``ops`` in one ``batch_p2p`` together with other operations (e.g. 1F1B's
    send-forward with recv-backward) and call ``finish()`` after; ``finish`` returns the assembled
    local tensor on a receiver, None on a pure sender.
    """

    ops: list[P2P]
    finish: Callable[[], torch.Tensor | None]


def _by_peer(transfers: Sequence[Transfer], my_rank: int) -> tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]:
    """(pieces I send per peer, pieces I receive per peer), peers ascending, pieces in plan order."""
    sends: dict[int, list[Transfer]] = {}
    recvs: dict[int, list[Transfer]] = {}
    for t in transfers:
        if t.src_rank == t.dst_rank:
            raise ConfigError(f"transfer from rank {t.src_rank} to itself: stages own disjoint ranks")
        if t.src_rank == my_rank:
            sends.setdefault(t.dst_rank, []).append(t)
        if t.dst_rank == my_rank:
            recvs.setdefault(t.src_rank, []).append(t)
    return dict(sorted(sends.items())), dict(sorted(recvs.items()))


def p2p_ops(
    transfers: Sequence[Transfer],
    my_rank: int,
    local: torch.Tensor | None = None,
    *,
    tail: Sequence[int] = (),
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    accumulate: bool = False,
) -> PostedOps:
    """Build this rank's sends (from ``local``) and receives (into a new block tensor).

    All pieces for one peer travel as one contiguous message, concatenated in plan order; the peer
    unpacks in the same order. ``tail`` is the trailing shape (H,) of a received block (taken from
    ``local`` when given); ``accumulate`` sums overlapping pieces (the ``"partial"`` gradient rule)
    instead of requiring an exact cover.
    """
    sends, recvs = _by_peer(transfers, my_rank)
    ops: list[P2P] = []
    if sends:
        if local is None:
            raise ConfigError(f"rank {my_rank} sends {sum(map(len, sends.values()))} piece(s) but was given no local tensor")
        have = next(iter(sends.values()))[0].src_block
        if tuple(local.shape[:2]) != have.shape:
            raise ConfigError(f"rank {my_rank}: local tensor is {tuple(local.shape)}, its block is {have.shape} (+ trailing dims)")
        data = local.detach()
        for peer, pieces in sends.items():
            parts = [data[t.local(t.src_block)].reshape(-1) for t in pieces]
            ops.append(P2P("send", parts[0] if len(parts) == 1 and parts[0].is_contiguous() else torch.cat(parts), peer))
    if not recvs:
        return PostedOps(ops, lambda: None)

    tail = tuple(local.shape[2:]) if local is not None and not tail else tuple(tail)
    dtype = dtype or (local.dtype if local is not None else torch.get_default_dtype())
    device = device or (local.device if local is not None else torch.device("cpu"))
    block = next(iter(recvs.values()))[0].dst_block
    covered = sum(t.piece.volume for pieces in recvs.values() for t in pieces)
    if not accumulate and covered != block.volume:
        raise ConfigError(f"rank {my_rank}: pieces cover {covered} of its {block.volume} (batch, seq) positions; "
                          "use accumulate=True only for summed (partial) gradients")
    out = (torch.zeros if accumulate else torch.empty)((*block.shape, *tail), dtype=dtype, device=device)
    unpack: list[tuple[torch.Tensor, list[Transfer]]] = []
    for peer, pieces in recvs.items():
        view = out[pieces[0].local(block)] if len(pieces) == 1 else None
        if view is not None and not accumulate and view.is_contiguous():
            ops.append(P2P("recv", view.view(-1), peer))  # lands in place (1-D, as sent): no unpacking copy
            continue
        numel = sum(t.piece.volume for t in pieces) * _prod(tail)
        buf = torch.empty(numel, dtype=dtype, device=device)
        ops.append(P2P("recv", buf, peer))
        unpack.append((buf, pieces))

    def finish() -> torch.Tensor:
        for buf, pieces in unpack:
            at = 0
            for t in pieces:
                rows, length = t.piece.shape
                part = buf[at:at + rows * length * _prod(tail)].view(rows, length, *tail)
                at += part.numel()
                target = out[t.local(block)]
                target.add_(part) if accumulate else target.copy_(part)
        return out

    return PostedOps(ops, finish)


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def exchange(
    comm: Communicator,
    transfers: Sequence[Transfer],
    my_rank: int,
    local: torch.Tensor | None = None,
    *,
    tail: Sequence[int] = (),
    dtype: torch.dtype | None = None,
    accumulate: bool = False,
    async_op: bool = False,
) -> Any:
    """Post every send and receive of this rank for ``transfers`` in one batch_p2p.

    Returns the assembled received block (None on a pure sender), or a ``Handle`` whose ``wait()``
    returns it when ``async_op``.
    """
    posted = p2p_ops(transfers, my_rank, local, tail=tail, dtype=dtype, device=comm.device, accumulate=accumulate)
    if not posted.ops:
        return Handle([], posted.finish, None, "reshard") if async_op else posted.finish()
    work = comm.batch_p2p(posted.ops, async_op=async_op)
    return Handle([work], posted.finish, None, "reshard") if async_op else posted.finish()


def send_activation(comm: Communicator, transfers: Sequence[Transfer], local_tensor: torch.Tensor, my_rank: int) -> None:
    """Send this rank's pieces of ``local_tensor`` (its block, shape (rows, len, *tail))."""
    exchange(comm, transfers, my_rank, local_tensor)


def recv_activation(
    comm: Communicator,
    transfers: Sequence[Transfer],
    my_rank: int,
    *,
    tail: Sequence[int],
    dtype: torch.dtype,
    accumulate: bool = False,
) -> torch.Tensor:
    """Receive this rank's block (shape (rows, len, *tail)) assembled from its pieces."""
    out = exchange(comm, transfers, my_rank, tail=tail, dtype=dtype, accumulate=accumulate)
    if out is None:
        raise ConfigError(f"rank {my_rank} receives nothing in this plan; call recv_activation on receiving ranks only")
    return out


# --- the boundary as a whole, with autograd -----------------------------------------------------------
@dataclass(frozen=True)
class Boundary:
    """T^(k→k+1) for a (batch, seq) micro-batch: the forward plan, the gradient plan, and autograd.

    Sender (stage k): ``token = boundary.send(comm, out)``; later ``token.backward()`` receives the
    gradient of ``out`` and backpropagates through stage k. Receiver (stage k+1):
    ``x = boundary.recv(comm, tail=(H,), dtype=...)``; its backward sends x's gradient back.
    The engine may instead call ``send_activation``/``recv_activation`` with ``forward``/``backward``
    itself, or ``p2p_ops`` to batch them with other operations.
    """

    src: Layout
    dst: Layout
    batch: int
    seq: int
    grad_rule: GradRule = "identical"

    @property
    def forward(self) -> list[Transfer]:
        return _cached_plan(self, False)

    @property
    def backward(self) -> list[Transfer]:
        return _cached_plan(self, True)

    @property
    def accumulate_grads(self) -> bool:
        """Receivers of gradients must sum: replicas send partial sums (the ``"partial"`` rule)."""
        return self.grad_rule == "partial" and self.dst.replicated

    def send(self, comm: Communicator, local: torch.Tensor) -> torch.Tensor:
        """Send ``local`` forward; returns a scalar token whose backward receives local's gradient."""
        return _Send.apply(local, comm, self)

    def recv(self, comm: Communicator, *, tail: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Receive this rank's block; the result's backward sends its gradient to the senders."""
        anchor = torch.zeros((), device=comm.device, requires_grad=True)  # gives the Function a backward edge
        return _Recv.apply(anchor, comm, self, tuple(tail), dtype)


_PLANS: dict[tuple[Boundary, bool], list[Transfer]] = {}


def _cached_plan(boundary: Boundary, backward: bool) -> list[Transfer]:
    """Plans are pure and reused every micro-batch: compute each once per process."""
    key = (boundary, backward)
    if key not in _PLANS:
        b = boundary
        _PLANS[key] = (backward_transfers(b.src, b.dst, b.batch, b.seq, b.grad_rule) if backward
                       else plan_transfers(b.src, b.dst, b.batch, b.seq))
    return _PLANS[key]


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, comm: Communicator, boundary: Boundary) -> torch.Tensor:  # type: ignore[override]
        send_activation(comm, boundary.forward, local, comm.rank)
        ctx.comm, ctx.boundary, ctx.tail, ctx.dtype = comm, boundary, tuple(local.shape[2:]), local.dtype
        return local.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        b: Boundary = ctx.boundary
        grad = recv_activation(ctx.comm, b.backward, ctx.comm.rank, tail=ctx.tail, dtype=ctx.dtype, accumulate=b.accumulate_grads)
        return grad, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, comm: Communicator, boundary: Boundary,  # type: ignore[override]
                tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        ctx.comm, ctx.boundary = comm, boundary
        return recv_activation(comm, boundary.forward, comm.rank, tail=tail, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        b: Boundary = ctx.boundary
        exchange(ctx.comm, b.backward, ctx.comm.rank, grad.contiguous())  # may send nothing (a non-chosen replica)
        return torch.zeros((), device=grad.device), None, None, None, None


__all__ = [
    "Block", "Boundary", "GradRule", "Layout", "PostedOps", "Transfer", "backward_transfers", "exchange",
    "p2p_ops", "plan_transfers", "recv_activation", "send_activation",
]
