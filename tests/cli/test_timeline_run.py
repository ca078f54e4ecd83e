"""The measured timeline for real: a short 2-stage CPU run's spans, and ``hal train --profile``'s timeline files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ..conftest import run_hal
from ..dist_harness import ok_values, run_world

PLANS = {
    "1f1b": {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
             "stages": [{"backend": "cpu", "devices": 1, "layers": 3}, {"backend": "cpu", "devices": 1, "layers": 1}]},
    "interleaved zero-bubble": {"schedule": "interleaved-zero-bubble", "virtual_stages": 2, "micro_batches": 4,
                                "micro_batch_size": 2,
                                "stages": [{"backend": "cpu", "devices": 1, "layers": 2},
                                           {"backend": "cpu", "devices": 1, "layers": 2}]},
}
PNG = b"\x89PNG\r\n\x1a\n"


def _non_overlapping(spans: list[dict[str, Any]]) -> None:
    for a, b in zip(spans, spans[1:]):
        assert a["end"] <= b["start"], (a, b)


@pytest.mark.parametrize("name", list(PLANS))
def test_every_compute_action_is_a_span_in_program_order_inside_the_step(name: str) -> None:
    values = ok_values(run_world("tests.timeline_cases", "spans_run", 2, deadline_s=120, plan_raw=PLANS[name], steps=2), 2)
    for rank, value in values.items():
        record, program = value["record"], [tuple(a) for a in value["program"]]
        spans = record["spans"]
        computed = [(s["kind"], s["mb"], s["chunk"]) for s in spans if s["kind"] in ("F", "B", "I", "W")]
        assert computed == program, rank
        posts = [s for s in spans if s["kind"] == "p2p" and not s["what"].startswith("wait")]
        assert len(posts) == value["batches"], rank  # every P2P batch of the program was posted once, timed
        start, end = record["schedule"]
        assert start == 0.0
        inside = [s for s in spans if s["kind"] != "grad_sync"]
        assert all(start <= s["start"] <= s["end"] <= end for s in inside), rank
        _non_overlapping(spans)  # one rank does one thing at a time: spans follow each other
        assert [s for s in spans if s["kind"] == "grad_sync"][0]["start"] >= end
        # the spans are the very intervals the step's breakdown sums
        assert sum(s["end"] - s["start"] for s in spans if s["kind"] in ("F", "B", "I", "W")) == pytest.approx(value["compute_s"], abs=1e-9)
        assert sum(s["end"] - s["start"] for s in spans if s["kind"] == "p2p") == pytest.approx(value["p2p_s"], abs=1e-9)


def test_hal_train_profile_writes_timeline_json_and_png(tmp_path: Path) -> None:
    config = tmp_path / "two.yaml"
    config.write_text(json.dumps({
        "backend": "cpu", "precision": "fp32",
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 64, "max_seq_len": 16},
        "parallel": PLANS["1f1b"], "train": {"steps": 2, "lr": 3e-3, "seed": 0, "data": "corpus"}}), encoding="utf-8")
    run_dir = tmp_path / "run"
    result = run_hal("train", str(config), "--run-dir", str(run_dir), "--profile", "--json", timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"{run_dir / 'timeline.png'}" in result.stderr
    assert "hal train: step 2 per rank: computing / in P2P calls / idle, and the simulator's idle for its stage" in result.stderr
    shares = [line for line in result.stderr.splitlines() if line.startswith("hal train:   stage ")]
    assert [line.split(":")[1].strip() for line in shares] == ["stage 0 rank 0", "stage 1 rank 1"], shares
    doc = json.loads((run_dir / "timeline.json").read_text(encoding="utf-8"))
    assert doc["step"] == 2 and doc["clock"] == "host" and doc["aligned"] == "host clock" and doc["unit"] == "s"
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and [r["stage"] for r in doc["ranks"]] == [0, 1]
    for r in doc["ranks"]:
        kinds = [s["kind"] + str(s["mb"]) for s in r["spans"] if s["kind"] in ("F", "B")]
        assert sorted(kinds) == sorted(f"{k}{m}" for k in "FB" for m in range(4))
        _non_overlapping(r["spans"])
        assert r["schedule"][0] >= 0.0 and r["schedule"][1] <= doc["makespan"]
        assert r["compute"] + r["p2p"] + r["idle"] == pytest.approx(1.0)
    # one time axis: stage 1 runs a micro-batch's forward after stage 0's and its backward before stage 0's
    first, second = ({(s["kind"], s["mb"]): s for s in r["spans"] if s["kind"] in ("F", "B")} for r in doc["ranks"])
    for m in range(4):
        assert second[("F", m)]["start"] >= first[("F", m)]["end"]
        assert first[("B", m)]["start"] >= second[("B", m)]["end"]
    predicted = doc["predicted"]
    assert len(predicted["spans"]) == 2 * 2 * 4 and all(f > 0 for f in predicted["forward"] + predicted["backward"])
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG
