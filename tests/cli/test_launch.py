"""``hal launch``: real ranks through the real CLI, failures and Ctrl-C leave nothing behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from ..conftest import REPO, has_cuda, run_hal

PROBE = "tests/launch_probe.py"


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _processes_with(marker: str) -> list[str]:
    """Command lines of live processes mentioning ``marker`` (a /proc scan; zombies have none)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def _assert_none_left(marker: str) -> None:
    deadline = time.monotonic() + 2  # the launcher reaps its ranks before it returns; allow the kernel a moment
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_with(marker), _processes_with(marker)


def test_two_cpu_ranks_all_reduce_their_ranks() -> None:
    result = run_hal("launch", "--nproc", "2", "--backend", "cpu", PROBE)
    assert result.returncode == 0, result.stderr
    records = sorted(_records(result.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1], result.stdout
    for r in records:
        assert r["world"] == 2 and r["result"] == 1.0 and r["backend"] == "cpu" and r["device"] == "cpu"
        assert r["local_rank"] == r["rank"]
    assert "torchrun --standalone --nproc-per-node=2 -m hal.migration tests/launch_probe.py" in result.stderr
    # CPU ranks fork from one interpreter that imported torch once (hal.launch.zygote), not python -u -m hal.migration
    assert all(r["started_as"] != ["-u", "-m", "hal.migration"] for r in records), records
    assert [r["name"] for r in records] == ["hal-rank-0", "hal-rank-1"]  # what ps and top show: not the zygote's name


def test_hal_rank_start_exec_starts_every_rank_as_a_fresh_interpreter() -> None:
    result = run_hal("launch", "--nproc", "2", "--backend", "cpu", PROBE, env={"HAL_RANK_START": "exec"})
    assert result.returncode == 0, result.stderr
    records = _records(result.stdout)
    assert [r["started_as"] for r in records] == [["-u", "-m", "hal.migration"]] * 2, records
    assert sorted(r["name"] for r in records) == ["hal-rank-0", "hal-rank-1"]


def test_a_failing_rank_fails_the_launch_and_leaves_no_process() -> None:
    marker = f"halprobe-{uuid.uuid4().hex}"
    result = run_hal("launch", "--nproc", "2", "--backend", "cpu", PROBE, "--fail-rank", "1", "--marker", marker)
    assert result.returncode == 3, result.stderr  # the failing rank's status, not the stopped one's
    assert "rank 1 failed (exit status 3)" in result.stderr
    _assert_none_left(marker)


def test_ctrl_c_stops_every_rank() -> None:
    marker = f"halprobe-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HAL_BACKEND", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hal", "launch", "--nproc", "2", "--backend", "cpu", PROBE, "--sleep", "60", "--marker", marker],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal, even under a runner that ignores it
    )
    try:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, proc.stderr.read()  # type: ignore[union-attr]
            ready += '"ready"' in line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGINT" in err
    _assert_none_left(marker)


def test_ranks_die_with_a_launcher_killed_by_sigkill() -> None:
    """SIGKILL leaves the launcher no chance to stop its ranks: the kernel's parent-death signal must."""
    marker = f"halprobe-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HAL_BACKEND", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hal", "launch", "--nproc", "2", "--backend", "cpu", PROBE, "--sleep", "120", "--marker", marker],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, proc.stderr.read()  # type: ignore[union-attr]
            ready += '"ready"' in line
        ranks = [p for p in _processes_with(marker) if not p.startswith(f"{proc.pid}:")]
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _assert_none_left(marker)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nproc", "0", "--backend", "cpu", PROBE], "--nproc 0"),
        (["--nproc", "2", "--backend", "cpu", "no_such_script.py"], "not found"),
        (["--nproc", "2", "--backend", "nope", PROBE], "'nope' is not allowed"),
        (["--nproc", "two", "--backend", "cpu", PROBE], "invalid int value"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], words: str) -> None:
    result = run_hal("launch", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("hal: error:") and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(has_cuda(), reason="this machine has a GPU")
def test_unavailable_backend_is_refused_before_starting_anything() -> None:
    result = run_hal("launch", "--nproc", "2", "--backend", "cuda", PROBE)
    assert result.returncode == 2 and "backend 'cuda' is not available" in result.stderr
    assert result.stderr.count("\n") == 1 and "torchrun" not in result.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda(), reason="needs an NVIDIA GPU")
