"""Activation checkpointing per stage: the same numbers as without it, fewer saved activations, and
under TP the documented extra collectives in backward (the recompute)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from .. import checkpointing_cases as cases
from ..dist_harness import ok_values as _ok
from ..dist_harness import run_world
from ..engine_cases import reference


def _assert_identical(row: dict[str, Any]) -> None:
    assert row["names"], "the checkpointed stage has other parameters"
    assert row["loss_equal"], "checkpointing changed the loss"
    assert row["grads_equal"] or row["max_grad_diff"] <= 1e-7, row["max_grad_diff"]


# --- one process ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [range(0, 3), range(1, 3)], ids=["first+last stage", "last stage, hidden input"])
def test_single_process_identical_with_fewer_saved_activations(layers: range) -> None:
    row = cases.compare(cases.measure(False, 128, layers=layers), cases.measure(True, 128, layers=layers))
    _assert_identical(row)
    plain, ckpt = row["saved"]
    assert ckpt["tensors"] < plain["tensors"] and ckpt["bytes"] < plain["bytes"] / 2, row["saved"]


def test_saving_shrinks_to_one_input_per_layer() -> None:
    """What a checkpointed layer keeps is its (B, S, H) input: the saved bytes grow by exactly that per layer."""
    seq = 128
    cfg = cases.config(seq)
    one, two = (cases.measure(True, seq, layers=range(k, 3))["saved"]["bytes"] for k in (2, 1))
    assert two - one == 2 * seq * cfg.hidden_size * 4  # batch 2, fp32


def test_no_grad_forward_skips_checkpointing() -> None:
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import build_stage

    cfg = cases.config(16)
    ids, labels = cases.data(16)
    stages = [build_stage(cfg, range(3), first=True, last=True, tp_comm=None, sp=False, seed=cases.SEED, checkpoint=c) for c in (False, True)]
    with torch.no_grad():
        losses = [vocab_parallel_cross_entropy(s(ids), labels, None) for s in stages]
    assert torch.equal(losses[0], losses[1])


def test_build_stage_default_is_off() -> None:
    from hal.parallel.models.stage import build_stage

    cfg = cases.config(16)
    assert not build_stage(cfg, range(3), first=True, last=True, tp_comm=None, sp=False, seed=0).checkpoint


# --- 3 processes (one launch): a tp=2 group, then a 2-stage pipeline ending in tp2+sp ---------------------------------
@pytest.fixture(scope="module")
def world3() -> dict[int, Any]:
    return _ok(run_world("tests.checkpointing_cases", "world3", 3, deadline_s=300), 3)


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_identical_and_recompute_collectives(world3: dict[int, Any], sp: bool) -> None:
    layers = cases.config(16).num_layers
    rows = [r[f"sp={sp}"] for r in world3.values() if f"sp={sp}" in r]
    assert len(rows) == 2, "both TP ranks report"
    for row in rows:
        _assert_identical(row)
        plain, ckpt = row["saved"]
        assert ckpt["tensors"] < plain["tensors"] and ckpt["bytes"] < plain["bytes"], row["saved"]
        assert row["forward"][0] == row["forward"][1], "checkpointing must not change the forward's collectives"
        extra = {k: ckpt_n - row["backward"][0][k] for k, ckpt_n in row["backward"][1].items()}
        # The recompute repeats, per layer, every forward collective before the layer's last one
        # (whose output feeds no saved tensor, so torch's early stop skips it): see Stage._run_layer.
        want = {"all_reduce": 0, "all_gather": 2 * layers, "reduce_scatter": layers} if sp else \
               {"all_reduce": layers, "all_gather": 0, "reduce_scatter": 0}
        assert extra == want, (row["forward"], row["backward"])


def test_engine_checkpointed_pipeline_follows_single_process(world3: dict[int, Any]) -> None:
    ref = reference(cases.ENGINE_PLAN, cases.ENGINE_STEPS, cases.ENGINE_LR)["losses"]
    for rank, row in world3.items():
        losses = row["engine"]["losses"]
        if row["engine"]["stage"] != 1:
            assert losses == [None] * cases.ENGINE_STEPS
            continue
        assert abs(losses[0] - ref[0]) <= 1e-5 * abs(ref[0]), (rank, losses, ref)
        for got, want in zip(losses, ref):
            assert abs(got - want) <= 1e-4 * abs(want), (rank, losses, ref)
