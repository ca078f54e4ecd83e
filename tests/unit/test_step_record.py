"""hal train's step record and summary arithmetic: phases only where they were measured, MFU from the catalog's peaks."""
from __future__ import annotations

import math

import pytest
import torch

from hal.parallel.config.flops import flops_per_token, mfu, model_parameters
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan
from hal.parallel.config.topology import Topology
from hal.parallel.models.stage import full_model
from hal.parallel.observe.records import TIME_FIELDS, step_record

TOPOLOGY = Topology.from_plan(ParallelPlan((StagePlan("cuda", 1, 1), StagePlan("cpu", 1, 1)), "1f1b", 2, 1))


def _row(peak: float, timed: float) -> list[float]:
    values = {"compute": 1.0, "p2p": 0.5, "grad_sync": 0.1, "optimizer": 0.2, "schedule": 2.0, "step": 2.5,
              "peak_tflops": peak, "timed": timed, "peak_memory": 3e9, "replica_sync": 0.0, "replica_bytes": 0.0,
              "replica_early": float("nan")}
    return [values[name] for name in TIME_FIELDS]


def test_phases_are_null_where_an_accelerator_was_not_synchronized() -> None:
    times = torch.tensor([_row(989.0, 0.0), _row(float("nan"), 1.0)], dtype=torch.float64)
    record = step_record(3, 2.0, times, TOPOLOGY, 1000)
    gpu, host = record["stages"]
    assert gpu["compute_s"] is None and gpu["p2p_s"] is None and record["schedule_s"] is None
    assert host["compute_s"] == 1.0 and host["bubble_s"] == pytest.approx(0.5)
    assert record["step_s"] == 2.5 and record["tokens_per_s"] == pytest.approx(400.0)
    assert record["peak_tflops"] is None  # one device's peak is unknown: no MFU rather than a wrong one
    assert gpu["peak_memory_bytes"] == host["peak_memory_bytes"] == 3_000_000_000


def test_profiled_steps_keep_every_phase_and_sum_the_peaks() -> None:
    times = torch.tensor([_row(989.0, 1.0), _row(989.0, 1.0)], dtype=torch.float64)
    record = step_record(1, 2.0, times, TOPOLOGY, 1000)
    assert all(stage["compute_s"] == 1.0 for stage in record["stages"]) and record["schedule_s"] == 2.0
    assert record["peak_tflops"] == pytest.approx(1978.0)


def test_flops_per_token_and_mfu() -> None:
    model = ModelConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, max_seq_len=16)
    assert model_parameters(model) == sum(p.numel() for p in full_model(model, seed=0).parameters())
    per_token = flops_per_token(model, 16)
    assert per_token == 6.0 * (model_parameters(model) - 96 * 32) + 12.0 * 3 * 4 * 8 * 16
    assert mfu(1e6, model, 16, 100.0) == pytest.approx(1e6 * per_token / 100e12)
    assert mfu(None, model, 16, 100.0) is None and mfu(1e6, model, 16, None) is None
    llama_1b = ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=4,
                           ffn_hidden_size=5632, max_seq_len=2048)
    assert model_parameters(llama_1b) == 1_213_302_784 and math.isclose(flops_per_token(llama_1b, 2048), 8_094_560_256.0)
