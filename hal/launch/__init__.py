"""hal.launch — the one way to start ranks: local subprocess ranks, and torchrun lines for several nodes.

Floor 1, beside the backends: it imports only hal/'s contracts (errors, config limits, backend selection for
``hal launch``'s scripts), so every floor above may use it as a library. Who uses what:

- the loop (``hal.parallel.loop.job_runner``) gives each rank of ``hal train`` its environment with ``rank_env``,
  ``free_port`` and ``import_path`` from ``env``, and takes the spawner as an argument (``hal/cli/train.py`` passes
  one built on ``spawn_ranks`` that also prints);
- commands (``hal launch``, ``hal train``, ``hal bench collectives``) call the launcher directly;
- a rank's work is a function named ``"module:function"`` (``run_function``): each rank is
  ``python -m hal.launch.entry``, which imports that name, so the launcher imports none of the libraries whose
  functions it runs (``hal.collectives.bench``, ``hal.conformance.jobs.worker``);
- the conformance suites start their multi-rank jobs through ``Context.launch``, a callable the
  caller puts there (``hal conformance run`` passes ``run_function``; see ``conformance.jobs.launch``).

Local ranks (``spawn_ranks``): each rank is a process in its own session (process group) -- a fresh interpreter,
or, for CPU-only ``hal train`` and ``run_function`` jobs on Linux, forked from a zygote that imported torch and
the rank's module once (``zygote``; ``HAL_RANK_START=exec`` switches it off) -- with
torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) plus the
caller's (HAL_BACKEND, ...); ``run_function`` adds HAL_INIT_METHOD, a ``file://`` rendezvous private
to the run. On the first failure, at the deadline, or on SIGINT/SIGTERM/SIGHUP to the launcher,
every rank's whole process group gets SIGTERM, then SIGKILL; every rank is reaped, and one
``LaunchReport`` names each rank's fate (ok / exit status N / killed by signal S / stopped by the
launcher / timed out) with its last stderr line. Several nodes: ``hal.launch.torchrun`` prints the
plain torchrun line each node runs (hal starts nothing remotely).
"""

from .env import INIT_METHOD_ENV, free_port, rank_env
from .functions import FunctionRun, run_function
from .ranks import LaunchFailed, LaunchReport, RankFate, spawn_ranks

__all__ = [
    "INIT_METHOD_ENV", "FunctionRun", "LaunchFailed", "LaunchReport", "RankFate", "free_port", "rank_env",
    "run_function", "spawn_ranks",
]
