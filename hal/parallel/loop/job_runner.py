"""``hal train CONFIG``: check the whole run, then start one process per rank of the plan on this machine.

Everything that can be checked without starting a process is checked first — model, plan, train
section, every stage's backend (available, enough devices), the data, the precision, and with
``--resume`` the checkpoint against the model and the step count — and a problem is one
``hal: error:`` line and exit 2 with nothing started.

Local run: one process per rank, started and watched by the spawner the caller hands in (``hal train``
passes hal.launch's: every rank in its own process group, SIGTERM then SIGKILL for all when one fails
or on Ctrl-C). Each rank has an environment of its own: ``HAL_BACKEND`` of its stage (stages own
consecutive ranks; ``LOCAL_RANK`` counts a rank among this host's ranks of the same backend, so each
backend's ranks take devices 0, 1, ... of that backend). The validated run is written once to
``<run dir>/job.json`` (``parallel.config.job``) and each rank runs ``python -m hal.parallel.loop.trainer <run
dir>/job.json`` (see there): ranks never read the YAML. The exit status is the worst status among the
ranks that failed on their own, as for ``hal launch``.

Several nodes: ``hal train --print-multinode NODES`` prints one plain torchrun line per node (hal.launch's
torchrun path, from ``hal/cli/train.py``) for the node blocks ``split_nodes`` chooses, and starts nothing.
The ranks are cut into NODES contiguous blocks — at stage boundaries when there are enough stages,
otherwise also between TP groups (a TP group never spans nodes) — and the lines use torchrun's static
rendezvous (``--master-addr``/``--node-rank``), under which node i's ranks follow node i-1's: the node
rank decides which stages a node runs, which dynamic (c10d) rendezvous does not guarantee. The
output starts with a shell here-document that writes the job file; run it on every node (or once on
a filesystem the nodes share) so that the run directory path holds it everywhere. Nothing is written
or started by ``--print-multinode`` itself. Its job file leaves each stage's precision plan to the
ranks (``stage_precision`` null): the printing host's devices are not the nodes'.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Sequence

from hal.cpu_binding import CPUS_ENV, allowed_cpus, cpulist, numa_groups, rank_blocks
from hal.errors import ConfigError, HalError
from hal.launch.env import free_port, import_path, rank_env
from hal.parallel.config.job import Job, write_job
from hal.parallel.config.topology import Topology
from hal.parallel.loop.preflight import TRAIN, Request, job, preflight
from hal.parallel.schedules.pairs import in_brief, stage_pairs

RankSpawner = Callable[[Sequence[Sequence[str]], Sequence[dict[str, str]]], int]
"""Runs one command per rank with that rank's (extra) environment, reports failures itself; the exit status."""


def prepare(config: str, *, steps: int | None = None, resume: str | None = None, run_dir: str | None = None,
            check_backends: bool = True, profile: bool = False, init_from: str | None = None,
            cpu_binding: str = "none", backend: str | None = None) -> Job:
    """Validate the whole run (``preflight.TRAIN``); one ConfigError line for the first problem.

    ``check_backends`` False (``--print-multinode``): this host is not where the ranks run, so
    backends are not probed and each stage's precision is left to its ranks. ``init_from``
    (``--init-from DIR``, or the config's ``model: {hf: DIR, weights: true}``): the Hugging Face
    checkpoint's files are checked here against the model; a resumed run loads its checkpoint instead.
    ``cpu_binding`` ("cores"): each local rank is pinned to cores of its own; refused where the ranks outnumber them.
    ``backend`` (``--backend X``): every stage runs on X, whatever the file names.
    """
    request = Request(config, steps=steps, resume=resume, run_dir=run_dir, init_from=init_from, cpu_binding=cpu_binding,
                      profile=profile, local=check_backends, backend=backend)
    return job(preflight(request, TRAIN))


# --- the ranks' environment ----------------------------------------------------------------------------------


REPLICA_ENV = "HAL_REPLICA"  # a rank's replica (parallel.replicas), for the failure report only


