"""The pure parts of the collective checks and failure naming, in-process (no ranks; the fast lane).

The multi-process behaviour is in test_collectives / test_collective_failures; here, the functions
every rank runs on the same data must give one answer, and a CCL's words must map to one name.
"""
from __future__ import annotations

import datetime

import pytest
import torch

from hal.collectives import CollectiveError, CollectivePeerLost, CollectiveTimeout, shutdown
from hal.collectives.failures import cause, starting, translate
from hal.collectives.process_groups import aborted
from hal.collectives.validation import SPLITS_IN, CallSignature, agree_splits, split_row

RANKS = (0, 1)


def _sigs(*dim0s: int) -> list[CallSignature]:
    return [CallSignature("all_to_all", 1, torch.float32, (d, 3), "cpu", True) for d in dim0s]


def _rows(*lists: tuple[list[int] | None, list[int] | None]) -> list[list[int]]:
    return [split_row(len(lists), i, o).tolist() for i, o in lists]


def test_signature_carries_which_split_lists_a_rank_passed() -> None:
    sig = CallSignature("all_to_all", 7, torch.int64, (4, 2), "cpu", True, splits=SPLITS_IN)
    assert CallSignature.decode(sig.encode().tolist()) == sig


def test_equal_splits_need_no_lists_and_uneven_ones_are_read_from_every_rank() -> None:
    assert agree_splits(_sigs(4, 6), None, RANKS) == [[2, 2], [3, 3]]
    sends = agree_splits(_sigs(2, 4), _rows(([1, 1], None), ([1, 3], None)), RANKS)
    assert sends == [[1, 1], [1, 3]]
    assert [row[1] for row in sends] == [1, 3]  # what rank 1 receives from each


@pytest.mark.parametrize("rows, dim0s, words", [
    ((([2, 2], None), ([1, 1, 2], None)), (4, 4),
     "rank 1's input_splits [1, 1, ...] (3 sizes) must be 2 non-negative sizes summing to its dim 0 (4); fix input_splits on rank 1"),
    ((([2, 2], None), ([1], None)), (4, 4), "rank 1's input_splits [1] must be 2"),
    ((([5, -1], None), ([2, 2], None)), (4, 4), "rank 0's input_splits [5, -1] must be 2 non-negative sizes"),
    ((([2, 2], None), ([1, 2], None)), (4, 4), "rank 1's input_splits [1, 2] must be 2 non-negative sizes summing to its dim 0 (4)"),
    ((([1, 3], None), ([1, 3], [3, 1])), (4, 4),
     "rank 1's output_splits [3, 1] disagree with what the ranks send it [3, 3]; fix output_splits on rank 1"),
    (((None, None), ([1, 3], None)), (5, 4), "rank 0's dim 0 (5) is not divisible by the group size 2; pass input_splits on rank 0"),
])
def test_bad_splits_on_one_rank_are_one_error_naming_it(rows: tuple, dim0s: tuple[int, int], words: str) -> None:
    with pytest.raises(CollectiveError, match="^all_to_all: ") as info:
        agree_splits(_sigs(*dim0s), _rows(*rows), RANKS)
    assert words in str(info.value)


def test_a_zero_dim_tensor_is_refused_by_name() -> None:
    sigs = [CallSignature("all_to_all", 1, torch.float32, (), "cpu", True)] * 2
    with pytest.raises(CollectiveError, match="rank 0 passed a 0-d tensor"):
        agree_splits(sigs, None, RANKS)


GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4000. "
               "This is typically caused by a remote worker crashing. Check the logs of the remote worker.")


def test_the_ccl_words_map_to_one_named_error() -> None:
    t = datetime.timedelta(seconds=3)
    lost = translate(RuntimeError(GLOO_CLOSED), "all_reduce", t, [1])
    assert isinstance(lost, CollectivePeerLost)
    assert str(lost).startswith("all_reduce: rank 1 closed the connection — it exited, was killed or gave up on this call "
                                "(Connection closed by peer [127.0.0.1]:4000)")
    assert "within" not in str(lost)
    late = translate(RuntimeError("Operation timed out!"), "barrier (call #2)", t, [1, 2], late="not every rank arrived")
    assert isinstance(late, CollectiveTimeout) and str(late).startswith("barrier (call #2): not every rank arrived within 3 s")
    other = translate(RuntimeError("Invalid argument"), "gather", t, [1])
    assert type(other) is CollectiveError and "the collective failed (Invalid argument)" in str(other)
    assert "a peer among ranks 1, 2" in str(translate(RuntimeError("Connection reset by peer"), "x", t, [2, 1]))
    assert cause(RuntimeError("[a.cc:1] \nsecond line")) == "second line"


def test_a_lost_peer_while_starting_aborts_and_a_refused_argument_does_not() -> None:
    t = datetime.timedelta(seconds=3)
    try:
        with pytest.raises(CollectiveError, match="^gather: the collective failed") as refused:
            with starting([], t, "gather", [1]):
                raise RuntimeError("unsupported dtype")
        assert type(refused.value) is CollectiveError and aborted() is None
        with pytest.raises(CollectivePeerLost, match="^send: rank 1 closed the connection"):
            with starting([], t, "send", [1]):
                raise RuntimeError(GLOO_CLOSED)
        assert aborted() is not None and "send: rank 1 closed the connection" in str(aborted())
    finally:
        shutdown()  # also clears the abort for the next test
    assert aborted() is None
