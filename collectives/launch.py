"""``hal launch``: N local ranks of a script under torchrun, each pinned to its device by hal.

A thin layer over ``torch.distributed.run`` (torchrun), run in this process: it checks the
backend and the rank count *before* anything starts, exports ``HAL_BACKEND`` (and the
config's precision and fallback) to every rank so that ``collectives.init_distributed()``
with no arguments picks the backend and pins the rank to its device from ``LOCAL_RANK``, and
then lets torchrun's agent start, watch and stop the ranks. torchrun puts every rank in its
own process group and, when a rank fails or the launcher gets SIGINT/SIGTERM, signals every
group (SIGKILL after a grace period), so no rank outlives the launcher. The exit status is
the worst status among the ranks that failed on their own (a rank killed by signal S counts
as 128+S; ranks torchrun stopped because another failed do not count).

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
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from hal.backend import Backend
from hal.errors import ConfigError, HalError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchPlan:
    """What ``hal launch`` will run, decided and checked before any process starts."""

    nproc: int
    backend: Backend
    script: str
    script_args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # exported to every rank

    def torchrun_args(self) -> list[str]:
        """torchrun's own arguments for the single-node run (what ``hal launch`` executes)."""
        return ["--standalone", f"--nproc-per-node={self.nproc}", self.script, *self.script_args]

    def command_line(self) -> str:
        """The equivalent shell command, for the user to see (and reuse without hal)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} torchrun {shlex.join(self.torchrun_args())}".strip()

    def multinode_lines(self, nodes: int) -> list[str]:
        """One plain-torchrun command per node; placeholders name what the user must fill in."""
        env = f"HAL_BACKEND={shlex.quote(self.backend.name)}"
        lines = []
        for node in range(nodes):
            args = [
                f"--nnodes={nodes}", f"--nproc-per-node={self.nproc}", f"--node-rank={node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=NODE0_HOST:{DEFAULT_PORT}", "--rdzv-id=JOB_ID",
                self.script, *self.script_args,
            ]
            lines.append(f"{env} torchrun {shlex.join(args)}")
        return lines


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
        raise ConfigError(f"hal launch: --nproc {nproc} is not a rank count; give 1 or more")
    if not Path(script).is_file():
        raise ConfigError(f"hal launch: script {script!r} not found; give the path of a Python file")
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
            f"hal launch: --nproc {nproc} but backend '{backend.name}' has {which}; "
            f"use --nproc {len(devices)} or less (one rank per device)"
        )
    var = backend.visible_devices_env
    if explicit and var:
        # Ranks pick their device by LOCAL_RANK, so restrict what they see to the chosen devices
        # (composed with any visibility list already in force, whose indices they are).
        current = os.environ.get(var)
        physical = current.split(",") if current else [str(i) for i in range(backend.device_count())]
        env[var] = ",".join(physical[i].strip() for i in devices)


def run_launch(plan: LaunchPlan) -> int:
    """Run the plan under torchrun's agent, in this process; the worst rank's exit status."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.update(plan.env)
    if plan.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, minus its banner
    try:
        run(parse_args(plan.torchrun_args()))
    except ChildFailedError as exc:
        return _report_failures(exc)
    except SignalException as exc:
        print(f"hal launch: stopped by {signal.Signals(exc.sigval).name}; every rank was stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def _report_failures(exc: Any, who: str = "hal launch") -> int:
    """One line per failed rank, and the worst status among the ranks that failed on their own.

    When one rank fails, torchrun stops the others with SIGTERM (then SIGKILL); those show up as
    failures too but are consequences, so they decide the status only when nothing else failed.
    Statuses follow the shell: exit status N, or 128+S for a rank killed by signal S.
    """
    stopped = {-signal.SIGTERM, -signal.SIGKILL}
    codes = {rank: int(failure.exitcode) for rank, failure in sorted(exc.failures.items())}
    causes = {rank: code for rank, code in codes.items() if code not in stopped} or codes
    for rank, code in codes.items():
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"
        note = "" if rank in causes else ", stopped by the launcher after another rank failed"
        print(f"{who}: rank {rank} failed ({how}{note})", file=sys.stderr)
    return max((128 - code if code < 0 else code) for code in causes.values()) if causes else 1


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def launch_main(
    nproc: int,
    script: str,
    script_args: Sequence[str],
    *,
    backend: str | None = None,
    config: str | None = None,
    print_multinode: int | None = None,
) -> int:
    """The ``hal launch`` command: validate, then print the multi-node lines or run."""
    if print_multinode is not None:
        if print_multinode < 1:
            raise HalError(f"hal launch: --print-multinode {print_multinode} is not a node count; give 1 or more")
        plan = plan_launch(nproc, script, script_args, backend=backend, config=config, check_devices=False)
        for line in plan.multinode_lines(print_multinode):
            print(line, file=sys.stderr)
        return 0
    plan = plan_launch(nproc, script, script_args, backend=backend, config=config)
    print(f"hal launch: {plan.nproc} rank(s) on backend {plan.backend.name}: {plan.command_line()}", file=sys.stderr)
    return run_launch(plan)