def rank_envs(job: Job, port: int) -> dict[int, dict[str, str]]:
    """torchrun's variables for every local rank, plus HAL_BACKEND of its stage."""
    world = job.world_size
    topologies = job.topologies()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
    pythonpath = import_path(os.environ)  # a rank imports what hal train does, this checkout included
    seen: dict[str, int] = {}
    envs: dict[int, dict[str, str]] = {}
    blocks = local_cpu_blocks(job)
    for rank in range(world):
        backend = next(t for t in topologies if rank in t.ranks).backend_of(rank)
        local = seen.get(backend, 0)
        seen[backend] = local + 1
        envs[rank] = rank_env(rank, world, port, local_rank=local, local_world_size=world, base={}, extra={
            "HAL_BACKEND": backend, "HAL_PRECISION": job.precision, "HAL_FALLBACK": job.fallback,
            "OMP_NUM_THREADS": threads, "PYTHONPATH": pythonpath,
        })
        if job.replicas.several:  # the launcher's report names a failing rank's replica
            envs[rank][REPLICA_ENV] = str(job.replicas.replica_of(rank))
        if blocks is not None:  # pinned: the rank's threads are its cores (unless the user set OMP_NUM_THREADS)
            envs[rank][CPUS_ENV] = cpulist(blocks[rank])
            envs[rank]["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(len(blocks[rank]))
    return envs


def local_cpu_blocks(job: Job) -> list[list[int]] | None:
    """Each local rank's cpus under ``--cpu-binding cores`` (None when off)."""
    if job.cpu_binding == "none":
        return None
    return rank_blocks(job.world_size, numa_groups(allowed_cpus()))


# --- several nodes ----------------------------------------------------------------------------------------------


def _cut_candidates(topologies: Sequence[Topology], nodes: int) -> list[int]:
    """Ranks where a node may start, the coarsest that give enough blocks: replica boundaries (a replica's ranks,
    often an island of their own, stay together), then stage boundaries, then TP-group boundaries."""
    replica_starts = [t.stages[0].offset for t in topologies]
    if nodes <= len(replica_starts):
        return replica_starts
    stage_starts = [m.offset for t in topologies for m in t.stages]
    if nodes <= len(stage_starts):
        return stage_starts
    return [m.offset + d * m.tp for t in topologies for m in t.stages for d in range(m.dp)]


def split_nodes(topologies: Topology | Sequence[Topology], nodes: int) -> list[range]:
    """NODES contiguous rank blocks with the largest as small as possible (dynamic programming over cuts), over one
    plan's topology or every replica's (``Job.topologies``)."""
    topologies = [topologies] if isinstance(topologies, Topology) else list(topologies)
    world = max(m.offset + m.tp * m.dp for t in topologies for m in t.stages)
    cuts = _cut_candidates(topologies, nodes) + [world]
    if nodes > len(cuts) - 1:
        raise ConfigError(
            f"--print-multinode {nodes}: the plan has only {len(cuts) - 1} TP group(s) to place, and a TP "
            f"group stays on one node; use at most {len(cuts) - 1} nodes"
        )
    inf = (float("inf"), [])
    best: list[list[tuple[float, list[int]]]] = [[inf] * len(cuts) for _ in range(nodes + 1)]
    best[0][0] = (0, [0])
    for j in range(1, nodes + 1):
        for i in range(1, len(cuts)):
            for k in range(i):
                worst, path = best[j - 1][k]
                size = max(worst, cuts[i] - cuts[k])
                if path and size < best[j][i][0]:
                    best[j][i] = (size, path + [i])
    path = best[nodes][len(cuts) - 1][1]
    return [range(cuts[a], cuts[b]) for a, b in zip(path, path[1:])]


# --- the local run ------------------------------------------------------------------------------------------------


def run_local(job: Job, spawn: RankSpawner) -> int:
    """Start every rank through ``spawn`` and wait; the worst rank's status (``spawn`` stops them all on a failure)."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "hal.parallel.loop.trainer", *job.rank_args()]
    envs = rank_envs(job, free_port())
    return spawn([command] * job.world_size, [envs[r] for r in range(job.world_size)])


# --- what the command shows ------------------------------------------------------------------------------------


def _layer_text(mesh: Any) -> str:
    """``0-3`` (``3`` for one layer), or one span per chunk (``0-1+4-5``) when the stage interleaves."""
    return "+".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in mesh.layer_ranges)


def describe(job: Job) -> str:
    """One line: every stage's backend, grid, ranks and layers (and how it runs DualPipeV's pairs), the steps and the
    run directory."""
    parts = []
    for index, replica in enumerate(job.replicas.replicas):
        plan, share = replica.plan, replica.rows
        rows = f"replica {index} ({'auto' if share is None else share} rows) " if job.replicas.several else ""
        for m in replica.topology().stages:
            grid = " × ".join(f"{name}{value}" for name, value in (("tp", m.tp), ("dp", m.dp)) if value > 1) or "1 device"
            sp = " sp" if m.sp else ""
            # DualPipeV's pairs: "at once", or "in turn: why: details"
            pairs = stage_pairs(plan.schedule, plan.num_stages, plan.micro_batches, m, job.model)
            said = "" if pairs is None else f" pairs {in_brief(pairs)}"
            parts.append(f"{rows}stage {m.index} {m.backend} {grid}{sp} ranks {m.ranks[0]}-{m.ranks[-1]} layers "
                         f"{_layer_text(m)}{said}")
            rows = ""
    resumed = f", resuming at step {job.start}" if job.resume else ""
    blocks = local_cpu_blocks(job)
    bound = "" if blocks is None else "; cpus " + " ".join(f"r{r}:{cpulist(b)}" for r, b in enumerate(blocks))
    sync = f"; replicas sync every {job.replicas.sync.every} step(s)" if job.replicas.several else ""
    return f"{job.world_size} rank(s): {'; '.join(parts)}{sync}; steps {job.steps}{resumed}{bound}; run dir {job.run_dir}"


def read_summary(job: Job) -> dict[str, Any]:
    """The summary the writer rank left in the run directory."""
    path = job.run_dir / "summary.json"
    if not path.is_file():
        raise HalError(f"the ranks finished but wrote no {path}; see their output above")
    summary: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return summary


__all__ = ["Job", "RankSpawner", "describe", "prepare", "rank_envs", "read_summary", "run_local", "split_nodes", "write_job"]
