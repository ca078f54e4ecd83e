"""Ranks forked from the zygote (``hal.launch.zygote``): the launcher's own children, each its own process.

``spawn_ranks`` runs in a child interpreter here: the zygote makes its launcher a child subreaper, which the
test process itself must not become.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote needs Linux")

LAUNCHER = r'''
import atexit, json, os, sys
if os.environ.get("LAUNCHER_IMPORTS_TORCH"):  # the launcher holds the zygote's imports: the zygote is its fork
    import torch
    sys._probe_launcher_marker = os.getpid()
    atexit.register(lambda: open(os.path.join(sys.argv[3], f"atexit-{os.getpid()}"), "w").close())  # never a rank's
from hal.launch import spawn_ranks
exits, fork, cwd = json.loads(sys.argv[1]), sys.argv[2] == "fork", sys.argv[3]
command = [sys.executable, "-m", "tests.zygote_probe", "--flag", "x"]
envs = [{**os.environ, "RANK": str(r), "OMP_NUM_THREADS": "1", "PROBE_EXIT": str(code),
         "PROBE_SLEEP": os.environ.get("PROBE_SLEEP", "0")} for r, code in enumerate(exits)]
report = spawn_ranks([command] * len(exits), envs, stdout="devnull", cwd=cwd, echo_stderr=sys.stderr,
                     fork_from=("torch", "tests.zygote_probe") if fork else ())
print(json.dumps({"launcher": os.getpid(), "fates": sorted([f.rank, f.fate, f.code] for f in report.fates)}))
'''


def _launch(exits: list[int], mode: str, cwd: Path, **env: str) -> tuple[dict, list[dict], subprocess.CompletedProcess[str]]:
    result = subprocess.run([sys.executable, "-c", LAUNCHER, json.dumps(exits), mode, str(cwd)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    return json.loads(result.stdout.splitlines()[-1]), sorted(ranks, key=lambda r: r["rank"]), result


def test_forked_ranks_are_the_launchers_children_each_in_its_session(tmp_path: Path) -> None:
    report, ranks, _ = _launch([0, 0, 0], "fork", tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for rank in ranks:
        assert rank["preloaded"] is True  # forked: torch came from the zygote
        assert rank["ppid"] == report["launcher"]  # re-parented to the launcher, not the zygote
        assert rank["pgid"] == rank["sid"] == rank["pid"]  # its own session: killpg reaches it and its helpers
        assert rank["threads"] == 1 and rank["cwd"] == str(tmp_path) and rank["argv"] == ["--flag", "x"]
    assert report["fates"] == [[0, "ok", None], [1, "ok", None], [2, "ok", None]]


def test_a_launcher_that_imported_torch_forks_the_zygote_from_itself(tmp_path: Path) -> None:
    """The zygote is the launcher's fork (no second torch import) when the launcher holds the imports and runs one
    thread: the ranks are as above, and none of them runs the launcher's atexit handler. HAL_ZYGOTE=exec: a
    fresh zygote."""
    one_thread = {"OPENBLAS_NUM_THREADS": "1"}  # else numpy's BLAS starts a thread at import: no fork then
    report, ranks, _ = _launch([0, 0], "fork", tmp_path, LAUNCHER_IMPORTS_TORCH="1", **one_thread)
    for rank in ranks:
        assert rank["launcher_marker"] == report["launcher"]  # forked from the launcher's own memory
        assert rank["preloaded"] is True and rank["ppid"] == report["launcher"]
        assert rank["pgid"] == rank["sid"] == rank["pid"] and rank["argv"] == ["--flag", "x"]
    assert report["fates"] == [[0, "ok", None], [1, "ok", None]]
    assert sorted(p.name for p in tmp_path.glob("atexit-*")) == [f"atexit-{report['launcher']}"]
    (tmp_path / "fresh").mkdir()
    again, ranks, _ = _launch([0, 0], "fork", tmp_path / "fresh", LAUNCHER_IMPORTS_TORCH="1", HAL_ZYGOTE="exec",
                              **one_thread)
    assert again["fates"] == report["fates"] and [r["launcher_marker"] for r in ranks] == [None, None]  # fresh


def test_a_forked_ranks_exit_status_is_its_fate(tmp_path: Path) -> None:
    report, _, _ = _launch([0, 3, 0], "fork", tmp_path, PROBE_SLEEP="0")
    fates = {rank: (fate, code) for rank, fate, code in report["fates"]}
    assert fates[1] == ("exit", 3)


def test_the_same_ranks_as_fresh_interpreters(tmp_path: Path) -> None:
    report, ranks, _ = _launch([0, 0], "exec", tmp_path)
    assert [r["preloaded"] for r in ranks] == [False, False]
    assert report["fates"] == [[0, "ok", None], [1, "ok", None]]


def test_switched_off_by_hal_rank_start_exec(tmp_path: Path) -> None:
    _, ranks, _ = _launch([0, 0], "fork", tmp_path, HAL_RANK_START="exec")
    assert [r["preloaded"] for r in ranks] == [False, False]


def test_a_zygote_that_cannot_import_falls_back_and_says_so(tmp_path: Path) -> None:
    script = LAUNCHER.replace('("torch", "tests.zygote_probe")', '("torch", "no_such_module_here")')
    result = subprocess.run([sys.executable, "-c", script, "[0, 0]", "fork", str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if line.startswith("hal: warning:")]
    assert len(warning) == 1 and "fresh interpreter" in warning[0] and "no_such_module_here" in warning[0]
    ranks = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert sorted(r["preloaded"] for r in ranks) == [False, False]


def test_forked_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """SIGKILL to the launcher: its ranks get the parent-death signal (armed against the launcher after the
    re-parenting), the zygote too; nothing is left running. A forked rank's command line is the zygote's, which
    carries the ranks' arguments, so ``ps`` still shows what a rank runs."""
    marker = f"zygote-kill-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER.replace('"--flag", "x"', f'"--flag", "{marker}"'),
                             "[0, 0]", "fork", str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PROBE_SLEEP": "60"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(tmp_path.glob("rank*.pid"))) < 2:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
        assert len(pids) == 2, "the ranks did not start"
        assert set(pids) <= set(_running(marker))  # the zygote's command line names the ranks' arguments
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _running(marker):
            time.sleep(0.1)
        assert not _running(marker)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _running(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line mentions ``marker``, this test's launcher left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z" and "spawn_ranks" not in cmdline:
            found.append(int(entry.name))
    return found
