"""A rank of hal launch / hal run leaves through hal.rank.exit: groups torn down before atexit, its own exit status,
and a teardown that hangs bounded by the watchdog."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ..conftest import REPO, run_hal

PROBE = """
import atexit, sys, torch, torch.distributed as dist
from hal.collectives import init_distributed, world_communicator

init_distributed()
comm = world_communicator()
t = torch.ones(4) * (comm.rank + 1)
comm.all_reduce(t, "avg")
say = lambda text: (sys.stdout.write(text + "\\n"), sys.stdout.flush())  # one write: the ranks share the pipe
atexit.register(lambda: say(f"rank {comm.rank} at exit: groups alive {dist.is_initialized()}"))
if comm.rank == int(sys.argv[1]):
    raise RuntimeError("this rank fails after its collective")
say(f"rank {comm.rank} done {t.tolist()}")
"""


def test_ranks_tear_their_groups_down_before_exit_and_report_their_own_status(tmp_path: Path) -> None:
    """No destroy_process_group in the script: the groups are gone before its atexit handlers run (not left to the
    interpreter's finalization), the exit status is 0; a rank that raises is reported with exit status 1."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    ok = run_hal("launch", "--nproc", "2", "--backend", "cpu", str(script), "-1", timeout=180)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert sorted(line for line in ok.stdout.splitlines() if "at exit" in line) == \
        ["rank 0 at exit: groups alive False", "rank 1 at exit: groups alive False"], ok.stdout
    failed = run_hal("launch", "--nproc", "2", "--backend", "cpu", str(script), "1", timeout=180)
    assert failed.returncode != 0
    assert "rank 1 failed (exit status 1)" in failed.stderr and "SIGABRT" not in failed.stderr, failed.stderr[-2000:]


def test_a_teardown_that_hangs_is_cut_by_the_watchdog_with_the_scripts_status(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import atexit, sys, time\natexit.register(lambda: time.sleep(600))\nprint('work done')\n"
                      "sys.exit(3)\n", encoding="utf-8")
    done = run_hal("run", "--backend", "cpu", str(script), env={"HAL_RANK_EXIT_GRACE_S": "2"}, timeout=120)
    assert done.returncode == 3 and "work done" in done.stdout, done.stderr
    assert "tearing this rank down took over 2 s" in done.stderr and "leaving with exit status 3" in done.stderr


COUNT = """
import os, sys, torch
sys.stdout.write(f"rank {os.environ.get('RANK', 0)} sees {torch.cuda.device_count()} devices\\n"); sys.stdout.flush()
if torch.cuda.device_count() < 2:
    raise SystemExit("this script needs 2 GPUs")
"""


def test_a_launched_script_that_asks_is_told_a_device_a_local_rank(tmp_path: Path) -> None:
    """hal launch --nproc 2 on the cpu target: torch.cuda.device_count() is 2 in each rank (a script gating on
    ``>= 2`` runs), the banner says so and how to change it; hal run's banner says how to ask for more than 1."""
    script = tmp_path / "count.py"
    script.write_text(COUNT, encoding="utf-8")
    done = run_hal("launch", "--nproc", "2", "--backend", "cpu", str(script), timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.splitlines()) == ["rank 0 sees 2 devices", "rank 1 sees 2 devices"], done.stdout
    banner = done.stderr.splitlines()[0]
    assert "torch.cuda.device_count() is 2 in each rank" in banner and "HAL_DEVICE_COUNT=N" in banner, banner
    alone = run_hal("run", "--backend", "cpu", str(script), timeout=120)
    assert alone.returncode == 1 and "this script needs 2 GPUs" in alone.stderr
    assert "torch.cuda.device_count() 1 (--device-count N for a script that needs N)" in alone.stderr.splitlines()[0]


def test_a_script_torchrun_starts_through_hal_run_is_told_a_device_a_local_rank(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 --no-python hal run script.py``: each rank's script is told 2 devices, as under
    hal launch (it was told 1: the count came from how the ranks were started, not from the local world size)."""
    import shutil
    import subprocess
    import sys

    hal = shutil.which("hal", path=str(Path(sys.executable).parent))
    if hal is None:
        pytest.skip("the hal command is not installed beside this python (pip install -e . installs it)")
    script = tmp_path / "count.py"
    script.write_text(COUNT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HAL_BACKEND", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--no-python", hal, "run", "--backend", "cpu", str(script)],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.splitlines()) == ["rank 0 sees 2 devices", "rank 1 sees 2 devices"], done.stdout
    assert "torch.cuda.device_count() 2 (torchrun's LOCAL_WORLD_SIZE: a device a local rank)" in done.stderr

