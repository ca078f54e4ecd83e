"""benchmarks/train_vs_engine.py end to end on the cpu (a tiny two-stage pipeline): hal train, its step and its engine."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from ..plain_client import run_plain, shared

ROOT = Path(__file__).resolve().parents[2]
TWO_STAGES = """\
model: {vocab_size: 256, hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, ffn_hidden_size: 128, max_seq_len: 32}
parallel:
  schedule: 1f1b
  micro_batches: 2
  micro_batch_size: 2
  stages:
    - {backend: cpu, devices: 1, layers: 1}
    - {backend: cpu, devices: 1, layers: 1}
train: {steps: 4, lr: 1.0e-3, seed: 0, data: synthetic}
"""
REPLICAS = TWO_STAGES.replace("""  schedule: 1f1b
  micro_batches: 2
  micro_batch_size: 2
  stages:
    - {backend: cpu, devices: 1, layers: 1}
    - {backend: cpu, devices: 1, layers: 1}""", """  replicas:
    - {rows: 2, micro_batch_size: 2, stages: [{backend: cpu, devices: 1, layers: 2}]}
    - {rows: 2, micro_batch_size: 2, stages: [{backend: cpu, devices: 1, layers: 2}]}""")


def _benchmark(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    argv = [str(ROOT / "benchmarks" / "train_vs_engine.py"), *args]
    if os.environ.get("HAL_TEST_FORK", "1") == "0":
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return run_plain(shared(), argv, {**os.environ, "PYTHONPATH": str(ROOT)}, ROOT, timeout)


def test_a_two_stage_pipeline_on_the_cpu_reports_three_rates_against_the_engine(tmp_path: Path) -> None:
    config = tmp_path / "two.yaml"
    config.write_text(TWO_STAGES)
    out = _benchmark([str(config), "--steps", "1", "--rounds", "1", "--warmup", "1", "--json"], timeout=240)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["card"] == "cpu" and result["tokens_per_step"] == 2 * 2 * 32
    rates, ratios = result["tokens_per_s"], result["vs_engine"]
    assert set(rates) == {"engine", "step", "hal_train"} and all(math.isfinite(v) and v > 0 for v in rates.values())
    assert ratios["engine"] == 1.0 and ratios["hal_train"] == rates["hal_train"] / rates["engine"]
    assert not list(tmp_path.glob("**/checkpoints"))  # hal train's run went to a scratch directory, removed


def test_replicas_are_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "replicas.yaml"
    config.write_text(REPLICAS)
    out = _benchmark([str(config)], timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "trains parallel.replicas" in lines[0], out.stderr
