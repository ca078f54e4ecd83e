"""Durable receive slots of the symmetric MoE exchange (``hal.collectives.symmetric_exchange``).

An exchange that lands rows in a shared staging buffer must copy them out before a later exchange reuses it:
on 4 x H200 those two copies (dispatch's arrivals, combine's returns) were 18 % of a dispatch + combine at
16384 tokens a rank. A durable slot is a shared buffer handed to the caller as the result itself, so nothing
is copied; it is taken again only once nothing outside the pool holds its storage any more (the caller's
tensors, their views, and what autograd saved of them all do). Which slot a rank receives in is its own
choice, posted to its peers on the device with its counts, so the ranks need not agree on it, and a rank
whose slots are all in use receives in staging and copies, as before (counted in ``copied``).
"""
from __future__ import annotations

import os

import torch

from .errors import CollectiveError

POOL_ENV = "HAL_MOE_EXCHANGE_POOL_MIB"
DEFAULT_POOL_MIB = 1024  # durable slots of one exchange shape, rows and rows coming back together
MAX_SLOTS = 16  # of each kind: an MoE layer's forward holds one of each until its backward


def pool_mib() -> int:
    """The durable slots' budget this rank asks for (``HAL_MOE_EXCHANGE_POOL_MIB``; 0 turns them off)."""
    raw = os.environ.get(POOL_ENV, "").strip() or str(DEFAULT_POOL_MIB)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise CollectiveError(f"{POOL_ENV}={raw!r} is not a whole number of MiB >= 0; unset it for {DEFAULT_POOL_MIB}")
    return value


def slot_count(budget_mib: int, rows_bytes: int, back_bytes: int) -> int:
    """How many durable slots of each kind fit ``budget_mib``: one slot of each kind per layer in flight."""
    pair = rows_bytes + back_bytes
    return 0 if pair <= 0 else min(MAX_SLOTS, budget_mib * 2**20 // pair)


def tracking_problem() -> str | None:
    """Why durable slots cannot be used on this torch (None: they can)."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return f"torch {torch.__version__} cannot count a storage's users"
    return None


class DurableSlots:
    """Buffers handed out whole, each taken again once nothing outside the pool holds it."""

    def __init__(self, tensors: list[torch.Tensor], first_index: int) -> None:
        self.tensors = tensors
        self.first_index = first_index  # this kind's first slot in the exchange's slot table
        # each slot's storage, read by address (valid while the pool holds the tensor): no storage object per look
        self._storages = [t.untyped_storage()._cdata for t in tensors]
        self._idle = [torch._C._storage_Use_Count(c) for c in self._storages]  # what the pool itself holds of each

    def __len__(self) -> int:
        return len(self.tensors)

    def take(self) -> tuple[int, torch.Tensor] | None:
        """(slot index, the buffer as a new tensor the caller holds) for the first idle slot, or None if all are held."""
        count = torch._C._storage_Use_Count
        for j, (storage, idle) in enumerate(zip(self._storages, self._idle)):
            if count(storage) == idle:
                return self.first_index + j, self.tensors[j].detach()
        return None

    def in_use(self) -> int:
        count = torch._C._storage_Use_Count
        return sum(count(c) != idle for c, idle in zip(self._storages, self._idle))
