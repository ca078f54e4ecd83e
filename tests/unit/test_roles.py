"""Roles after rendezvous: whatever order torchrun's c10d rendezvous gave, each island's processes take that island's
plan ranks, ordered by (host, local rank); a world that cannot fill the plan is one line naming the island."""
from __future__ import annotations

import pytest

from hal.collectives.roles import Joined, assign
from hal.errors import ConfigError

PLAN = [("cpu", range(0, 1)), ("ascend", range(1, 3)), ("cambricon", range(3, 4))]


def test_join_order_does_not_decide_a_role() -> None:
    # the cambricon node joined first, then ascend's, then cpu's: torchrun ranks 0, 1-2, 3
    joined = [Joined(0, 2, "n2", 0), Joined(1, 1, "n1", 1), Joined(2, 1, "n1", 0), Joined(3, 0, "n0", 0)]
    assert assign(joined, PLAN) == {3: 0, 2: 1, 1: 2, 0: 3}


def test_a_world_that_cannot_fill_the_plan_names_the_island() -> None:
    joined = [Joined(0, 2, "n2", 0), Joined(1, 1, "n1", 0), Joined(2, 0, "n0", 0)]
    with pytest.raises(ConfigError, match=r"island 1 \(ascend, plan ranks 1-2\) needs 2 process\(es\) and 1 joined"):
        assign(joined, PLAN)
    with pytest.raises(ConfigError, match="HAL_ISLAND_INDEX=5 names no island"):
        assign([*[Joined(i, i if i < 2 else 1, "n", i) for i in range(3)], Joined(3, 2, "n", 3), Joined(4, 5, "n", 4)], PLAN)


def test_the_checkpoint_cadence_keeps_writes_under_five_percent() -> None:
    from hal.parallel.loop.restarts import cadence

    advice = cadence(step_s=0.2, write_s=1.0, every=100)
    assert advice["suggested_every"] == 100 and advice["redo_at_most_s"] == pytest.approx(19.8)  # 1 s / (5 % × 0.2 s)
    assert "checkpoint_every 100" in advice["line"] and "this run wrote every 100" in advice["line"]
    assert cadence(step_s=2.0, write_s=0.01, every=None)["suggested_every"] == 1  # a cheap write: every step


def test_a_restart_is_a_launcher_count_or_auto_resume_with_a_checkpoint(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from hal.parallel.loop.restarts import restarted

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-000010").mkdir(parents=True)
    (checkpoints / "step-000010" / "meta.json").write_text(json.dumps({"step": 10}))
    (checkpoints / "latest").write_text("step-000010")
    log = tmp_path / "train.jsonl"
    log.write_text(json.dumps({"step": 12, "loss": 1.0}) + "\n" + json.dumps({"restart": 1, "resumed_at_step": 5}) + "\n")
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "HAL_RESUME"):
        monkeypatch.delenv(name, raising=False)
    assert restarted(checkpoints, log) is None  # a first start
    monkeypatch.setenv("HAL_RESUME", "auto")  # a resubmitted job: the second restart this log records
    found = restarted(checkpoints, log)
    assert found is not None and found.count == 2 and found.checkpoint == checkpoints / "step-000010"
    assert restarted(tmp_path / "none", log) is None  # auto, and nothing to resume: a first start
    monkeypatch.delenv("HAL_RESUME")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")  # Slurm's requeue
    assert restarted(checkpoints, log).count == 3
