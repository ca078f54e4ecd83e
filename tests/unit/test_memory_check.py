"""The training state's lower bound: refused in one line before anything starts when it cannot fit."""
from __future__ import annotations

from pathlib import Path

import pytest

from hal.errors import ConfigError
from hal.parallel.config.memory import GIB, MemoryPool, check_memory, layer_parameters, rank_bytes, stage_parameters
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan
from hal.parallel.config.run import load_run_config
from hal.parallel.loop.preflight import check_training

REPO = Path(__file__).resolve().parents[2]


def _plan(*stages: StagePlan, zero1: bool = False) -> ParallelPlan:
    return ParallelPlan(tuple(stages), "1f1b", len(stages), 2, zero1)


def test_parameter_count_matches_the_built_model() -> None:
    from hal.parallel.models.stage import full_model

    for tied in (False, True):
        model = ModelConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                            tie_embeddings=tied)
        built = full_model(model, seed=0)
        assert stage_parameters(model, _plan(StagePlan("cpu", 1, 3)), 0) == sum(p.numel() for p in built.parameters())
        assert layer_parameters(model) == sum(p.numel() for p in built.layers["0"].parameters())


def test_tp_and_zero1_shrink_a_ranks_share() -> None:
    model = ModelConfig(hidden_size=64, num_layers=4)
    plain = rank_bytes(model, _plan(StagePlan("cpu", 2, 4, dp=2)), 0)
    assert rank_bytes(model, _plan(StagePlan("cpu", 2, 4, tp=2)), 0) == pytest.approx(plain / 2, rel=0.01)
    assert rank_bytes(model, _plan(StagePlan("cpu", 2, 4, dp=2), zero1=True), 0) == pytest.approx(plain * 12 / 16, rel=0.01)


def test_zero1_past_dp_8_and_expert_parallelism_shrink_a_ranks_share() -> None:
    """ZeRO-1 over 16 replicas keeps 8/16 bytes of AdamW state a parameter (not 0); routed experts split over ep,
    and under ZeRO-1 their state over the dp / ep replicas of each shard, as the built shards are."""
    from hal.parallel.config.memory import routed_expert_parameters
    from hal.parallel.models.stage import full_model

    model = ModelConfig(hidden_size=64, num_layers=4)
    plain = rank_bytes(model, _plan(StagePlan("cpu", 16, 4, dp=16)), 0)
    assert rank_bytes(model, _plan(StagePlan("cpu", 16, 4, dp=16), zero1=True), 0) == pytest.approx(plain * 8.5 / 16, rel=1e-6)
    moe = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                      moe_num_experts=4, moe_top_k=2)
    built = full_model(moe, seed=0)
    experts = sum(p.numel() for n, p in built.named_parameters() if ".experts." in n)
    assert experts == sum(routed_expert_parameters(moe, i) for i in range(2))
    dense = sum(p.numel() for p in built.parameters()) - experts
    got = rank_bytes(moe, _plan(StagePlan("cpu", 4, 2, dp=4, ep=2), zero1=True), 0)
    assert got == int(dense * (8 + 8 / 4) + experts / 2 * (8 + 8 / 2))


def test_device_and_host_pools_refuse_what_cannot_fit() -> None:
    model = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=11008)
    plan = _plan(StagePlan("cuda", 1, 16), StagePlan("cuda", 1, 16))
    check_memory(model, plan, {0: MemoryPool("cuda", 80 * GIB), 1: MemoryPool("cuda", 80 * GIB)}, "f.yaml")
    with pytest.raises(ConfigError, match=r"f.yaml: stage 0 needs at least 4\d\.\d GiB a rank .* a cuda device has 40\.0 GiB"):
        check_memory(model, plan, {0: MemoryPool("cuda", 40 * GIB), 1: None}, "f.yaml")
    with pytest.raises(ConfigError, match=r"the cpu ranks need at least .* this host has 64\.0 GiB"):
        check_memory(model, plan, {0: MemoryPool("host", 64 * GIB), 1: MemoryPool("host", 64 * GIB)}, "f.yaml")


def test_hal_train_check_refuses_a_terabyte_model_on_this_host(tmp_path: Path) -> None:
    text = (REPO / "examples" / "hetero_cpu.yaml").read_text()
    big = tmp_path / "big.yaml"
    big.write_text(text.replace("hidden_size: 64", "hidden_size: 65536").replace("ffn_hidden_size: 128", "ffn_hidden_size: 131072"))
    with pytest.raises(ConfigError, match=r"big.yaml: the cpu ranks need at least [\d,.]+ GiB together"):
        check_training(load_run_config(big), "warn")
    check_training(load_run_config(REPO / "examples" / "hetero_cpu.yaml"), "warn")  # the example fits
