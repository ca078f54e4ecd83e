"""Checks for point-to-point calls: each sender and receiver compare notes before data moves.

Round 1: every send posts its signature (dtype, shape) to its peer over the host group while
every receive collects the peer's. Round 2: each receiver answers with its own signature. Both
sides then judge the same pair of signatures, so a mismatch raises the same error on the sender
and on the receiver. Sends and receives are posted as one batch, so the check cannot deadlock
where the data transfer itself would not.
"""
from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

from .failures import starting, wait_all
from .p2p import P2P
from .validation import CallSignature, CollectiveError


def _signature(op: P2P) -> CallSignature:
    return CallSignature(op.kind, 0, op.tensor.dtype, tuple(op.tensor.shape), op.tensor.device.type, True)


def _post(group: dist.ProcessGroup | None, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
          timeout: datetime.timedelta, what: str) -> None:
    ops = [dist.P2POp(dist.isend, t, peer, group=group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group) for t, peer in recvs]
    peers = sorted({peer for _, peer in sends + recvs})
    with starting([group], timeout, what, peers, late="the peer did not answer"):
        works = dist.batch_isend_irecv(ops) if ops else []
    wait_all(works, timeout, what, peers, late="the peer did not answer")


def _verdict(send: CallSignature, recv: CallSignature, sender: int, receiver: int) -> str | None:
    if send.dtype != recv.dtype:
        return (f"send/recv dtype mismatch: rank {sender} sends {str(send.dtype).replace('torch.', '')}, "
                f"rank {receiver} receives into {str(recv.dtype).replace('torch.', '')}; use one dtype")
    if send.shape != recv.shape:
        return (f"send/recv shape mismatch: rank {sender} sends {tuple(send.shape)}, rank {receiver} receives into "
                f"{tuple(recv.shape)}; allocate the receive buffer with the sent shape")
    return None


def check_peers(group: dist.ProcessGroup | None, rank: int, ops: Sequence[P2P], timeout: datetime.timedelta) -> None:
    """Exchange signatures over ``group`` (the host group) with every peer in ``ops``; raise the same
    error on both sides. ``rank`` is this rank's global rank."""
    mine = [_signature(op).encode() for op in ops]
    theirs = [torch.empty_like(m) for m in mine]
    # Round 1: senders tell receivers what is coming.
    _post(group, [(m, op.peer) for m, op in zip(mine, ops) if op.kind == "send"],
          [(t, op.peer) for t, op in zip(theirs, ops) if op.kind == "recv"], timeout, "send/recv check")
    # Round 2: receivers answer with what they expect.
    _post(group, [(m, op.peer) for m, op in zip(mine, ops) if op.kind == "recv"],
          [(t, op.peer) for t, op in zip(theirs, ops) if op.kind == "send"], timeout, "send/recv check")
    for m, t, op in zip(mine, theirs, ops):
        me, peer = CallSignature.decode(m.tolist()), CallSignature.decode(t.tolist())
        send, recv = (me, peer) if op.kind == "send" else (peer, me)
        sender, receiver = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
        problem = _verdict(send, recv, sender, receiver)
        if problem:
            raise CollectiveError(problem)
