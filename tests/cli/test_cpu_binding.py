"""hal train --cpu-binding cores: blocks of cores per rank (NUMA-aware), handed over in HAL_CPUS, applied by the rank."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hal.cpu_binding import CPUS_ENV, bind_from_env, cpulist, numa_groups, parse_cpulist, rank_blocks
from hal.errors import ConfigError

from ..conftest import run_hal

REPO = Path(__file__).resolve().parents[2]
MODEL = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
         "ffn_hidden_size": 64, "max_seq_len": 16}


def _nodes(root: Path, **lists: str) -> Path:
    """A fake /sys/devices/system/node: one nodeN/cpulist per keyword."""
    for name, text in lists.items():
        (root / name).mkdir(parents=True)
        (root / name / "cpulist").write_text(text + "\n")
    return root


def test_cpulists_round_trip_and_bad_ones_are_refused() -> None:
    assert cpulist([5, 0, 1, 2, 8, 9]) == "0-2,5,8-9" and cpulist([3]) == "3"
    assert parse_cpulist("0-2,5,8-9\n") == [0, 1, 2, 5, 8, 9]
    for bad in ("", "a", "3-1", "-1", "1-", "0-99999999999"):  # the last refused before a list is built
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_numa_groups_follow_the_kernels_nodes_and_fall_back_to_one(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path / "two", node0="0-3", node1="4-7")
    assert numa_groups(range(8), nodes) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert numa_groups([1, 2, 5], nodes) == [[1, 2], [5]]  # only the cpus this process may use
    assert numa_groups([0, 1], tmp_path / "absent") == [[0, 1]]
    partial = _nodes(tmp_path / "part", node0="0-1")
    assert numa_groups([0, 1, 2, 3], partial) == [[0, 1, 2, 3]]  # a node list that misses cpus: not trusted


def test_blocks_are_disjoint_equal_and_stay_inside_a_node() -> None:
    two_nodes = [list(range(8)), list(range(8, 16))]
    blocks = rank_blocks(4, two_nodes)
    assert blocks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert rank_blocks(2, two_nodes) == [list(range(8)), list(range(8, 16))]
    three = rank_blocks(3, two_nodes)  # 3 ranks do not divide over 2 nodes: one list, equal blocks
    assert [len(b) for b in three] == [5, 5, 5] and len({c for b in three for c in b}) == 15
    assert rank_blocks(2, [[0, 1]]) == [[0], [1]]
    with pytest.raises(ConfigError, match=r"--cpu-binding cores: 5 local rank\(s\) but 4 cpu\(s\) allowed here"):
        rank_blocks(5, [[0, 1, 2, 3]])


def test_a_rank_pins_itself_to_what_hal_cpus_says() -> None:
    mine = sorted(os.sched_getaffinity(0))
    code = "import os; from hal.cpu_binding import bind_from_env; print(bind_from_env(), sorted(os.sched_getaffinity(0)))"
    env = {**os.environ, CPUS_ENV: str(mine[-1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{mine[-1]}]", f"[{mine[-1]}]"]
    assert bind_from_env({}) is None
    with pytest.raises(ConfigError, match=r"HAL_CPUS='x': .*give a cpulist such as 0-3,8"):
        bind_from_env({CPUS_ENV: "x"})


def _config(tmp_path: Path, ranks: int) -> Path:
    config = {"backend": "cpu", "precision": "fp32", "model": MODEL,
              "parallel": {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 1,
                           "stages": [{"backend": "cpu", "devices": 1, "layers": 2 // ranks}] * ranks},
              "train": {"steps": 1, "data": "synthetic"}}
    path = tmp_path / f"ranks{ranks}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(config: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    return run_hal("train", str(config), "--cpu-binding", "cores", "--run-dir", str(run_dir), timeout=300)


def test_hal_train_pins_each_rank_to_its_own_cores(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one cpu: nothing to pin two ranks to")
    out = _train(_config(tmp_path, 2), tmp_path / "run")
    assert out.returncode == 0, out.stderr
    pinned = sorted(line.split("pinned to cpus ")[1] for line in out.stderr.splitlines() if "pinned to cpus" in line)
    assert len(pinned) == 2 and len({tuple(parse_cpulist(p)) for p in pinned}) == 2, out.stderr
    assert not set(parse_cpulist(pinned[0])) & set(parse_cpulist(pinned[1]))  # disjoint
    assert "; cpus r0:" in out.stderr  # the banner says the blocks before the ranks start


def test_more_ranks_than_cores_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    ranks = len(os.sched_getaffinity(0)) + 1
    if ranks > 4:
        pytest.skip("this host has more than 3 cpus: a plan of 4 ranks fits them")
    config = _config(tmp_path, 2)
    data = yaml.safe_load(config.read_text())
    data["model"]["num_layers"] = ranks
    data["parallel"]["stages"] = [{"backend": "cpu", "devices": 1, "layers": 1}] * ranks
    data["parallel"]["micro_batches"] = ranks
    config.write_text(yaml.safe_dump(data))
    out = _train(config, tmp_path / "run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"--cpu-binding cores: {ranks} local rank(s)" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
