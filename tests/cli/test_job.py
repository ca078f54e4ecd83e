"""The job file ``hal train`` hands its ranks: written once, read as is, and the only thing a rank reads.

The rank test starts one real rank process (``python -m hal.parallel.loop.trainer``) with the arguments
and environment ``hal train`` gives it, after the YAML it was validated from has been replaced by
garbage: it trains only if the rank never reads the YAML again.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hal.cli.train import multinode_lines
from hal.errors import ConfigError
from hal.launch.env import free_port
from hal.parallel.config.job import JOB_FILE, JOB_SCHEMA, load_job, write_job
from hal.parallel.loop.job_runner import prepare, rank_envs

from ..conftest import REPO

ONE_RANK = """backend: cpu
precision: fp32
model: {vocab_size: 256, hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, ffn_hidden_size: 64, max_seq_len: 16}
parallel:
  micro_batches: 1
  micro_batch_size: 2
  stages:
    - {backend: cpu, devices: 1, layers: 2}
train: {steps: 2, seed: 3, data: synthetic}
"""


def test_job_file_round_trips_what_was_validated(tmp_path: Path) -> None:
    job = prepare(str(REPO / "examples/hetero_cpu.yaml"), steps=3, run_dir=str(tmp_path / "run"))
    path = write_job(job)
    assert path == tmp_path / "run" / JOB_FILE
    assert not [p for p in path.parent.iterdir() if p.name != JOB_FILE]  # no temporary file left behind
    loaded = load_job(path)
    assert loaded.to_dict() == job.to_dict()
    assert loaded.topologies() == job.topologies() and loaded.plan == job.plan and loaded.model == job.model
    assert all(p is not None and p["mode"] == "fp32" for p in loaded.stage_precision)  # resolved by the parent


def test_job_file_of_another_schema_is_one_line(tmp_path: Path) -> None:
    path = write_job(prepare(str(REPO / "examples/hetero_cpu.yaml"), run_dir=str(tmp_path / "run")))
    data = json.loads(path.read_text(encoding="utf-8"))
    data["schema"] = 99
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"schema 99 but this hal reads schema {JOB_SCHEMA}") as info:
        load_job(path)
    assert "\n" not in str(info.value)


def test_a_job_file_that_is_a_pipe_or_huge_is_one_line_before_any_read(tmp_path: Path) -> None:
    import os

    from hal.parallel.config.job import MAX_JOB_BYTES

    pipe, huge = tmp_path / "pipe.json", tmp_path / "huge.json"
    os.mkfifo(pipe)  # reading it would block the rank forever
    with open(huge, "wb") as f:
        f.truncate(MAX_JOB_BYTES + 1)  # sparse: nothing of it may be read
    for path, words in ((pipe, "is not a regular file (a directory, pipe or device)"), (huge, "larger than 16 MiB, more than such a file holds")):
        with pytest.raises(ConfigError, match=None) as info:
            load_job(path)
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_rank_is_handed_the_job_file_and_never_reads_the_yaml(tmp_path: Path) -> None:
    config = tmp_path / "one.yaml"
    config.write_text(ONE_RANK, encoding="utf-8")
    job = prepare(str(config), run_dir=str(tmp_path / "run"))
    write_job(job)
    assert job.rank_args() == [str(tmp_path / "run" / JOB_FILE)]  # the rank's whole argv: no YAML, no flags
    config.write_text("this: [is not, the config\n", encoding="utf-8")  # a rank that re-read it would fail
    env = {**rank_envs(job, free_port())[0], "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "hal.parallel.loop.trainer", *job.rank_args()], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    assert summary["config"] == str(config) and summary["last_step"] == 2 and len(summary["losses"]) == 2


def test_print_multinode_here_document_writes_the_same_job(tmp_path: Path) -> None:
    job = prepare(str(REPO / "examples/hetero_cpu.yaml"), run_dir=str(tmp_path / "shared"), check_backends=False)
    lines = multinode_lines(job, 2)
    assert not (tmp_path / "shared").exists()
    subprocess.run(["bash", "-c", lines[0]], check=True, timeout=60)
    loaded = load_job(tmp_path / "shared" / JOB_FILE)
    assert loaded.to_dict() == job.to_dict()
    assert loaded.stage_precision == (None, None)  # the printing host leaves precision to the nodes' ranks
    assert all(line.rstrip().endswith(str(job.path)) for line in lines[1:])
