"""Pin each local rank to a block of cores of its own (opt-in: ``hal train --cpu-binding cores``).

Why: an accelerator rank's host thread enqueues every kernel of its step; where that thread is moved
between cores, or shares one with another rank's threads, a host-bound step's time swings from run to
run. Giving each rank a contiguous block of the cores this process may use — blocks kept inside one
NUMA node where the machine reports its nodes — keeps its threads (and its memory) in one place, the
way ``torchrun --numa-binding`` does for the ranks torchrun starts (use that flag on the lines
``--print-multinode`` prints). Off by default: ranks that outnumber the cores (cpu ranks sharing a small
host) are better left to the scheduler, and ``hal train`` refuses to bind them rather than share cores
silently.

The parent decides the blocks (``rank_blocks``) and hands each rank its own in ``HAL_CPUS``; the rank
applies it first thing (``bind_from_env``), before torch starts its threads, which inherit it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from hal.errors import ConfigError

CPUS_ENV = "HAL_CPUS"
MODES = ("none", "cores")
NODE_DIR = Path("/sys/devices/system/node")
MAX_CPU = 1 << 16  # above Linux's largest NR_CPUS (8192): a bigger number is a typo, refused before any list is built


def allowed_cpus() -> list[int]:
    """The cpus this process may run on (its affinity mask), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def numa_groups(cpus: Sequence[int], node_dir: Path = NODE_DIR) -> list[list[int]]:
    """``cpus`` grouped by the NUMA node the kernel reports for them (node order); one group where it reports none."""
    wanted = set(cpus)
    groups = []
    nodes = sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])) if node_dir.is_dir() else []
    for node in nodes:
        try:
            members = [c for c in parse_cpulist((node / "cpulist").read_text()) if c in wanted]
        except (OSError, ValueError):
            return [sorted(wanted)]
        if members:
            groups.append(members)
    covered = {c for g in groups for c in g}
    if not groups or covered != wanted:
        return [sorted(wanted)]
    return groups


def rank_blocks(ranks: int, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """One contiguous block of cpus per rank, every block the same size, none shared.

    Ranks are spread over the NUMA groups in order (rank r on group r × groups / ranks) when they divide
    evenly, so a rank's block never straddles two nodes; otherwise the groups are taken as one list."""
    total = sum(len(g) for g in groups)
    if ranks < 1:
        raise ValueError(f"rank_blocks: {ranks} ranks")
    if ranks > total:
        raise ConfigError(f"--cpu-binding cores: {ranks} local rank(s) but {total} cpu(s) allowed here, and binding "
                          f"gives each rank cores of its own; drop --cpu-binding (the scheduler shares them)")
    if ranks % len(groups) == 0 and all(len(g) >= ranks // len(groups) for g in groups):
        per_group = ranks // len(groups)
        size = min(len(g) for g in groups) // per_group
        return [list(g[i * size:(i + 1) * size]) for g in groups for i in range(per_group)]
    flat = [c for g in groups for c in g]
    size = len(flat) // ranks
    return [flat[i * size:(i + 1) * size] for i in range(ranks)]


def cpulist(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (the kernel's cpulist format)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpulist(text: str) -> list[int]:
    """``"0-2,5"`` → ``[0, 1, 2, 5]``; ValueError on anything else."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"not a cpu range: {part!r}")
        if last >= MAX_CPU:
            raise ValueError(f"cpu {last} is beyond any machine's (at most {MAX_CPU - 1})")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise ValueError(f"no cpus in {text!r}")
    return cpus


def bind_from_env(env: Mapping[str, str] = os.environ) -> list[int] | None:
    """Pin this process to ``HAL_CPUS`` when it is set; the cpus bound (None: not asked)."""
    text = env.get(CPUS_ENV)
    if not text:
        return None
    try:
        cpus = parse_cpulist(text)
    except ValueError as exc:
        raise ConfigError(f"{CPUS_ENV}={text!r}: {exc}; give a cpulist such as 0-3,8") from None
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"{CPUS_ENV}: this platform cannot pin a process to cpus; run without --cpu-binding")
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise ConfigError(f"{CPUS_ENV}={text}: cannot pin to these cpus ({exc.strerror}); run without --cpu-binding") from None
    return cpus
