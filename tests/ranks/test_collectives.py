"""Collectives on real processes (CPU, gloo): every op correct, bad input refused the same way on every rank."""
from __future__ import annotations

import pytest

from ..dist_harness import ok_values as _ok
from ..dist_harness import run_world

CASES = "tests.collective_cases"




@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_op_correct_in_fp32_bf16_int64(world: int) -> None:
    values = _ok(run_world(CASES, "op_matrix", world), world)
    failures = [(rank, name, detail) for rank, rows in values.items() for name, ok, detail in rows if not ok]
    assert not failures, failures
    names = {name for rows in values.values() for name, _, _ in rows}
    for dtype in ("float32", "bfloat16", "int64"):
        assert {f"{dtype} all_gather uneven", f"{dtype} all_to_all uneven", f"{dtype} reduce_scatter sum"} <= names


def test_bad_input_gives_the_same_clear_error_on_every_rank() -> None:
    world = 3
    values = _ok(run_world(CASES, "bad_inputs", world), world)
    expected = {
        "shape": "shape mismatch across ranks",
        "dtype": "dtype mismatch across ranks",
        "device": "rank 1 passed a tensor on the wrong device",
        "op order": "ranks called different collectives",
        "reduce op": "reduce op mismatch",
        "indivisible": "not divisible by the group size 3",
        "int avg": "avg of int64 tensors is not exact",
        "trailing": "shapes differ beyond dim 0",
        "out shape": "all_gather: out is (7,)",
        "p2p shape": "send/recv shape mismatch: rank 0 sends (3,), rank 1 receives into (4,)",
    }
    for scenario, words in expected.items():
        seen = {rank: errors[scenario] for rank, errors in values.items() if scenario in errors}
        assert len(set(seen.values())) == 1, f"{scenario}: ranks disagree: {seen}"
        message = next(iter(seen.values()))
        assert message.startswith("CollectiveError") and words in message, f"{scenario}: {message}"
    assert all(errors["after"] == "[3.0, 3.0]" for errors in values.values())


def test_a_rank_that_never_arrives_times_out_everywhere() -> None:
    world, timeout_s = 3, 2.0
    results = run_world(CASES, "late_rank", world, deadline_s=90, late=2, timeout_s=timeout_s, sleep_s=3 * timeout_s)
    values = _ok(results, world)
    for rank in (0, 1):
        assert values[rank]["error"].startswith("CollectiveTimeout"), values[rank]
        assert "not every rank arrived within 2 s" in values[rank]["error"]
        assert values[rank]["seconds"] < 4 * timeout_s
    assert values[2]["error"] != "no error"  # its peers left: it fails too, it does not hang


def test_declared_ccl_gaps_are_staged_or_refused_visibly() -> None:
    world = 2
    values = _ok(run_world(CASES, "declared_gaps", world), world)
    for v in values.values():
        assert v["staged"] == [3.0, 3.0, 3.0]
        assert v["refused"].startswith("CollectiveError") and "cannot do all_reduce on int16" in v["refused"]
        assert "FallbackRefused" in v["strict"] and "host gloo" in v["strict"]
        assert any("all_reduce on gloo/float64" in d for d in v["downgrades"]), v["downgrades"]


def test_gap_lookup_reads_capability_data() -> None:
    import torch

    from hal import get_backend
    from hal.collectives.communicator import find_gap

    ascend, cuda = get_backend("ascend"), get_backend("cuda")
    assert find_gap(ascend, "all_reduce", torch.float64, "sum").handling == "host"
    assert find_gap(ascend, "all_reduce", torch.bfloat16, "product") is not None
    assert find_gap(ascend, "all_reduce", torch.bfloat16, "sum") is None
    assert find_gap(ascend, "all_gather", torch.float64) is None  # data movement needs no arithmetic
    assert find_gap(cuda, "all_reduce", torch.float64, "sum") is None
