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
torchrun path, from ``cli/train.py``) for the node blocks ``split_nodes`` chooses, and starts nothing.
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
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from hal.cpu_binding import CPUS_ENV, MODES as CPU_BINDINGS, allowed_cpus, cpulist, numa_groups, rank_blocks
from hal.errors import ConfigError, HalError
from hal.config.limits import check_local_ranks
from hal.run_dirs import check_creatable_dir, check_creatable_file, new_run_dir

from hal.parallel.config.job import Job, write_job
from hal.parallel.config.run import RunConfig
from hal.parallel.config.topology import Topology

if TYPE_CHECKING:
    from hal.precision import PrecisionPlan

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # so ranks import this checkout, installed or not
RankSpawner = Callable[[Sequence[Sequence[str]], Sequence[dict[str, str]]], int]
"""Runs one command per rank with that rank's (extra) environment, reports failures itself; the exit status."""


# --- validation -------------------------------------------------------------------------------------------


TRAIN_PRECISIONS = ("fp32", "tf32", "bf16-mixed", "fp16-mixed", "fp8-mixed")


def check_training(run: RunConfig, fallback: str) -> "list[PrecisionPlan | None]":
    """What hal train (and hal plan, which shows the same verdict) checks beyond the schema: a top-level
    backend that the stages contradict (hal train would not use it), and each stage's precision."""
    stage_backends = sorted({stage.backend for stage in run.plan.stages})
    if run.hal.backend != "auto" and stage_backends != [run.hal.backend]:
        where = run.hal.origins.get("backend", "config")
        raise ConfigError(f"{where}: backend {run.hal.backend!r} is not used by hal train: each stage names its own "
                          f"({', '.join(stage_backends)}); remove the top-level backend or make it match")
    plans = _stage_precision(run, fallback)
    _check_moe_compile(run, fallback)
    _check_loop(run)
    if run.train.tensorboard:  # the writer rank opens the event file: the package must be there before any rank starts
        from hal.parallel.observe.tensorboard import check_available

        check_available(f"{run.origin}: train.tensorboard")
    _check_token_file(run)
    _check_memory(run)
    return plans


def _check_moe_compile(run: RunConfig, fallback: str) -> None:
    """A compiled MoE stage compiles around its experts, a recorded downgrade: ``fallback: error`` refuses it here,
    before any rank starts (``compile_stage.compile_layers``)."""
    if fallback != "error" or not run.model.moe_num_experts:
        return
    for k, stage in enumerate(run.plan.stages):
        if run.plan.stage_compiles(k) and run.model.moe_layers(run.plan.stage_layers(k)):
            raise ConfigError(f"{run.origin}: stage {k} (parallel.stages[{k}]) compiles MoE layers, whose experts stay "
                              "eager (their block sizes are read on the host): a downgrade, which fallback: error refuses; "
                              "set fallback: warn, or compile: false on that stage")


def _check_token_file(run: RunConfig) -> None:
    """A token file in train.data: exists, whole ids, index agrees, every id in the vocabulary, a row fits."""
    from hal.parallel.data.token_file import check_token_file, is_token_file

    if is_token_file(run.train.data):
        check_token_file(run.train.data, seq_len=run.train.seq_len or run.model.max_seq_len,
                         vocab_size=run.model.vocab_size, validation=run.train.validation, where=f"{run.origin}: train.data")


