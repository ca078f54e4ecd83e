"""A rank of hal launch / hal run leaves through hal.rank_exit: groups torn down before atexit, its own exit status,
and a teardown that hangs bounded by the watchdog."""
from __future__ import annotations

from pathlib import Path

from ..conftest import run_hal

PROBE = """
import atexit, sys, torch, torch.distributed as dist
from hal.collectives import init_distributed, world_communicator

init_distributed()
comm = world_communicator()
t = torch.ones(4) * (comm.rank + 1)
comm.all_reduce(t, "avg")
atexit.register(lambda: print(f"rank {comm.rank} at exit: groups alive {dist.is_initialized()}", flush=True))
if comm.rank == int(sys.argv[1]):
    raise RuntimeError("this rank fails after its collective")
print(f"rank {comm.rank} done {t.tolist()}", flush=True)
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
