"""``hal conformance parity`` end to end on the CPU: a device against itself passes, the reference band is cached and
reused, each planted fault fails the check meant to catch it, and bad input is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import run_hal

# the conformance suite's toy Llama (hidden 64, 4 layers, 32 tokens) for 60 steps: a band in ~7 s, a candidate in ~3 s
TOY = """
backend: cpu
precision: fp32
model: {vocab_size: 256, hidden_size: 64, num_layers: 4, num_heads: 4, num_kv_heads: 2, ffn_hidden_size: 128, max_seq_len: 32}
parallel: {micro_batches: 1, micro_batch_size: 8}
train: {steps: 60, lr: 3.0e-3}
"""

# the checks each fault must fail (it may fail others too)
CAUGHT_BY = {"lr+5%": {"loss band"}, "half-grad": {"per-layer gradients"}, "data-order": {"loss band"},
             "bf16-accumulate": {"per-layer gradients", "loss band"}}


@pytest.fixture
def toy(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "toy.yaml").write_text(TOY)
    return {"config": str(tmp_path / "toy.yaml"), "HAL_CACHE_DIR": str(tmp_path / "cache")}


def _parity(toy: dict[str, str], out: Path, *extra: str) -> tuple[int, dict, str]:
    done = run_hal("conformance", "parity", "--backend", "cpu", "--config", toy["config"], "--report", str(out), "--json",
                   *extra, env={"HAL_CACHE_DIR": toy["HAL_CACHE_DIR"]}, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def test_a_device_against_itself_passes_and_each_planted_fault_fails(toy: dict[str, str], tmp_path: Path) -> None:
    code, doc, err = _parity(toy, tmp_path / "clean")
    assert code == 0 and doc["verdict"] == "pass", err[-2000:]
    assert [c["name"] for c in doc["checks"]] == ["loss band", "gradient norm", "per-layer gradients", "steps to target"]
    assert doc["reference"]["seeds"] == [0, 1, 2, 3] and doc["candidate"]["seeds"] == [0, 1]
    assert doc["reference"]["cached"] is False and "parity: reference seed 0: step" in err  # progress
    assert len(doc["band"]["mean"]) == 60 and doc["training"]["layer_steps"] == [0, 30, 59]
    assert "<svg" in (tmp_path / "clean" / "report.html").read_text() and doc["digest"].startswith("sha256:")
    assert run_hal("conformance", "verify", str(tmp_path / "clean")).returncode == 0
    for fault, checks in CAUGHT_BY.items():
        code, doc, err = _parity(toy, tmp_path / fault, "--plant", fault)
        failed = {c["name"] for c in doc["checks"] if not c["passed"]}
        assert code == 1 and doc["verdict"] == "fail" and checks <= failed, (fault, failed, err[-1500:])
        assert doc["reference"]["cached"] is True and doc["candidate"]["planted_fault"] == fault


@pytest.mark.parametrize(("args", "words"), [
    (["--seeds", "3"], "at least 4 seeds"),
    (["--candidate-seeds", "5"], "give 2 to --seeds"),
    (["--steps", "5"], "give 20 to 100000 steps"),
    (["--plant", "gremlins"], "invalid choice"),
])
def test_bad_input_is_one_line(toy: dict[str, str], tmp_path: Path, args: list[str], words: str) -> None:
    done = run_hal("conformance", "parity", "--backend", "cpu", "--config", toy["config"], *args,
                   "--report", str(tmp_path / "r"))
    assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "r").exists()


def test_a_config_whose_data_is_missing_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(TOY.replace("lr: 3.0e-3}", "lr: 3.0e-3, data: nowhere/tiny.bin}"))
    done = run_hal("conformance", "parity", "--backend", "cpu", "--config", str(tmp_path / "c.yaml"))
    assert done.returncode == 2 and "hal data prepare" in done.stderr and "Traceback" not in done.stderr, done.stderr
