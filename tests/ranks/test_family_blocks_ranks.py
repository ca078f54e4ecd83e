"""Qwen3's and GPT-NeoX's blocks split over processes equal one process: tp 2 (sp off and on: the q/k norms and the
LayerNorms' gradients summed over tp, the row-parallel biases added once) and a 2-stage pipeline."""
from __future__ import annotations

from typing import Any

import pytest

from ..dist_harness import ok_values, run_world

TOL = 1e-5
MODULE = "tests.family_cases"
BASE = {"vocab_size": 128, "hidden_size": 32, "num_layers": 2, "max_seq_len": 16}
MODELS = {
    "qwen3": {**BASE, "family": "qwen3", "num_heads": 4, "num_kv_heads": 2, "head_size": 16, "ffn_hidden_size": 64},
    "gpt_neox": {**BASE, "family": "gpt_neox", "num_heads": 4, "num_kv_heads": 4, "ffn_hidden_size": 96,
                 "activation": "gelu", "rotary_fraction": 0.5, "parallel_residual": True, "norm_eps": 1e-5},
    "gpt_neox_sequential": {**BASE, "family": "gpt_neox", "num_heads": 4, "num_kv_heads": 4, "ffn_hidden_size": 96,
                            "activation": "gelu_tanh", "rotary_fraction": 0.25, "parallel_residual": False},
}


@pytest.fixture(scope="module")
def world2() -> dict[str, dict[int, Any]]:
    return {"tp": ok_values(run_world(MODULE, "tp2", 2, models=MODELS), 2),
            "pp": ok_values(run_world(MODULE, "pipeline2", 2, models=MODELS), 2)}


def _close(loss: float, ref: float) -> bool:
    return abs(loss - ref) <= TOL * abs(ref)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_equals_one_process(world2: dict[str, dict[int, Any]], name: str, sp: bool) -> None:
    for rank, rows in world2["tp"].items():
        row = next(r for r in rows if r["case"] == f"{name} sp={sp}")
        assert _close(row["loss"], row["ref_loss"]), (rank, row["loss"], row["ref_loss"])
        assert row["names"], f"rank {rank}: the gathered gradients' names differ from the reference's"
        bad = {n: e for n, e in row["errors"].items() if not e <= TOL}
        assert not bad, f"{name} sp={sp} rank {rank}: relative gradient errors above {TOL}: {bad}"
        heads, head_dim = MODELS[name]["num_heads"], MODELS[name].get("head_size") or 8
        kv = MODELS[name]["num_kv_heads"]
        assert row["qkv_rows"] == (heads + 2 * kv) * head_dim // 2  # really split: half of the heads a rank


@pytest.mark.parametrize("name", MODELS)
def test_two_stage_pipeline_equals_one_process(world2: dict[str, dict[int, Any]], name: str) -> None:
    rows = {rank: next(r for r in values if r["case"] == name) for rank, values in world2["pp"].items()}
    assert _close(rows[1]["loss"], rows[1]["ref_loss"]), rows[1]
    for rank, row in rows.items():
        bad = {n: e for n, e in row["errors"].items() if not e <= TOL}
        assert not bad, f"{name} stage {rank}: relative gradient errors above {TOL}: {bad}"
    assert any(n.startswith("layers.0.") for n in rows[0]["errors"]) and "norm.weight" in rows[1]["errors"]
