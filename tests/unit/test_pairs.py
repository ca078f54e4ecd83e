"""DualPipeV's pairs at once: where a stage runs them so (``schedules.pairs``), and the runner's threads (``pipeline.pairs``)."""
from __future__ import annotations

import threading

import pytest
import torch

from hal.parallel.pipeline.pairs import PairRunner
from hal.parallel.schedules.pairs import ENV, why_not


@pytest.mark.parametrize("setting,tp,ep,moe,compiled,expected", [
    (None, 1, 1, False, False, None),
    (None, 1, 1, False, True, "compiled layers"),  # the interpreter's lock: at once measured slower
    ("1", 1, 1, False, True, None),
    ("0", 1, 1, False, False, f"{ENV}=0"),
    ("1", 2, 1, False, False, "tensor parallelism"),  # collectives inside the compute: never at once
    ("1", 1, 2, False, False, "expert parallelism"),
    ("1", 1, 1, True, False, "the MoE balancing sum over dp"),
])
def test_why_a_stage_runs_its_pairs_in_turn(monkeypatch: pytest.MonkeyPatch, setting: str | None, tp: int, ep: int,
                                            moe: bool, compiled: bool, expected: str | None) -> None:
    if setting is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, setting)
    why = why_not(tp, ep, moe, compiled)
    assert why == expected if expected is None else why.startswith(expected), why


def test_a_bad_setting_is_refused_with_the_values_that_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from hal.errors import ConfigError

    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ConfigError, match="use 0 .every pair in turn., 1"):  # the CLI: one line, exit 2
        why_not(1, 1, False, False)


def test_the_forward_runs_on_the_pair_thread_while_the_backward_runs_here() -> None:
    from hal import get_backend

    runner = PairRunner(get_backend("cpu"), torch.device("cpu"))
    both, here = threading.Barrier(2, timeout=30), threading.current_thread()

    def forward() -> str:
        both.wait()  # passes only while the backward is running too (one after the other: BrokenBarrierError)
        return threading.current_thread().name

    def backward() -> str:
        both.wait()
        return threading.current_thread().name

    there, mine = runner.run(forward, backward)
    assert there.startswith("hal-pair") and mine == here.name and runner.ran == 1
    runner.close()


def test_an_error_on_either_side_is_raised_after_both_finished() -> None:
    from hal import get_backend

    runner = PairRunner(get_backend("cpu"), torch.device("cpu"))
    finished = threading.Event()

    def slow_forward() -> None:
        finished.wait(0.2)
        finished.set()

    def failing_backward() -> None:
        raise RuntimeError("backward broke")

    with pytest.raises(RuntimeError, match="backward broke"):
        runner.run(slow_forward, failing_backward)
    assert finished.is_set() and runner.ran == 0  # the forward had finished before the error came out

    def failing_forward() -> None:
        raise RuntimeError("forward broke")

    with pytest.raises(RuntimeError, match="forward broke"):
        runner.run(failing_forward, lambda: None)
    runner.close()


def test_a_stage_says_in_turn_only_where_its_own_layers_sum_a_balancing_loss_over_dp(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MoE model whose first two layers are dense: the dp2 stage holding them runs its pairs at once, the dp2 stage
    holding MoE layers in turn (the balancing sum over dp); a schedule without pairs says nothing."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.schedules.pairs import stage_pairs

    monkeypatch.delenv(ENV, raising=False)
    model = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=256,
                        max_seq_len=64, moe_num_experts=4, moe_ffn_hidden_size=64, moe_first_dense=2)
    stages = [{"backend": "cpu", "devices": 2, "layers": 2, "dp": 2}, {"backend": "cpu", "devices": 2, "layers": 2, "dp": 2}]
    plan = parse_plan({"schedule": "dualpipev", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
                       "stages": stages})
    how = [stage_pairs(plan.schedule, plan.num_stages, plan.micro_batches, m, model) for m in Topology.from_plan(plan).stages]
    assert [h.split(":")[0] for h in how] == ["in turn", "in turn"]  # the V: each stage holds a dense and an MoE layer
    assert all("the MoE balancing sum over dp" in h for h in how)
    dense_first = ModelConfig(**{**model.to_dict(), "moe_first_dense": 3})  # only layer 3 (stage 0's second chunk) is MoE
    assert [stage_pairs(plan.schedule, 2, 4, m, dense_first) for m in Topology.from_plan(plan).stages][1] == "at once"
    one_f = parse_plan({"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2, "stages": stages})
    assert [stage_pairs(one_f.schedule, 2, 4, m, model) for m in Topology.from_plan(one_f).stages] == [None, None]
