"""Run a Python function on N local ranks and collect what each returns, or raise one failure report.

The function is named, not passed (``"module:function"``): each rank is ``python -m hal.launch.entry``
(forked from a zygote that imported torch and the function's module once when every rank is on the CPU, else
a fresh interpreter), so nothing but names and picklable arguments crosses over, and the library that owns
the function never imports the launcher.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping

from hal.config.limits import check_local_ranks
from hal.standin import host_backends

from .env import INIT_METHOD_ENV, free_port, import_path, rank_env
from .names import result_path
from .ranks import LaunchFailed, LaunchReport, Output, spawn_ranks


@dataclass(frozen=True)
class FunctionRun:
    """Every rank's returned value (rank order), and the launcher's report of the run."""

    values: list[Any]
    report: LaunchReport

    @property
    def seconds(self) -> float:
        return self.report.seconds


def run_function(
    target: str,
    world_size: int,
    kwargs: Mapping[str, Any] | None = None,
    *,
    deadline_s: float | None,
    what: str = "",
    env: Mapping[str, str] | None = None,
    per_rank_env: Callable[[int], Mapping[str, str]] | None = None,
    stdout: Output = "merge",
    echo_stderr: IO[str] | None = None,
    term_grace_s: float = 5.0,
) -> FunctionRun:
    """``target(**kwargs)`` on ``world_size`` ranks within ``deadline_s`` (None: no limit); LaunchFailed names every rank's fate.

    ``env`` is added to every rank's environment, ``per_rank_env(rank)`` to one rank's (e.g. its
    HAL_BACKEND). Every rank gets HAL_INIT_METHOD, a ``file://`` store in a directory private to
    this run. ``what`` prefixes the failure message (e.g. "collectives job on 2 rank(s) of cpu").
    """
    if world_size < 1:
        raise ValueError(f"world size {world_size} is not a rank count; give 1 or more")
    check_local_ranks(world_size, f"{what}: world size" if what else "world size")
    with tempfile.TemporaryDirectory(prefix="hal-launch-") as tmp:
        kwargs_file = os.path.join(tmp, "kwargs.pkl")
        with open(kwargs_file, "wb") as fh:
            pickle.dump(dict(kwargs or {}), fh)
        base = {**os.environ, INIT_METHOD_ENV: f"file://{os.path.join(tmp, 'store')}"}
        base["PYTHONPATH"] = import_path(base)
        base.update(env or {})
        port = free_port()
        envs = [rank_env(r, world_size, port, base=base, extra=per_rank_env(r) if per_rank_env else None) for r in range(world_size)]
        commands = [[sys.executable, "-m", "hal.launch.entry", target, kwargs_file, tmp]] * world_size
        # Every rank on the host (the CPU, or a stand-in its HAL_STANDIN asks for): fork them from one interpreter
        # that imported torch and the target once (hal.launch.zygote); a stand-in's runtime is loaded after the
        # fork, by its rank; a device runtime is never forked.
        on_host = all(e.get("HAL_BACKEND") in host_backends(e) for e in envs)
        preload = ("torch", target.partition(":")[0]) if on_host else ()
        report = spawn_ranks(commands, envs, deadline_s=deadline_s, stdout=stdout, echo_stderr=echo_stderr,
                             term_grace_s=term_grace_s, fork_from=preload)
        prefix = f"{what}: " if what else ""
        if report.interrupted:  # every rank is stopped: now let the signal do what it does to this process
            signal.raise_signal(report.interrupted)
        if not report.ok:
            raise LaunchFailed(prefix + report.summary(), report)
        missing = [r for r in range(world_size) if not os.path.isfile(result_path(tmp, r))]
        if missing:
            raise LaunchFailed(f"{prefix}rank(s) {missing} exited without writing a result", report)
        values = []
        for r in range(world_size):
            with open(result_path(tmp, r), "rb") as fh:
                values.append(pickle.load(fh))
    return FunctionRun(values, report)
