"""Expert-parallel dispatch and combine on 4 gloo ranks with skewed routing (a rank whose experts get no rows,
an expert that gets most, blocks of zero rows): every row reaches its expert's block, grouped by local expert
and then by source rank, and comes back to where it was; the backward sends the gradients the same way."""
from __future__ import annotations

import pytest
import torch

from ..conftest import has_cuda
from ..dist_harness import ok_values, run_world
from ..moe_dispatch_cases import rows_of, skewed_load


@pytest.mark.parametrize("world,local,validate", [(4, 2, True), (2, 3, False), (4, 1, False)])
def test_dispatch_groups_rows_by_expert_and_combine_returns_them(world: int, local: int, validate: bool) -> None:
    values = ok_values(run_world("tests.moe_dispatch_cases", "exchange", world, deadline_s=120, local=local,
                                 validate=validate), world)
    _check(values, world, local)
    assert not any(v["grouped"] for v in values.values())  # gloo: one all-to-all per local expert


def _gpus() -> int:
    from hal import get_backend

    return get_backend("cuda").device_count() if has_cuda() else 0


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ NVIDIA GPUs")
@pytest.mark.parametrize("local", [1, 2, 3])
def test_dispatch_on_nccl_is_one_grouped_launch_and_exact(local: int) -> None:
    world = min(_gpus(), 4)
    values = ok_values(run_world("tests.moe_dispatch_cases", "exchange", world, backend="cuda", deadline_s=300,
                                 local=local, validate=False, dtype="bfloat16"), world)
    _check(values, world, local)  # the row labels are small integers: exact in bf16
    assert all(v["grouped"] for v in values.values())


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ NVIDIA GPUs")
@pytest.mark.parametrize("local,rounds,hold,pool_mib,copied", [
    (1, 3, False, None, 0), (2, 3, False, None, 0), (3, 3, False, None, 0),  # durable slots, freed every round
    (2, 3, False, 0, 6),  # no durable slots: both forward exchanges of every round land in staging and copy
    (2, 18, True, None, 4),  # every round held: 16 take the durable slots, the last two land in staging
])
def test_symmetric_exchange_lands_rows_as_the_all_to_alls_do(local: int, rounds: int, hold: bool,
                                                             pool_mib: int | None, copied: int) -> None:
    """The exchange over CUDA symmetric memory: the same blocks, rows home, gradients back, round after round,
    so the staging slots alternate and are reused. Held rounds are read after every later round ran: a durable
    slot handed out as a result is never written again while it is held."""
    world = min(_gpus(), 4)
    values = ok_values(run_world("tests.moe_dispatch_cases", "exchange", world, backend="cuda", deadline_s=300,
                                 local=local, validate=False, dtype="bfloat16", path="symmetric", rounds=rounds,
                                 hold=hold, pool_mib=pool_mib), world)
    for i in range(rounds):
        _check({rank: v["rounds"][i] for rank, v in values.items()}, world, local)
    for v in values.values():
        assert v["copied"] == copied and v["durable"] == (0 if pool_mib == 0 else 16), v


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ NVIDIA GPUs")
def test_a_dispatch_left_uncombined_is_refused_on_every_rank() -> None:
    world = min(_gpus(), 4)
    values = ok_values(run_world("tests.moe_dispatch_cases", "uncombined_dispatch", world, backend="cuda",
                                 deadline_s=300), world)
    assert all("another exchange ran between a dispatch and its combine" in v for v in values.values()), values


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ NVIDIA GPUs")
def test_an_moe_block_computes_the_same_through_either_exchange() -> None:
    """bf16 experts through the grouped matmul: the symmetric exchange feeds them a worst-case-sized tensor whose
    tail is never written (NaN-filled here); outputs and every gradient match the all-to-all path's."""
    world = min(_gpus(), 4)
    values = ok_values(run_world("tests.moe_dispatch_cases", "moe_block_paths", world, backend="cuda", deadline_s=300), world)
    for v in values.values():
        assert v["paths"] == ["all_to_all", "symmetric"] and v["finite"] and v["same_params"], v
        assert v["out"] < 1e-2 and v["x_grad"] < 1e-2 and max(v["grads"].values()) < 1e-2, v


def test_the_exchange_choice_on_cpu_is_the_all_to_alls_and_says_why() -> None:
    values = ok_values(run_world("tests.moe_dispatch_cases", "exchange_choice", 2, deadline_s=60, asked=None), 2)
    assert all(v["path"] == ["all_to_all", "the device is cpu, not cuda"] for v in values.values()), values


@pytest.mark.parametrize("asked,said", [
    ("symmetric", "CollectiveError: HAL_MOE_EXCHANGE=symmetric cannot run: the device is cpu, not cuda; unset it"),
    ("fast", "CollectiveError: HAL_MOE_EXCHANGE='fast' is not a choice; use one of auto, symmetric, all_to_all")])
def test_an_exchange_that_cannot_be_had_is_one_line(asked: str, said: str) -> None:
    values = ok_values(run_world("tests.moe_dispatch_cases", "exchange_choice", 2, deadline_s=60, asked=asked), 2)
    assert all(v["error"].startswith(said) and "\n" not in v["error"] for v in values.values()), values


def _check(values: dict, world: int, local: int) -> None:
    sent = [rows_of(s, skewed_load(s, world, local), world, local) for s in range(world)]
    for rank, v in values.items():
        # what this rank's local expert j gets: every source's rows for it, source by source
        want, counts = [], []
        for j in range(local):
            mine = [b[b[:, 1] == rank * local + j] for b in sent]
            want += mine
            counts.append(sum(int(m.shape[0]) for m in mine))
        want_rows = torch.cat(want)
        assert v["counts"] == counts
        torch.testing.assert_close(torch.tensor(v["arrived"], dtype=torch.float64).reshape(-1, 3), want_rows, rtol=0, atol=0)
        # combine brings each row home, scaled by its expert's factor; the gradient of the sum is that factor
        rows = torch.tensor(v["rows"], dtype=torch.float64).reshape(-1, 3)
        factor = 2.0 + (rows[:, 1:2] % local)
        torch.testing.assert_close(torch.tensor(v["back"], dtype=torch.float64).reshape(-1, 3), rows * factor, rtol=0, atol=0)
        torch.testing.assert_close(torch.tensor(v["grad"], dtype=torch.float64).reshape(-1, 3), factor.expand(-1, 3), rtol=0, atol=0)
        assert sum(v["send"]) == rows.shape[0] and (v["recv"] is None or sum(v["recv"]) == sum(counts))
    if world == 4:
        assert values[world - 1]["counts"] == [0] * local  # the last rank's experts got nothing


def test_malformed_block_tables_are_one_error_each() -> None:
    values = ok_values(run_world("tests.moe_dispatch_cases", "bad_blocks", 2, deadline_s=60), 2)
    said = values[0]
    assert said == values[1]
    assert all(text.startswith("CollectiveError: all_to_all_blocks:") and "\n" not in text for text in said.values()), said
    assert "send_blocks[0] is [2, 2, 0]" in said["short row"] and "2 non-negative" in said["short row"]
    assert "send_blocks[0] is [5, -1]" in said["negative"]
    assert "add up to 2 rows, the tensor has 4" in said["rows do not add up"]
    assert "1 send rows and 2 receive rows" in said["row counts differ"]
