"""The same collective checks on NCCL: run on a machine with 2+ NVIDIA GPUs (``pytest -m cuda``)."""
from __future__ import annotations

import pytest

from ..conftest import has_cuda
from ..dist_harness import run_world
from ..ranks.test_collectives import CASES, _ok


def _gpus() -> int:
    from hal import get_backend

    return get_backend("cuda").device_count() if has_cuda() else 0


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_gpus() < 2, reason="needs 2+ NVIDIA GPUs")]


def test_every_op_correct_on_nccl() -> None:
    world = min(_gpus(), 4)
    values = _ok(run_world(CASES, "op_matrix", world, backend="cuda", deadline_s=300), world)
    failures = [(rank, name, detail) for rank, rows in values.items() for name, ok, detail in rows if not ok]
    assert not failures, failures


def test_bad_input_same_error_on_every_rank_on_nccl() -> None:
    world = min(_gpus(), 3)
    if world < 3:
        pytest.skip("the scenarios use 3 ranks")
    values = _ok(run_world(CASES, "bad_inputs", world, backend="cuda", deadline_s=300), world)
    for scenario in ("shape", "dtype", "device", "op order", "trailing"):
        assert len({errors[scenario] for errors in values.values()}) == 1, scenario
        assert next(iter(values.values()))[scenario].startswith("CollectiveError")
