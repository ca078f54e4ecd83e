"""A run restarted by its launcher (torchrun ``--max-restarts``, a Slurm requeue, a Kubernetes pod restart) picks up
from the latest complete checkpoint in its run directory by itself, and says so.

torchrun numbers its restarts in ``TORCHELASTIC_RESTART_COUNT`` and Slurm its requeues in ``SLURM_RESTART_COUNT``; a
job ``hal train --emit`` printed also sets ``HAL_RESUME=auto``, so a resubmitted job or a recreated pod, which
starts torchrun afresh, continues too. On a restart every rank resumes from the checkpoint ``latest`` names (only
complete checkpoints are ever named there: ``parallel.state.checkpoint``); with ``auto`` and no checkpoint yet, the
run starts from step 0 as a first start. The data are a pure
function of (seed, step), so the steps after it are the same steps again, and the final losses equal an
uninterrupted run's. The writer appends one line to ``train.jsonl`` — ``{"restart": N, "resumed_at_step": K,
"redone_steps": R}``, R being the steps logged before the failure that the resumed run does again — and the
summary lists every such line under ``restarts``.

The checkpoint cadence bounds what a restart redoes, and costs the time its writes take: ``cadence`` suggests one
from the run's measured step and write times (the summary's ``checkpoint_cadence``, a line of ``hal train``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
COUNTERS = (RESTART_ENV, "SLURM_RESTART_COUNT")  # the launchers' own restart numbers
RESUME_ENV = "HAL_RESUME"  # "auto": resume from the run directory's latest complete checkpoint wherever one exists


@dataclass(frozen=True)
class Restart:
    count: int
    checkpoint: Path | None  # where this incarnation resumes (None: no checkpoint was completed: from the start)


def restarted(checkpoint_dir: Path | None, log_file: Path | None = None) -> Restart | None:
    """This incarnation's restart, or None on a first start: a launcher's restart count above 0, or ``HAL_RESUME=auto``
    with a complete checkpoint in the run directory (its count then one more than the restarts ``log_file`` holds)."""
    from hal.parallel.state.checkpoint import latest_written

    counts = [int(v) for name in COUNTERS if (v := os.environ.get(name, "0")).isdigit()]
    count = max(counts, default=0)
    latest = latest_written(checkpoint_dir) if checkpoint_dir is not None else None
    if count == 0:
        if os.environ.get(RESUME_ENV) != "auto" or latest is None:
            return None
        count = len(restart_records(log_file)) + 1
    return Restart(count, latest)


def _records(log_file: Path | None) -> Iterator[dict[str, Any]]:
    """The JSON objects of ``train.jsonl`` (none where it cannot be read; a line a failure cut mid-write skipped)."""
    if log_file is None:
        return
    try:
        with open(log_file, encoding="utf-8") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield record
    except OSError:
        return


def last_logged_step(log_file: Path) -> int:
    """The last step line ``train.jsonl`` holds (0 when none): what a failure cut short, for the restart's line."""
    return max((r["step"] for r in _records(log_file) if isinstance(r.get("step"), int)), default=0)


def restart_record(restart: Restart, start: int, log_file: Path) -> dict[str, Any]:
    return {"restart": restart.count, "resumed_at_step": start, "redone_steps": max(0, last_logged_step(log_file) - start)}


def restart_records(log_file: Path | None) -> list[dict[str, Any]]:
    """Every restart line of ``train.jsonl``, for the summary."""
    return [r for r in _records(log_file) if "restart" in r]


CHECKPOINT_SHARE = 0.05  # the suggested cadence keeps checkpoint writes under 5 % of the training time


def cadence(step_s: float, write_s: float, every: int | None) -> dict[str, Any]:
    """The checkpoint interval that keeps writes under ``CHECKPOINT_SHARE`` of the time, from a step's and a write's
    measured seconds, and what a restart then redoes at most; beside the run's own ``checkpoint_every``."""
    suggested = max(1, math.ceil(write_s / (CHECKPOINT_SHARE * step_s))) if step_s > 0 else 1
    return {"step_s": step_s, "write_s": write_s, "every": every, "suggested_every": suggested,
            "redo_at_most_s": (suggested - 1) * step_s,
            "line": (f"writing a checkpoint took {write_s:.2f} s and a step {step_s:.3f} s: checkpoint_every {suggested} keeps "
                     f"the writes under {CHECKPOINT_SHARE:.0%} of the time, and a restart then redoes at most {suggested - 1} "
                     f"step(s) ({(suggested - 1) * step_s:.1f} s)" + (f"; this run wrote every {every}" if every else ""))}
