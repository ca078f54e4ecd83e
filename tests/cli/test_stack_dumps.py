"""HAL_DUMP_STACKS_AFTER_S: a rank prints every thread's stack while it hangs; a bad value is one line up front."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO, run_hal


def test_a_rank_prints_its_threads_stacks_after_the_given_seconds() -> None:
    code = ("import time; from hal.collectives.process_groups import _stacks_later; _stacks_later(); "
            "time.sleep(1.6)  # a rank waiting")
    env = {**os.environ, "HAL_DUMP_STACKS_AFTER_S": "0.5", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("most recent call first") >= 2, result.stderr  # repeated every 0.5 s
    assert "<string>" in result.stderr  # the waiting line itself


def test_a_bad_value_is_one_line_before_any_rank_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_hal("train", str(REPO / "examples" / "tiny_cpu.yaml"), "--steps", "1", "--run-dir", str(run_dir),
                     env={"HAL_DUMP_STACKS_AFTER_S": "soon"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["hal: error: HAL_DUMP_STACKS_AFTER_S='soon' is not a positive number "
                                                  "of seconds; e.g. 60"]
    assert not run_dir.exists()
