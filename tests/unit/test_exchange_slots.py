"""Durable receive slots (hal.collectives.exchange_slots): a slot handed out as a result is taken again only once
nothing outside the pool holds it -- not the result, a view of it, nor what autograd saved of it."""
from __future__ import annotations

import pytest
import torch

from hal.collectives.errors import CollectiveError
from hal.collectives.exchange_slots import DEFAULT_POOL_MIB, MAX_SLOTS, POOL_ENV, DurableSlots, pool_mib, slot_count


def _pool(n: int = 2) -> DurableSlots:
    return DurableSlots([torch.zeros(4, 3) for _ in range(n)], first_index=5)


def test_a_taken_slot_is_not_taken_again_until_its_result_is_gone() -> None:
    pool = _pool()
    index, first = pool.take()
    assert index == 5 and first.data_ptr() == pool.tensors[0].data_ptr()
    index2, second = pool.take()
    assert index2 == 6 and second.data_ptr() == pool.tensors[1].data_ptr()
    assert pool.take() is None and pool.in_use() == 2
    del first
    again = pool.take()
    assert again is not None and again[0] == 5 and pool.in_use() == 2


def test_a_view_of_the_result_keeps_the_slot_taken() -> None:
    pool = _pool(1)
    _, result = pool.take()
    part = result[:2]
    del result
    assert pool.take() is None, "a view still reads the slot"
    del part
    assert pool.take() is not None


def test_what_autograd_saved_keeps_the_slot_taken_until_the_backward() -> None:
    pool = _pool(1)
    weight = torch.ones(3, 3, requires_grad=True)
    _, result = pool.take()
    loss = (result @ weight).sum()  # the matmul saves its input (the slot) for weight's gradient
    del result
    assert pool.take() is None, "autograd still holds the slot for the backward"
    loss.backward()
    del loss
    assert pool.take() is not None


def test_the_budget_sets_how_many_slots_of_each_kind() -> None:
    mib = 2**20
    assert slot_count(1024, 96 * mib, 32 * mib) == 8
    assert slot_count(1024, 600 * mib, 600 * mib) == 0  # one pair does not fit: staging only
    assert slot_count(1024, 1, 1) == MAX_SLOTS
    assert slot_count(0, mib, mib) == 0


@pytest.mark.parametrize("raw,want", [(None, DEFAULT_POOL_MIB), ("", DEFAULT_POOL_MIB), ("0", 0), (" 256 ", 256)])
def test_the_budget_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str | None, want: int) -> None:
    if raw is None:
        monkeypatch.delenv(POOL_ENV, raising=False)
    else:
        monkeypatch.setenv(POOL_ENV, raw)
    assert pool_mib() == want


@pytest.mark.parametrize("raw", ["-1", "1.5", "lots"])
def test_a_bad_budget_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(POOL_ENV, raw)
    with pytest.raises(CollectiveError, match=f"^{POOL_ENV}={raw!r} is not a whole number of MiB >= 0; unset it"):
        pool_mib()
