"""ZeRO-1 (parallel.loop.zero) equals plain AdamW: dp 1, 2 and 4, both update paths, checkpoints across dp, in the engine."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from hal.parallel.loop.zero import FlatLayout, Zero1AdamW

from .. import zero_cases as cases
from ..dist_harness import ok_values as _ok
from ..dist_harness import run_world
from ..engine_cases import reference

TOL = 1e-6
MODULE = "tests.zero_cases"




@pytest.fixture(scope="module")
def world2() -> dict[int, Any]:
    return _ok(run_world(MODULE, "world2", 2), 2)


@pytest.fixture(scope="module")
def world4() -> dict[int, Any]:
    return _ok(run_world(MODULE, "world4", 4, deadline_s=300), 4)


def _check_dp(row: dict[str, Any], dp: int) -> None:
    assert row["errors"]["step"] <= TOL, row["errors"]
    assert row["errors"]["rs"] <= TOL, row["errors"]
    assert row["state_error"] <= TOL, "full-form state_dict differs from AdamW's"
    assert row["resume_errors"]["rs-loaded"] <= TOL and row["resume_errors"]["plain-loaded"] <= TOL, row["resume_errors"]
    assert row["state_numel"] == -(-row["total"] // dp), "each rank must hold only its 1/dp of the state"


# --- pure helpers (no processes) -----------------------------------------------------------------------
def test_flat_layout_pieces_cover_every_element_once() -> None:
    layout = FlatLayout((15, 3, 21), 4)
    assert (layout.total, layout.shard, layout.padded) == (39, 10, 40)
    seen = [(i, k) for r in range(4) for i, a, b in layout.pieces(r) for k in range(a, b)]
    assert seen == [(i, k) for i, n in enumerate(layout.numels) for k in range(n)]
    assert layout.pieces(1) == [(0, 10, 15), (1, 0, 3), (2, 0, 2)]  # a shard may span several parameters
    assert layout.pieces(3) == [(2, 12, 21)]  # flat 30..38, then one element of padding


def test_dp1_without_communicator_is_plain_adamw() -> None:
    base = cases.tiny_model()
    ref, zero = cases._Run(base, lambda ps: torch.optim.AdamW(ps, **cases.ADAMW)), cases._Run(base, lambda ps: Zero1AdamW(ps, None, **cases.ADAMW))
    for step in range(cases.STEPS):
        for run in (ref, zero):
            run.opt.zero_grad()
            cases.local_backward(run.model, step, 0)
            run.opt.step()
    assert not zero.opt.sharded
    assert all(torch.equal(p, q) for p, q in zip(zero.model.parameters(), ref.model.parameters()))
    assert cases.state_error(zero.opt.state_dict(), ref.opt.state_dict()) == 0.0


def test_mixed_dtypes_are_refused() -> None:
    from hal.parallel.loop.zero import _check_flattenable

    with pytest.raises(ValueError, match="share dtype and device"):
        _check_flattenable([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])


# --- 2 processes ---------------------------------------------------------------------------------------------
def test_dp2_matches_adamw(world2: dict[int, Any]) -> None:
    for row in world2.values():
        _check_dp(row["dp2"], 2)


def test_dp1_group_is_bitwise_adamw(world2: dict[int, Any]) -> None:
    for row in world2.values():
        assert row["dp1"] == {"bitwise": True, "sharded": False, "state_error": 0.0}


# --- 4 processes ---------------------------------------------------------------------------------------------
def test_dp4_matches_adamw(world4: dict[int, Any]) -> None:
    for row in world4.values():
        _check_dp(row["dp4"], 4)


def test_dp4_checkpoint_resumes_at_dp2(world4: dict[int, Any]) -> None:
    for row in world4.values():
        assert row["dp4_to_dp2"] <= TOL


def test_engine_tp2_dp2_with_zero1_follows_single_process(world4: dict[int, Any]) -> None:
    ref = reference(cases.ENGINE_PLAN, cases.ENGINE_STEPS, cases.ENGINE_LR)["losses"]
    for rank, row in world4.items():
        for how, losses in row["engine"].items():
            assert abs(losses[0] - ref[0]) <= 1e-5 * abs(ref[0]), (rank, how, losses, ref)
            for got, want in zip(losses, ref):
                assert abs(got - want) <= 1e-4 * abs(want), (rank, how, losses, ref)