def test_more_ranks_than_gpus_is_refused() -> None:
    from hal import get_backend

    count = get_backend("cuda").device_count()
    result = run_hal("launch", "--nproc", str(count + 1), "--backend", "cuda", PROBE)
    assert result.returncode == 2 and f"has {count} visible device(s)" in result.stderr, result.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not has_cuda(), reason="needs an NVIDIA GPU")
def test_cuda_ranks_are_pinned_to_their_gpu() -> None:
    from hal import get_backend

    n = min(2, get_backend("cuda").device_count())
    result = run_hal("launch", "--nproc", str(n), "--backend", "cuda", PROBE)
    assert result.returncode == 0, result.stderr
    records = sorted(_records(result.stdout), key=lambda r: r["rank"])
    assert [r["device"] for r in records] == [f"cuda:{i}" for i in range(n)]
    assert all(r["result"] == sum(range(n)) for r in records)


def test_print_multinode_prints_plain_torchrun_lines_and_starts_nothing() -> None:
    result = run_hal("launch", "--nproc", "4", "--backend", "cpu", "--print-multinode", "2", PROBE, "--sleep", "1 2")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and result.stdout == ""
    for node, line in enumerate(lines):
        assert line.startswith("HAL_BACKEND=cpu torchrun --nnodes=2 --nproc-per-node=4 ")
        assert f"--node-rank={node}" in line and "--rdzv-endpoint=NODE0_HOST:29500" in line
        assert line.endswith(f"{PROBE} --sleep '1 2'")


# --- the launcher itself (hal.launch.spawn_ranks / run_function), on plain Python ranks ------------------------