def _check_loop(run: RunConfig) -> None:
    """The loop's options against the plan: what the trainer could not do right is refused here, in one line."""
    train = run.train
    if train.eval_every is not None and not (train.data.endswith(".bin") and train.validation > 0):
        raise ConfigError(f"{run.origin}: train.eval_every needs a validation part: train.data a token file (.bin, see "
                          f"hal data prepare) and train.validation > 0 (got data {train.data!r}, validation "
                          f"{train.validation}); set both or drop eval_every")
    if train.grad_clip is not None and run.plan.zero1 and any(s.dp > 1 for s in run.plan.stages):
        raise ConfigError(f"{run.origin}: train.grad_clip with parallel.zero1: ZeRO-1 sums the gradients inside its "
                          "step, after the norm would be taken; drop one of them")
    if train.warmup_steps >= train.steps and train.lr_schedule != "constant":
        raise ConfigError(f"{run.origin}: train.warmup_steps {train.warmup_steps} leaves no step of the "
                          f"{train.lr_schedule} decay before train.steps {train.steps}; lower warmup_steps")
    if train.min_lr > train.lr:
        raise ConfigError(f"{run.origin}: train.min_lr {train.min_lr} is above train.lr {train.lr}; decay ends below "
                          "where it starts — lower min_lr")


def _check_memory(run: RunConfig) -> None:
    """The training state's lower bound against each available stage's memory (hal.parallel.config.memory)."""
    from hal.backend_registry import get_backend

    from hal.parallel.config.memory import MemoryPool, check_memory

    pools: dict[int, MemoryPool | None] = {}
    for index, stage in enumerate(run.plan.stages):
        backend = get_backend(stage.backend)
        if not backend.is_available():
            pools[index] = None
        elif backend.device_type == "cpu":
            pools[index] = MemoryPool("host", backend.mem_get_info()[1])
        else:
            memory = backend.capabilities().memory_bytes
            pools[index] = None if memory is None else MemoryPool(backend.name, memory)
    check_memory(run.model, run.plan, pools, run.origin)


def _stage_precision(run: RunConfig, fallback: str) -> "list[PrecisionPlan | None]":
    """Each stage's precision plan, resolved once here (None where the backend is not available on this host).

    A stage runs its own ``precision:`` or else the run's, resolved against its own device by the
    policy (downgrades recorded). fp16-mixed on any stage (asked for, or bf16 turned into fp16 on a
    device without native bf16) turns on the pipeline's one dynamic loss scale for the whole step
    (``parallel.loop.loss_scale``). fp8-mixed runs the decoder layers' forward matmuls in fp8 where the
    device has native fp8 (``parallel.models.linear``) and is refused elsewhere by the policy, in one line.
    """
    from hal.backend_registry import get_backend
    from hal.errors import UnsupportedError
    from hal.precision import resolve_precision

    plans: list[PrecisionPlan | None] = []
    for index, stage in enumerate(run.plan.stages):
        precision = stage.precision or run.hal.precision
        where = (f"{run.origin}: parallel.stages[{index}].precision" if stage.precision
                 else f"{run.hal.origins.get('precision', 'config')}: precision")
        if precision not in TRAIN_PRECISIONS:
            raise ConfigError(f"{where} {precision!r}: hal train runs {', '.join(TRAIN_PRECISIONS)}; use bf16-mixed")
        if precision == "fp8-mixed" and run.plan.schedule.splits_backward:
            raise ConfigError(f"{where} fp8-mixed: its fp8 linears compute both gradients at once, which schedule "
                              f"{run.plan.schedule} needs split; use schedule: 1f1b or bf16-mixed on that stage")
        backend = get_backend(stage.backend)
        if not backend.is_available():
            plans.append(None)  # the plan check reports unavailable backends with their reason
            continue
        try:
            plans.append(resolve_precision(precision, backend, backend.capabilities(), fallback))  # type: ignore[arg-type]
        except UnsupportedError as exc:
            raise UnsupportedError(f"{where}: stage {index} ({stage.backend}): {exc}") from None
    return plans


def _default_run_dir(config: str) -> Path:
    """``runs/<config name>-<date-time>``, with a suffix if that exists already."""
    return new_run_dir(Path(config).stem)


