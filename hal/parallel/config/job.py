"""The job file: one validated training run, written once by ``hal train`` and read by every rank.

Why: ``hal train`` validates the YAML before anything starts; ranks used to re-read and re-validate
it (the backend looked up again, the topology rebuilt, the precision resolved again). Now the
parent writes ``<run dir>/job.json`` once, atomically — the run config as validated plain data
(its replicas), each stage's precision plan, the step counts and the paths — and every rank loads it
with ``load_job``: no YAML, no re-validation, only the schema version is checked.

Format (``JOB_SCHEMA`` 2), a JSON object:

    schema            2
    config            the YAML the parent validated (recorded in the summary and checkpoints; never read by a rank)
    hal               {backend, devices, precision, fallback} as resolved from file, environment and flags
    model, train      the validated sections (ModelConfig, TrainConfig as dicts)
    replicas          the run's replicas (``ReplicatedPlan.to_dict``: a plain plan is the set of one), each with
                      its plan and rows; every topology follows from them
    stage_precision   one entry per stage of every replica in order: the PrecisionPlan resolved by the parent (hal.precision), or null
                      where the parent could not see that stage's devices (``--print-multinode``): that
                      stage's ranks resolve it on their own device
    steps, start      train until ``steps`` steps are done; ``start`` were done already (from the checkpoint)
    run_dir, log_file, checkpoint_dir, resume   paths (checkpoint_dir and resume may be null)
    init_from         a Hugging Face checkpoint directory the ranks slice their weights from, or null
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.planned import Planned
from hal.parallel.config.replicas import ReplicatedPlan
from hal.parallel.config.run import TrainConfig
from hal.parallel.config.topology import Topology
from hal.run_dirs import read_limited, write_text_atomic

JOB_FILE = "job.json"
JOB_SCHEMA = 2  # 2: the replicas only (1 had a plan and a topology beside them)


@dataclass(frozen=True)
class Job:
    """A validated run: what every rank is told, decided before any process starts."""

    config: str
    hal: Mapping[str, Any]  # backend, devices, precision, fallback
    model: ModelConfig
    replicas: ReplicatedPlan  # every replica's plan and rows (a plain plan: the set of one)
    train: TrainConfig
    stage_precision: tuple[Mapping[str, Any] | None, ...]  # PrecisionPlan.to_dict() per stage of every replica, or None
    steps: int
    start: int  # steps already done (from the checkpoint)
    run_dir: Path
    log_file: Path
    checkpoint_dir: Path | None
    resume: Path | None  # the resolved checkpoint directory
    profile: bool = False  # per-phase times on accelerators, from device events (one wait a step)
    init_from: Path | None = None  # a Hugging Face checkpoint directory the weights are sliced from (not when resuming)
    cpu_binding: str = "none"  # none | cores: each local rank pinned to a block of cores (``hal.launch.cpu_binding``)
    # the launcher's only: the planner's prediction the config keeps (``planner.planned``), drawn beside the measured
    # timeline; not in the job file (no rank needs it)
    planned: Planned | None = None

    @property
    def plan(self) -> ParallelPlan:
        """The plan of a run of one replica (``ReplicatedPlan.plan``: several replicas have several)."""
        return self.replicas.plan

    @property
    def world_size(self) -> int:
        """Ranks of the run: every replica's."""
        return self.replicas.world_size

    @property
    def writer(self) -> int:
        """The rank that logs: the first of the stage holding the loss (the first stage under zbv), replica 0's."""
        return self.replicas.writer

    def topologies(self) -> list[Topology]:
        """Each replica's topology over its own ranks, in replica order."""
        return self.replicas.topologies()

    def plans(self) -> list[ParallelPlan]:
        """Each replica's plan, in replica order."""
        return self.replicas.plans()

    def timeline_files(self) -> list[str]:
        """What ``hal train --profile`` leaves in the run directory for its last step: timeline.json, or one a replica."""
        return self.replicas.timeline_files()

    @property
    def precision(self) -> str:
        return str(self.hal["precision"])

    @property
    def fallback(self) -> str:
        return str(self.hal["fallback"])

    @property
    def path(self) -> Path:
        """Where ``hal train`` writes this job and where its ranks read it."""
        return self.run_dir / JOB_FILE

    def rank_args(self) -> list[str]:
        """Arguments of ``python -m hal.parallel.loop.trainer`` (the same on every rank): the job file only."""
        return [str(self.path)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": JOB_SCHEMA, "config": self.config, "hal": dict(self.hal),
            "model": self.model.to_dict(), "train": self.train.to_dict(), "replicas": self.replicas.to_dict(),
            "stage_precision": [None if p is None else dict(p) for p in self.stage_precision],
            "steps": self.steps, "start": self.start, "run_dir": str(self.run_dir), "log_file": str(self.log_file),
            "checkpoint_dir": _str_or_none(self.checkpoint_dir), "resume": _str_or_none(self.resume),
            "profile": self.profile, "init_from": _str_or_none(self.init_from), "cpu_binding": self.cpu_binding,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        """Rebuild what the parent wrote; the parent validated it, so nothing is checked again."""
        return cls(
            data["config"], dict(data["hal"]), ModelConfig(**data["model"]), ReplicatedPlan.from_dict(data["replicas"]),
            TrainConfig(**data["train"]), tuple(data["stage_precision"]), int(data["steps"]), int(data["start"]),
            Path(data["run_dir"]), Path(data["log_file"]), _path_or_none(data["checkpoint_dir"]),
            _path_or_none(data["resume"]), bool(data.get("profile", False)), _path_or_none(data.get("init_from")),
            str(data.get("cpu_binding", "none")),
        )


def _str_or_none(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _path_or_none(text: str | None) -> Path | None:
    return None if text is None else Path(text)


def job_text(job: Job) -> str:
    return json.dumps(job.to_dict(), indent=2) + "\n"


def write_job(job: Job) -> Path:
    """Write ``job.path`` atomically (a rank never sees half a file); creates the run directory."""
    write_text_atomic(job.path, job_text(job))
    return job.path


MAX_JOB_BYTES = 16 * 2**20  # a job file is kilobytes: the model, the plan, the train settings


def load_job(path: str | os.PathLike[str]) -> Job:
    """The job ``hal train`` wrote at ``path``; one ConfigError line if it is missing, damaged or of another schema."""
    fix = "start ranks with the job.json that hal train wrote"
    raw = read_limited(path, MAX_JOB_BYTES, f"job file {path}", fix)
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"job file {path}: unreadable ({exc}); {fix}") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != JOB_SCHEMA:
        raise ConfigError(f"job file {path}: schema {schema!r} but this hal reads schema {JOB_SCHEMA}; "
                          "write it again with this version's hal train")
    return Job.from_dict(data)


__all__ = ["JOB_FILE", "JOB_SCHEMA", "Job", "job_text", "load_job", "write_job"]