RANK_BODY = """
import os, signal, subprocess, sys, time
rank = int(os.environ["RANK"])
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a helper in the rank's group
with open(os.path.join(sys.argv[1], f"helper{rank}"), "w") as fh:
    fh.write(str(helper.pid))
mode = sys.argv[2] if rank == 1 else "sleep"
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mode = "sleep"
time.sleep(0.5)  # both helpers exist before anything fails
if mode == "exit":
    print("rank 1 gives up: planted error", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "sigkill":
    print("about to die", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (/proc, no psutil)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state not in ("Z", "X")


def _spawn_two(tmp_path, mode: str, **options):  # type: ignore[no-untyped-def]
    from hal.launch import rank_env, spawn_ranks

    command = [sys.executable, "-c", RANK_BODY, str(tmp_path), mode]
    envs = [rank_env(r, 2, 29400) for r in range(2)]
    started = time.monotonic()
    report = spawn_ranks([command, command], envs, stdout="devnull", **options)
    helpers = [int((tmp_path / f"helper{r}").read_text()) for r in range(2)]
    return report, helpers, time.monotonic() - started


def _assert_all_gone(report, helpers) -> None:  # type: ignore[no-untyped-def]
    """The ranks are reaped; their helpers (not our children) get a moment for SIGKILL to land."""
    assert not [pid for pid in report.pids if _alive(pid)]
    deadline = time.monotonic() + 2
    while any(_alive(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in helpers if _alive(pid)]
    assert not left, f"still running: {left}"


def test_launcher_names_a_failing_rank_stops_the_rest_and_leaves_no_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    report, helpers, took = _spawn_two(tmp_path, "exit", deadline_s=60)
    fates = {f.rank: f for f in report.fates}
    assert fates[1].fate == "exit" and fates[1].code == 3 and fates[1].last_line == "rank 1 gives up: planted error"
    assert fates[0].fate == "stopped"
    assert report.exit_status == 3 and not report.ok and not report.timed_out and took < 30
    assert report.lines() == [
        "rank 1 failed (exit status 3): rank 1 gives up: planted error", "rank 0 stopped by the launcher after rank 1 failed",
    ]
    _assert_all_gone(report, helpers)


def test_launcher_reports_sigkill_as_sigkill(tmp_path) -> None:  # type: ignore[no-untyped-def]
    report, helpers, _ = _spawn_two(tmp_path, "sigkill", deadline_s=60)
    fates = {f.rank: f for f in report.fates}
    assert fates[1].fate == "signal" and fates[1].code == signal.SIGKILL
    assert report.lines()[0] == "rank 1 failed (killed by SIGKILL): about to die"
    assert "SIGTERM" not in report.summary() and fates[0].fate == "stopped"
    assert report.exit_status == 128 + signal.SIGKILL
    _assert_all_gone(report, helpers)


def test_launcher_deadline_kills_hanging_ranks_even_those_ignoring_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    report, helpers, took = _spawn_two(tmp_path, "ignore-term", deadline_s=2, term_grace_s=1)
    assert report.timed_out and report.exit_status == 124 and took < 20
    assert [f.fate for f in report.fates] == ["timed out", "timed out"]
    assert "rank 0 timed out after 2 s (killed)" in report.summary()
    _assert_all_gone(report, helpers)


def test_run_function_returns_values_or_raises_one_report() -> None:
    from hal.launch import LaunchFailed, run_function

    run = run_function("os:getenv", 3, {"key": "RANK"}, deadline_s=60)
    assert run.values == ["0", "1", "2"]
    with pytest.raises(LaunchFailed, match=r"^demo: rank \d failed \(exit status 1\): ValueError: .*not 'module:callable'") as info:
        run_function("no-colon", 2, deadline_s=60, what="demo")
    assert not any(_alive(pid) for pid in info.value.pids)


def test_report_puts_the_root_cause_before_ranks_that_lost_a_peer() -> None:
    from hal.launch import LaunchReport, RankFate

    lost = RankFate(0, 10, "exit", 1, "CollectiveTimeout: all_reduce ... Connection closed by peer")
    cause = RankFate(1, 11, "exit", 2, "RuntimeError: planted")
    stopped = RankFate(2, 12, "stopped")
    report = LaunchReport((lost, cause, stopped), 1.0)
    assert report.lines() == [
        "rank 1 failed (exit status 2): RuntimeError: planted",
        "rank 0 failed (exit status 1): CollectiveTimeout: all_reduce ... Connection closed by peer",
        "rank 2 stopped by the launcher after rank 1 failed",
    ]
    assert report.exit_status == 2 and not report.ok
    # hal's own names for a lost peer count too, also where a rank entry prints the message without the class.
    named = RankFate(3, 13, "exit", 2, "hal train: rank 3: error: batch_p2p: rank 1 closed the connection — it exited, ...")
    killed = RankFate(1, 11, "signal", 9, "")
    assert LaunchReport((named, killed), 1.0).lines()[0] == "rank 1 failed (killed by SIGKILL)"


def test_a_warning_every_rank_prints_is_echoed_once_with_its_source_line() -> None:
    """Four ranks warn alike (a downgrade each rank records): the echo shows it once, with the source line Python
    prints under it; each rank's own lines all show, and a rank repeating its own warning shows it each time."""
    import io

    from hal.launch.ranks import spawn_ranks

    body = ("import os, sys, warnings\n"
            "warnings.warn('the same downgrade on every rank')\n"
            "r = os.environ['R']\n"
            "print(f'rank {r} trained', file=sys.stderr)\n"
            "print('hal train: warning: on every rank', file=sys.stderr)\n"
            "for _ in range(2 if r == '0' else 0):\n"
            "    print('hal train: warning: rank 0 skipped a step', file=sys.stderr)\n")
    echo = io.StringIO()
    envs = [{**os.environ, "R": str(r)} for r in range(4)]
    report = spawn_ranks([[sys.executable, "-c", body]] * 4, envs, stdout="devnull", echo_stderr=echo)
    assert report.ok, report
    lines = echo.getvalue().splitlines()
    assert sum("UserWarning: the same downgrade on every rank" in line for line in lines) == 1, lines
    assert sum(line.startswith("  ") for line in lines) <= 1  # the source line under the warning, at most once
    assert sorted(line for line in lines if line.endswith("trained")) == [f"rank {r} trained" for r in range(4)]
    assert lines.count("hal train: warning: on every rank") == 1
    assert lines.count("hal train: warning: rank 0 skipped a step") == 2  # a rank repeating its own warning: each time


def test_the_guard_a_rank_starts_through_adds_nothing_to_its_stderr() -> None:
    """Every rank the launcher starts execs through the guard; a warning of its own (runpy's, when ``-m`` ran a
    module ``hal.launch`` had imported) landed on each rank's stderr, above the run's first line."""
    from hal.launch.guard import guarded

    done = subprocess.run(guarded([sys.executable, "-c", "print('ok')"]), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")
