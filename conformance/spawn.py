"""Run one multi-process job: N ranks of ``python -m conformance.worker``, bounded in time, nothing left behind.

Why subprocesses and not ``multiprocessing``: the runner may itself run inside threads, a pytest
worker or a CLI with its own signal handling; plain child processes with their own session are
the one thing that can always be killed as a whole. Each rank is started with
``start_new_session=True`` (its own process group), rendezvous is a ``file://`` store in a
private temporary directory, and the job spec and every rank's result travel as files there.

The deadline covers the whole job (start-up included). When it passes, or when one rank fails
(the others would otherwise sit in a collective until their own timeout), every rank's process
group gets SIGKILL and is reaped before ``run_job`` raises ``JobFailed`` — so a failed or hung
job never leaves a process running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from hal.errors import HalError

REPO_ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 3.0  # after one rank fails, how long the others get to finish on their own
POLL_S = 0.05


class JobFailed(HalError):
    """A rank crashed, raised, or the job ran past its deadline (every rank was killed and reaped).

    ``pids``: the ranks' process ids, so a caller can confirm none is left.
    """

    def __init__(self, message: str, pids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.pids = pids


@dataclass(frozen=True)
class JobResult:
    """Every rank's returned value (rank order) and how long the job took."""

    values: list[Any]
    seconds: float


def _child_env(rank: int, backend: str, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO_ROOT), os.getcwd(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # the worker imports factories from tests/ too
    env["LOCAL_RANK"] = str(rank)  # init_distributed pins the rank to device LOCAL_RANK
    env["HAL_BACKEND"] = backend
    env.pop("HAL_ISLANDS", None)  # conformance jobs measure one native group unless the spec says otherwise
    if backend == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the host cores
    env.update(extra or {})
    return env


def _tail(path: Path) -> str:
    """The last meaningful line of a rank's output (a traceback's last line is the exception)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip() and "warn" not in line.lower()]
    return kept[-1][:400] if kept else ""


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank's process group (also after the rank itself exited: anything it started), then reap."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass


def run_job(
    job: str,
    spec: Mapping[str, Any],
    world_size: int,
    backend: str,
    *,
    timeout_s: float,
    collective_timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> JobResult:
    """Run ``job`` (a name in ``conformance.worker.JOBS``, or ``"module:callable"``) on ``world_size`` ranks of ``backend``.

    ``spec`` is handed to every rank unchanged (picklable data: names and numbers). Returns each
    rank's value; raises ``JobFailed`` with the failing rank's last error line otherwise.
    """
    if world_size < 1:
        raise ValueError(f"world size {world_size} is not a rank count; give 1 or more")
    started = time.monotonic()
    coll_timeout = collective_timeout_s if collective_timeout_s is not None else max(10.0, timeout_s / 2)
    with tempfile.TemporaryDirectory(prefix="hal-conformance-") as tmp:
        root = Path(tmp)
        spec_path = root / "spec.pt"
        torch.save(dict(spec), spec_path)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world_size):
                args = [
                    sys.executable, "-m", "hal.conformance.worker", "--job", job, "--rank", str(rank),
                    "--world-size", str(world_size), "--backend", backend, "--init", f"file://{root / 'store'}",
                    "--spec", str(spec_path), "--out", str(root / f"rank{rank}.pt"),
                    "--collective-timeout", str(coll_timeout),
                ]
                with open(root / f"rank{rank}.log", "wb") as log:
                    procs.append(subprocess.Popen(
                        args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=_child_env(rank, backend, env), start_new_session=True,
                    ))
            failure = _wait(procs, started + timeout_s, timeout_s, root)
        finally:
            _kill(procs)
        if failure:
            raise JobFailed(f"{job} job on {world_size} rank(s) of {backend}: {failure}", tuple(p.pid for p in procs))
        values = [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    return JobResult(values, time.monotonic() - started)


_CONSEQUENCE = ("CollectiveTimeout", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float, limit_s: float, root: Path) -> str | None:
    """Wait for every rank; the problem as one line (root cause first), or None when every rank succeeded."""
    failed: dict[int, tuple[float, str]] = {}  # rank -> (when seen, what)
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in failed:
                why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                failed[rank] = (now, f"rank {rank} failed ({why}): {_tail(root / f'rank{rank}.log') or 'no output'}")
        if all(c is not None for c in codes):
            if not failed and any(not (root / f"rank{r}.pt").is_file() for r in range(len(procs))):
                return "a rank exited without writing its result"
            return _summary(failed)
        first_seen = min((t for t, _ in failed.values()), default=None)
        if first_seen is not None and now - first_seen > GRACE_S:
            return _summary(failed) + " (the other ranks were stopped)"
        if now > deadline:
            waiting = [r for r, c in enumerate(codes) if c is None]
            tails = "; ".join(f"rank {r}: {_tail(root / f'rank{r}.log') or 'no output'}" for r in waiting[:2])
            return (_summary(failed) + "; " if failed else "") + (
                f"timed out after {limit_s:g} s (rank(s) {waiting} still running, killed; last output: {tails})"
            )
        time.sleep(POLL_S)


def _summary(failed: dict[int, tuple[float, str]]) -> str:
    """Failed ranks, causes before consequences (a peer's lost connection), then by time and rank."""
    if not failed:
        return ""
    order = sorted(failed, key=lambda r: (any(m in failed[r][1] for m in _CONSEQUENCE), failed[r][0], r))
    return "; ".join(failed[r][1] for r in order)
