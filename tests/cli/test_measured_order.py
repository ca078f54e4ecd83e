"""``hal train`` with ``parallel.order: measured``: a calibration step, one line saying what it chose, and the chosen
order is what the ranks then run (read back from ``--profile``'s timeline of the last step)."""
from __future__ import annotations

import json
from pathlib import Path

from hal.parallel.schedules import get_schedule
from hal.parallel.schedules.stage_times import StageTimes

from ..conftest import run_hal

PLAN = {"schedule": "zbv", "order": "measured", "micro_batches": 4, "micro_batch_size": 2,
        "stages": [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]}


def _config(tmp_path: Path, steps: int) -> Path:
    config = tmp_path / f"measured{steps}.yaml"
    config.write_text(json.dumps({
        "backend": "cpu", "precision": "fp32",
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 64, "max_seq_len": 16},
        "parallel": PLAN, "train": {"steps": steps, "lr": 3e-3, "seed": 0, "data": "corpus"}}), encoding="utf-8")
    return config


def test_measured_order_calibrates_says_so_and_runs_the_chosen_order(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_hal("train", str(_config(tmp_path, 3)), "--run-dir", str(run_dir), "--profile", timeout=240)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "order from measured times" in line]
    assert len(said) == 1 and said[0].startswith("hal train: step 2: zbv order from measured times (F/I/W ms: stage 0 "), said
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [("order" in r) for r in records] == [False, True, False]
    order = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["order"]
    assert order == records[1]["order"] and order["from_step"] == 3 and order["chosen"] in ("unit", "measured")
    assert order["measured_step_s"] <= order["unit_step_s"] + 1e-12 and len(order["links_s"]) == 1 and order["links_s"][0] > 0
    assert all(f > 0 for row in order["forward_s"] for f in row)
    # the last step (the first after the calibration) ran the chosen order on both ranks
    times = StageTimes.of(order["forward_s"], order["backward_input_s"], order["backward_weight_s"], order["links_s"])
    schedule = get_schedule("zbv").timed(times if order["chosen"] == "measured" else None)
    timeline = json.loads((run_dir / "timeline.json").read_text(encoding="utf-8"))
    for rank in timeline["ranks"]:
        ran = [f"{s['kind']}{s['mb']}" + (f"c{s['chunk']}" if s["chunk"] else "") for s in rank["spans"] if s["kind"] in "FBIW"]
        assert ran == [str(a) for a in schedule.compute_order(2, 4, rank["stage"], 2)], rank["stage"]


def test_too_few_steps_to_calibrate_is_said(tmp_path: Path) -> None:
    result = run_hal("train", str(_config(tmp_path, 2)), "--run-dir", str(tmp_path / "run"), timeout=240)
    assert result.returncode == 0, result.stderr
    assert ("hal train: warning: parallel.order: measured calibrates on the run's step 2 and needs one after it; this run "
            "has 2 step(s) left, so the unit-time order runs throughout") in result.stderr
    assert "order from measured times" not in result.stderr


def test_hal_plan_says_the_order_will_be_measured(tmp_path: Path) -> None:
    result = run_hal("plan", "--config", str(_config(tmp_path, 3)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].endswith("; order played from measured times at hal train's step 2 (parallel.order measured)")


def test_a_replica_of_a_fixed_order_joins_the_calibration_of_one_that_plays(tmp_path: Path) -> None:
    """Replica 0 plays zbv, replica 1 runs 1F1B: every rank joins the gather of the calibration step (ranks of a
    replica that does not calibrate add nothing), so the run neither hangs nor mixes the replicas' figures."""
    config = tmp_path / "replicas.yaml"
    config.write_text(json.dumps({
        "backend": "cpu", "precision": "fp32",
        "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 64, "max_seq_len": 16},
        "parallel": {"replica_sync": {"every": 1}, "replicas": [
            {"rows": 8, "micro_batch_size": 2, "schedule": "zbv", "virtual_stages": 2,
             "stages": [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]},
            {"rows": 4, "micro_batch_size": 2, "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}]},
        "train": {"steps": 3, "lr": 3e-3, "seed": 0, "data": "corpus"}}), encoding="utf-8")
    result = run_hal("train", str(config), "--run-dir", str(tmp_path / "run"), timeout=240)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "order from measured times" in line]
    assert len(said) == 1 and said[0].startswith("hal train: step 2: replica 0: zbv order from measured times"), said