def _resume_point(resume: str | None, run: RunConfig, steps: int) -> tuple[Path | None, int]:
    from hal.parallel.state.checkpoint import check_compatible, read_meta, resolve

    if resume is None:
        return None, 0
    checkpoint = resolve(resume)
    meta = read_meta(checkpoint)
    check_compatible(meta, checkpoint, run.model, steps)
    return checkpoint.resolve(), int(meta["step"])


def prepare(config: str, *, steps: int | None = None, resume: str | None = None, run_dir: str | None = None,
            check_backends: bool = True, profile: bool = False, init_from: str | None = None,
            cpu_binding: str = "none") -> Job:
    """Validate the whole run; one ConfigError line for the first problem.

    ``check_backends`` False (``--print-multinode``): this host is not where the ranks run, so
    backends are not probed and each stage's precision is left to its ranks. ``init_from``
    (``--init-from DIR``, or the config's ``model: {hf: DIR, weights: true}``): the Hugging Face
    checkpoint's files are checked here against the model; a resumed run loads its checkpoint instead.
    ``cpu_binding`` ("cores"): each local rank is pinned to cores of its own; refused where the ranks outnumber them.
    """
    from hal.parallel.data.batches import check_corpus
    from hal.parallel.config.run import load_run_config
    from hal.parallel.data.token_file import is_token_file

    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps} is not a step count; give 1 or more")
    run = load_run_config(config, check_backends=check_backends, init_from=init_from)
    if check_backends:  # a local run: every rank is a process on this host
        check_local_ranks(run.plan.world_size, f"{run.origin}: the plan's world size")
    if cpu_binding not in CPU_BINDINGS:
        raise ConfigError(f"--cpu-binding {cpu_binding}: use one of {', '.join(CPU_BINDINGS)}")
    if cpu_binding != "none" and check_backends:
        rank_blocks(run.plan.world_size, numa_groups(allowed_cpus()))  # refuses more ranks than cores, before any start
    precision = check_training(run, run.hal.fallback if check_backends else "allow")
    if run.train.data == "corpus":
        check_corpus(run.train.seq_len or run.model.max_seq_len)
    if is_token_file(run.train.data):  # ranks may start elsewhere (another cwd, --print-multinode): an absolute path
        run = replace(run, train=replace(run.train, data=str(Path(run.train.data).resolve())))
    total = steps or run.train.steps
    checkpoint, start = _resume_point(resume, run, total)
    where = f"--init-from {init_from}" if init_from is not None else f"{run.origin}: model.hf {run.init_from}"
    weights = _weights(run, where, check=checkpoint is None and check_backends)  # multinode: the files are the nodes'
    directory = Path(run_dir) if run_dir else _default_run_dir(config)
    log_file = Path(run.train.log_file) if run.train.log_file else directory / "train.jsonl"
    ckpt_dir = Path(run.train.checkpoint_dir) if run.train.checkpoint_dir else directory / "checkpoints"
    check_creatable_dir(directory, "--run-dir" if run_dir else "run directory")
    check_creatable_file(log_file, f"{run.origin}: train.log_file" if run.train.log_file else "log file")
    check_creatable_dir(ckpt_dir, f"{run.origin}: train.checkpoint_dir" if run.train.checkpoint_dir else "checkpoint directory")
    stage_precision = tuple(p.to_dict() if p is not None and check_backends else None for p in precision)
    hal = {k: v for k, v in run.hal.to_dict().items() if k != "origins"}
    return Job(run.origin, hal, run.model, run.plan, run.train, Topology.from_plan(run.plan), stage_precision, total, start,
               directory, log_file, ckpt_dir, checkpoint, profile, weights, cpu_binding, run.planned)


def _weights(run: RunConfig, where: str, check: bool) -> Path | None:
    """The Hugging Face checkpoint the ranks slice their weights from, its files checked against the model
    (unless resuming: the ranks then load the training checkpoint, and the path is only recorded)."""
    from hal.parallel.state.hf_checks import check_weights

    if run.init_from is None:
        return None
    directory = Path(run.init_from).expanduser().resolve()  # ranks may start in another cwd
    if check:
        check_weights(directory, run.model, where)
    return directory


