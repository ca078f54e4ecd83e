"""Multi-rank conformance jobs (collectives suite, pipeline check) through the launcher the Context carries.

The conformance floor cannot import the launcher (``hal.launch`` is the floor above), so the
caller puts one in ``Context.launch`` — ``hal conformance run`` passes ``hal.launch.run_function``.
A job's ranks run ``hal.conformance.jobs.worker:run_rank`` (named, so the launcher imports it, never the
reverse); the launcher bounds the whole job by its deadline, stops every rank when one fails, and
its one-line report (each rank's fate and last error line) becomes ``JobFailed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hal.errors import HalError

RANK_FUNCTION = "hal.conformance.jobs.worker:run_rank"
Launcher = Callable[..., Any]
"""``launch(target, world_size, kwargs, *, deadline_s, what, env)`` -> ``.values`` (rank order) and ``.seconds``;
raises a HalError (with ``.pids``) naming every rank's fate. ``hal.launch.run_function`` is one."""


class JobFailed(HalError):
    """A rank crashed, raised, or the job ran past its deadline (every rank was stopped and reaped).

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


def run_job(
    launch: Launcher | None,
    job: str,
    spec: Mapping[str, Any],
    world_size: int,
    backend: str,
    *,
    timeout_s: float,
    collective_timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> JobResult:
    """Run ``job`` (a name in ``conformance.jobs.worker.JOBS``, or ``"module:callable"``) on ``world_size`` ranks of ``backend``.

    ``spec`` is handed to every rank unchanged (picklable data: names and numbers). Returns each
    rank's value; raises ``JobFailed`` with the failing rank's last error line otherwise.
    """
    what = f"{job} job on {world_size} rank(s) of {backend}"
    if launch is None:
        raise JobFailed(f"{what}: no rank launcher in the Context; pass launch=hal.launch.run_function "
                        "(hal conformance run does)")
    coll_timeout = collective_timeout_s if collective_timeout_s is not None else max(10.0, timeout_s / 2)
    # HAL_ISLANDS empty: a job measures one native group unless ``env`` says otherwise.
    rank_env = {"HAL_BACKEND": backend, "HAL_ISLANDS": "", **({"OMP_NUM_THREADS": "1"} if backend == "cpu" else {}), **(env or {})}
    kwargs = {"job": job, "spec": dict(spec), "backend": backend, "collective_timeout_s": coll_timeout}
    try:
        run = launch(RANK_FUNCTION, world_size, kwargs, deadline_s=timeout_s, what=what, env=rank_env)
    except HalError as exc:
        raise JobFailed(str(exc), tuple(getattr(exc, "pids", ()))) from None
    return JobResult(list(run.values), float(run.seconds))
