"""The pipeline benchmark runs end to end on CPU/gloo (tiny model): both schedules, every stage reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.pipeline import PRESETS, flops_per_token, parameter_counts
from hal.parallel.schedules import get_schedule

from ..plain_client import run_plain, shared

ROOT = Path(__file__).resolve().parents[2]


def test_parameter_count_matches_the_built_model() -> None:
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.stage import full_model

    model = PRESETS["tiny"]
    built = sum(p.numel() for p in full_model(ModelConfig(**model), seed=0).parameters())
    assert parameter_counts(model)["total"] == built
    assert flops_per_token(model, 64) > 6 * (built - parameter_counts(model)["embedding"])


def _benchmark(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/pipeline.py ARGS``, forked from the plain server (torch imported once; its ranks' zygote
    is then the benchmark's own fork); ``HAL_TEST_FORK=0``: a fresh interpreter."""
    argv = [str(ROOT / "benchmarks" / "pipeline.py"), *args]
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return run_plain(shared(), argv, {**os.environ, "PYTHONPATH": str(ROOT)}, ROOT, timeout)


def test_tiny_pipeline_benchmark_on_cpu() -> None:
    out = _benchmark(["--backend", "cpu", "--preset", "tiny", "--steps", "1",
         "--rounds", "1", "--warmup", "1", "--micro-batches", "4", "--micro-batch-size", "2", "--json", "--timeout", "240"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["stages"] == 4 and len(summary["per_stage"]) == 4
    assert summary["tokens_per_s"]["ours"] > 0 and summary["tokens_per_s"]["torch"] > 0
    assert summary["bubble_ideal"] == pytest.approx(3 / 7)
    assert all(0.0 <= s["idle_fraction"] < 1.0 for s in summary["per_stage"])
    assert all(0.0 <= s["idle_simulated"] < 1.0 for s in summary["per_stage"])


# the chunked path once with a played order (zbv) and once with a fixed one (dualpipev); interleaved 1F1B takes the same
# path (its equivalence is tests/ranks/test_engine.py's), left out to keep the suite inside its time
@pytest.mark.parametrize("schedule,torch_schedule,ideal", [("zbv", "ScheduleZBVZeroBubble", 0.5 / 12.5),
                                                              ("dualpipev", "ScheduleDualPipeV", 1 / 13)])
def test_chunked_benchmarks_run_torchs_schedule_on_the_same_chunks(schedule: str, torch_schedule: str, ideal: float) -> None:
    played = get_schedule(schedule).plays_times  # zbv: our engine on the order played from measured times, as hal train
    out = _benchmark(["--backend", "cpu", "--preset", "tiny", "--steps", "1",
         "--rounds", "1", "--warmup", "1", "--stages", "2", "--micro-batches", "4", "--schedule", schedule,
         *(["--order", "measured"] if played else []), "--json", "--timeout", "240"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["virtual_stages"] == 2 and summary["torch_schedule"] == torch_schedule
    if played:
        assert summary["order"]["chosen"] in ("unit", "measured") and summary["order"]["said"].startswith(f"{schedule} order from")
    else:
        assert summary["order"] == {"chosen": "unit"}
    assert summary["bubble_ideal"] == pytest.approx(ideal) and summary["tokens_per_s"]["torch"] > 0


def test_master_weights_runs_both_schedules_in_hal_trains_precision() -> None:
    out = _benchmark(["--backend", "cpu", "--preset", "tiny", "--stages", "2",
         "--steps", "1", "--rounds", "1", "--warmup", "1", "--micro-batches", "2", "--master-weights", "--json", "--timeout", "240"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["master_weights"] is True and summary["tokens_per_s"]["torch"] > 0


def test_zero_bubble_with_a_fused_head_is_refused_in_one_line() -> None:
    out = _benchmark(["--backend", "cpu", "--preset", "tiny",
                          "--schedule", "zero-bubble", "--fused-head"], timeout=60)
    assert out.returncode == 2 and "drop --fused-head" in out.stderr.strip().splitlines()[-1]


def test_our_own_1f1b_is_the_baseline_a_split_backward_with_a_fused_head_can_take() -> None:
    """``--baseline 1f1b``: the zero-bubble family against our 1F1B on the same layers a stage (the issue's
    comparison), where torch's classes cannot split the fused head; compiled, torch's baseline is refused."""
    out = _benchmark(["--backend", "cpu", "--preset", "tiny", "--stages", "2", "--steps", "1", "--rounds", "1",
                      "--warmup", "1", "--micro-batches", "4", "--schedule", "zero-bubble", "--fused-head",
                      "--baseline", "1f1b", "--json", "--timeout", "240"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["baseline"] == "1f1b" and summary["torch_schedule"] is None
    assert summary["tokens_per_s"]["ours"] > 0 and summary["tokens_per_s"]["torch"] > 0
    refused = _benchmark(["--backend", "cpu", "--preset", "tiny", "--schedule", "zbv", "--compile"], timeout=60)
    assert refused.returncode == 2 and "add --baseline 1f1b" in refused.stderr.strip().splitlines()[-1]


def test_dualpipev_pairs_at_once_against_the_same_engine_in_turn() -> None:
    """``--baseline in-turn``: DualPipeV with its pairs at once (cpu stages too) against the same engine running them
    one after the other; any other schedule is refused in one line."""
    out = _benchmark(["--backend", "cpu", "--preset", "tiny", "--stages", "2", "--steps", "1", "--rounds", "1",
                      "--warmup", "1", "--micro-batches", "4", "--schedule", "dualpipev", "--baseline", "in-turn",
                      "--json", "--timeout", "240"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["baseline"] == "in-turn" and summary["tokens_per_s"]["torch"] > 0
    for stage in summary["per_stage"]:  # stage 0 pairs 3 a step at M=4, stage 1 pairs 4
        assert stage["pairs"]["how"] == "at once" and stage["pairs"]["at_once"] >= 3, stage
    refused = _benchmark(["--backend", "cpu", "--preset", "tiny", "--schedule", "zbv", "--baseline", "in-turn"], timeout=60)
    assert refused.returncode == 2 and "has no pairs" in refused.stderr.strip().splitlines()[-1]