# --- the ranks' environment ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_envs(job: Job, port: int) -> dict[int, dict[str, str]]:
    """torchrun's variables for every local rank, plus HAL_BACKEND of its stage."""
    topology, world = job.topology, job.topology.world_size
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
    pythonpath = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    seen: dict[str, int] = {}
    envs: dict[int, dict[str, str]] = {}
    blocks = local_cpu_blocks(job)
    for rank in range(world):
        backend = topology.backend_of(rank)
        local = seen.get(backend, 0)
        seen[backend] = local + 1
        envs[rank] = {
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HAL_BACKEND": backend,
            "HAL_PRECISION": job.precision, "HAL_FALLBACK": job.fallback,
            "OMP_NUM_THREADS": threads, "PYTHONPATH": pythonpath,
        }
        if blocks is not None:  # pinned: the rank's threads are its cores (unless the user set OMP_NUM_THREADS)
            envs[rank][CPUS_ENV] = cpulist(blocks[rank])
            envs[rank]["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(len(blocks[rank]))
    return envs


def local_cpu_blocks(job: Job) -> list[list[int]] | None:
    """Each local rank's cpus under ``--cpu-binding cores`` (None when off)."""
    if job.cpu_binding == "none":
        return None
    return rank_blocks(job.topology.world_size, numa_groups(allowed_cpus()))


# --- several nodes ----------------------------------------------------------------------------------------------


def _cut_candidates(topology: Topology, nodes: int) -> list[int]:
    """Ranks where a node may start: stage boundaries, or TP-group boundaries when stages are too few."""
    stage_starts = [m.offset for m in topology.stages]
    if nodes <= len(stage_starts):
        return stage_starts
    return [m.offset + d * m.tp for m in topology.stages for d in range(m.dp)]


def split_nodes(topology: Topology, nodes: int) -> list[range]:
    """NODES contiguous rank blocks with the largest as small as possible (dynamic programming over cuts)."""
    cuts = _cut_candidates(topology, nodes) + [topology.world_size]
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
    envs = rank_envs(job, _free_port())
    return spawn([command] * job.topology.world_size, [envs[r] for r in range(job.topology.world_size)])


# --- what the command shows ------------------------------------------------------------------------------------


def _layer_text(mesh: Any) -> str:
    """``0-3`` (``3`` for one layer), or one span per chunk (``0-1+4-5``) when the stage interleaves."""
    return "+".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in mesh.layer_ranges)


def describe(job: Job) -> str:
    """One line: every stage's backend, grid, ranks and layers, the steps and the run directory."""
    parts = []
    for m in job.topology.stages:
        grid = " × ".join(f"{name}{value}" for name, value in (("tp", m.tp), ("dp", m.dp)) if value > 1) or "1 device"
        sp = " sp" if m.sp else ""
        parts.append(f"stage {m.index} {m.backend} {grid}{sp} ranks {m.ranks[0]}-{m.ranks[-1]} layers {_layer_text(m)}")
    resumed = f", resuming at step {job.start}" if job.resume else ""
    blocks = local_cpu_blocks(job)
    bound = "" if blocks is None else "; cpus " + " ".join(f"r{r}:{cpulist(b)}" for r, b in enumerate(blocks))
    return f"{job.topology.world_size} rank(s): {'; '.join(parts)}; steps {job.steps}{resumed}{bound}; run dir {job.run_dir}"


def read_summary(job: Job) -> dict[str, Any]:
    """The summary the writer rank left in the run directory."""
    path = job.run_dir / "summary.json"
    if not path.is_file():
        raise HalError(f"the ranks finished but wrote no {path}; see their output above")
    summary: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return summary


__all__ = ["Job", "RankSpawner", "check_training", "describe", "prepare", "rank_envs", "read_summary", "run_local", "split_nodes", "write_job"]
