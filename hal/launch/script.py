"""``hal launch``'s plan: N local ranks of a script, each pinned to its device by hal — checked before any start.

The checks (backend, rank count, one rank per device) run before anything starts; every rank gets
``HAL_BACKEND`` (and the config's precision and fallback) so that ``collectives.init_distributed()``
with no arguments picks the backend and pins the rank to its device from ``LOCAL_RANK``. Each rank
runs the script through the migration shim (``python -m hal.migration SCRIPT``), so a CUDA-written
script runs unmodified on any backend, as under ``hal run``; on a cuda-type backend the shim
patches nothing. The ranks
are started and stopped by ``hal.launch.ranks.spawn_ranks`` (each in its own process group; on a
failure or SIGINT/SIGTERM every group is stopped, so no rank outlives the launcher). The exit
status is the worst status among the ranks that failed on their own (a rank killed by signal S
counts as 128+S; ranks the launcher stopped because another failed do not count).

Multi-node runs use plain torchrun on every node — ``hal launch`` adds nothing there but the
environment variable. Run the same line on each node, changing only ``--node-rank``::

    HAL_BACKEND=cuda torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 \\
        --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29500 --rdzv-id JOB_ID script.py ARGS
    HAL_BACKEND=cuda torchrun --nnodes 2 --nproc-per-node 8 --node-rank 1 \\
        --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29500 --rdzv-id JOB_ID script.py ARGS

Each node may run a different backend (``HAL_BACKEND=ascend`` on one, ``cuda`` on another):
``init_distributed`` starts on gloo everywhere and groups the ranks into one island per
backend, and the collectives bridge joins the islands. ``hal launch --print-multinode NODES``
prints these lines for a given script.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping, Sequence

from hal.backend import Backend
from hal.config.limits import check_local_ranks
from hal.errors import ConfigError, HalError
from hal.standin import host_backends

from . import torchrun
from .env import free_port, rank_env
from .ranks import LaunchReport, spawn_ranks

MIGRATION_MODULE = "hal.migration"  # every rank runs the script through the shim


@dataclass(frozen=True)
class LaunchPlan:
    """What ``hal launch`` will run, decided and checked before any process starts."""

    nproc: int
    backend: Backend
    script: str
    script_args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # exported to every rank

    def torchrun_args(self) -> list[str]:
        """torchrun's arguments for the same single-node run (shown, so the user can rerun it without hal)."""
        return ["--standalone", f"--nproc-per-node={self.nproc}", "-m", MIGRATION_MODULE, self.script, *self.script_args]

    def command_line(self) -> str:
        """The equivalent shell command, for the user to see (and reuse without hal)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} torchrun {shlex.join(self.torchrun_args())}".strip()

    def multinode_lines(self, nodes: int) -> list[str]:
        """One plain-torchrun command per node; placeholders name what the user must fill in."""
        if nodes < 1:
            raise HalError(f"--print-multinode {nodes} is not a node count; give 1 or more")
        return torchrun.rendezvous_lines(nodes, self.nproc, ["-m", MIGRATION_MODULE, self.script, *self.script_args],
                                         {"HAL_BACKEND": self.backend.name})


def plan_launch(
    nproc: int,
    script: str,
    script_args: Sequence[str],
    *,
    backend: str | None = None,
    config: str | None = None,
    check_devices: bool = True,
) -> LaunchPlan:
    """Validate the request and decide the environment; raises one HalError line otherwise.

    ``check_devices=False`` (for ``--print-multinode``) skips the checks that depend on this
    machine's devices: the printed lines run elsewhere.
    """
    from hal.backend_registry import get_backend
    from hal.config import load_config
    from hal.selection import choose_backend, select_backend

    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} is not a rank count; give 1 or more")
    check_local_ranks(nproc, "--nproc")
    if not Path(script).is_file():
        raise ConfigError(f"script {script!r} not found; give the path of a Python file")
    cfg = load_config(config, overrides={"backend": backend})
    if not check_devices:  # 'auto' is resolved here: every rank must be told a backend name
        chosen = choose_backend("auto")[0] if cfg.backend == "auto" else get_backend(cfg.backend)
        return LaunchPlan(nproc, chosen, script, tuple(script_args), {"HAL_BACKEND": chosen.name})
    selection = select_backend(cfg)  # backend available, devices and precision valid — or one line
    chosen = selection.backend
    env = {"HAL_BACKEND": chosen.name, "HAL_PRECISION": cfg.precision, "HAL_FALLBACK": cfg.fallback}
    if chosen.device_type != "cpu":
        _check_device_count(nproc, chosen, selection.devices, cfg.devices != "all", env)
    return LaunchPlan(nproc, chosen, script, tuple(script_args), env)


def _check_device_count(nproc: int, backend: Backend, devices: Sequence[int], explicit: bool, env: dict[str, str]) -> None:
    """One rank per device: refuse more ranks than devices; map explicit config devices by visibility."""
    if nproc > len(devices):
        which = f"the config's devices {list(devices)}" if explicit else f"{len(devices)} visible device(s)"
        raise ConfigError(
            f"--nproc {nproc} but backend '{backend.name}' has {which}; "
            f"use --nproc {len(devices)} or less (one rank per device)"
        )
    var = backend.visible_devices_env
    if explicit and var:
        # Ranks pick their device by LOCAL_RANK, so restrict what they see to the chosen devices
        # (composed with any visibility list already in force, whose indices they are).
        current = os.environ.get(var)
        physical = current.split(",") if current else [str(i) for i in range(backend.device_count())]
        env[var] = ",".join(physical[i].strip() for i in devices)


def run_launch(plan: LaunchPlan, *, echo_stderr: IO[str] | None = None) -> LaunchReport:
    """Run the plan's ranks until all end, one fails, or this process is signalled; the report."""
    port = free_port()
    base = {**os.environ, **plan.env}
    envs = [rank_env(r, plan.nproc, port, base=base) for r in range(plan.nproc)]
    # -u: ranks' lines arrive as written; the shim module runs the script as __main__. Ranks on the host (the CPU,
    # or a stand-in HAL_STANDIN asks for) fork from one interpreter that imported torch once (hal.launch.zygote);
    # a device runtime is never forked.
    command = [sys.executable, "-u", "-m", MIGRATION_MODULE, plan.script, *plan.script_args]
    on_host = plan.backend.name in host_backends(base)
    return spawn_ranks([command] * plan.nproc, envs, echo_stderr=echo_stderr if echo_stderr is not None else sys.stderr,
                       fork_from=("torch",) if on_host else ())
