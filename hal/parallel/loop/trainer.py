"""One rank of ``hal train``: build this rank's stage, train, log, checkpoint.

Started by ``hal train`` (``parallel.loop.job_runner``) once per rank of the plan, or by plain torchrun on
several nodes (``hal train --print-multinode``):

    python -m hal.parallel.loop.trainer RUN_DIR/job.json

with the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``)
and ``HAL_BACKEND`` = the backend of this rank's stage (taken from the topology when unset). The job
file (``parallel.config.job``) is the run ``hal train`` validated before starting anything: a rank never
reads the YAML and validates nothing again. It resolves its backend once, joins the world
(``collectives.init_distributed``), builds the topology's groups and its ``PipelineEngine`` (handed
that backend object), and steps AdamW over batches that are a pure function of (seed, step)
(``parallel.data.batches``).

The writer — the first rank of the last stage, which holds the loss — gathers every rank's time
breakdown each step (one small gather on the host group), prints the progress line on stderr (and a line
per evaluation; ``parallel.observe.progress``: plain lines into ``hal train``'s pipe, which redraws them in
place when its own stderr is a terminal) and appends one JSON line per step to the log file (with ``train.tensorboard``, the same scalars
to an event file
in ``RUN_DIR/tensorboard``, ``parallel.observe.tensorboard``); at the end it writes ``summary.json`` in the run
directory, which ``hal train`` prints with ``--json``.

Under ``--profile`` the last step is also recorded as a timeline: every rank passes one barrier
before it and marks its start beside the host clock (the previous profiled step already drained the
device, so the mark is taken at once), and after it sends its spans — each compute action and P2P post or wait, read from the
step's timer marks — to the writer, which writes ``RUN_DIR/timeline.json`` (``parallel.observe.timeline``)
for ``hal train`` to draw.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TextIO

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from hal import strict_json
from hal.errors import HalError
from hal.parallel.config.job import Job
from hal.parallel.loop import measured_order
from hal.parallel.loop.optim_schedule import clip_global_norm, decoupled_adamw, learning_rate, set_learning_rate
from hal.parallel.loop.restarts import Restart, cadence, restart_record, restart_records
from hal.parallel.models.layers import expert_shard
from hal.parallel.observe.progress import Progress, SlowStepNotice
from hal.parallel.observe.records import StepNotes, merge_moe_tallies, run_record, run_summary, standin_summary

if TYPE_CHECKING:
    from hal.backend import Backend
    from hal.parallel.config.plan import ParallelPlan, StagePlan
    from hal.parallel.loop.loss_scale import PipelineLossScaler
    from hal.parallel.pipeline.engine import PipelineEngine
    from hal.parallel.replicas.replica_set import ReplicaSet
    from hal.precision import PrecisionPlan


@dataclass
class RankRun:
    """Everything one rank trains with."""

    job: Job
    engine: PipelineEngine
    optimizer: Optimizer  # torch.optim.AdamW or parallel.loop.zero's ZeRO-1 AdamW
    replicas: ReplicaSet  # this rank's replica, its rows and everything between replicas (one replica: no-ops)
    rank: int
    seq: int
    start: int  # steps already done (from a checkpoint)
    steps: int  # the run stops after this many steps in total
    peak_tflops: float = float("nan")  # this rank's device's dense peak for the run's precision (catalog)
    scaler: PipelineLossScaler | None = None  # when any stage runs fp16
    grad_norm: float | None = None  # the last clipped step's global gradient norm (train.grad_clip)
    clip_skip: frozenset[str] = frozenset()  # parameters another rank counts in the global norm (a tied head copy)
    restart: Restart | None = None  # started again by the launcher (``restarts``): resumed from the latest checkpoint

    @property
    def writer(self) -> int:
        """The global rank that logs (replica 0's first rank of the stage holding the loss)."""
        return self.job.writer


# --- setup ---------------------------------------------------------------------------------------------


def _make_optimizer(engine: PipelineEngine, job: Job, plan: ParallelPlan) -> Optimizer:
    """AdamW with the config's lr and weight decay; under zero1 its state sharded over the groups the rank's mesh
    names (``Mesh.optimizer_groups``: dense state over dp, expert shards' over their replicas)."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    hyper = {"lr": job.train.lr, "weight_decay": job.train.weight_decay}
    if plan.zero1:  # one flat shard mixes every parameter: one group (decay on norms too: see README)
        from hal.parallel.loop.zero import Zero1AdamW, Zero1Experts

        dense, experts = engine.mesh.optimizer_groups()
        if experts is not None:  # expert shards differ across dp: their state shards over the replicas of each shard
            return Zero1Experts(params, expert_shard, dense, experts, lambda ps: torch.optim.AdamW(ps, **hyper))
        return Zero1AdamW(params, dense, **hyper)
    return decoupled_adamw(params, engine.device, **hyper)


def _precision_plan(backend: Backend, job: Job, index: int, stage: StagePlan) -> PrecisionPlan:
    """This rank's precision plan, switches applied: the one ``hal train`` resolved for this stage.

    Only where the job leaves it open (``--print-multinode``: the printing host could not see this
    stage's devices) is it resolved here, under the run's fallback policy.
    """
    from hal.precision import PrecisionPlan, resolve_precision

    given = job.stage_precision[index]
    if given is not None:
        plan = PrecisionPlan.from_dict(given)
    else:
        requested = stage.precision or job.precision
        plan = resolve_precision(requested, backend, backend.capabilities(), job.fallback)  # type: ignore[arg-type]
    plan.apply(backend)
    return plan


def setup(job: Job) -> RankRun:
    """Join the world, build the mesh, the replica set, the engine and the optimizer; load the checkpoint when
    resuming."""
    from hal.backend_registry import get_backend
    from hal.collectives import init_distributed
    from hal.collectives.roles import ROLES_ENV, take_role
    from hal.parallel.emit.components import islands
    from hal.parallel.loop.restarts import restarted
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_meshes
    from hal.parallel.replicas.replica_set import ReplicaSet
    from hal.parallel.replicas.shares import rows_per_second
    from hal.parallel.state.checkpoint import load_checkpoint
    from hal.rank.name import take_name

    store = None
    if os.environ.get(ROLES_ENV):  # c10d rendezvous: the plan's rank by island, not by join order
        role, store = take_role(islands(job))
        os.environ["RANK"] = str(role)
        take_name()  # hal-rank-<plan rank>, not the join order's
    rank = int(os.environ.get("RANK", "0"))
    replicas = ReplicaSet(job.replicas, rank, _say if rank == job.writer else None)
    world = init_distributed(get_backend(os.environ.get("HAL_BACKEND") or replicas.topology.backend_of(rank)),
                             rank=rank if store is not None else None, store=store)
    backend = world.backend  # resolved once; everything below is handed this object
    mesh = build_meshes(job.topologies(), world, validate=False,  # the engine's calls are fixed by the plan
                        tied_embeddings=job.model.tie_embeddings)
    torch.manual_seed(job.train.seed)
    seq = job.train.seq_len or job.model.max_seq_len
    own = replicas.topology.stage_of(world.rank)
    precision = _precision_plan(backend, job, replicas.first_stage + own, replicas.plan.stages[own])

    def engine(init_from: Path | None = None) -> PipelineEngine:
        return build_engine(job.model, replicas.plan, mesh, backend=backend, seed=job.train.seed, device=world.device,
                            seq_len=seq, autocast=lambda: precision.autocast(backend), fp8_dtype=precision.fp8_dtype,
                            init_from=init_from)

    # rows: auto -> rows from a short calibration of a probe engine (collective over the world)
    replicas.resolve_rows(lambda: rows_per_second(engine(), replicas.plan, seq, job.model.vocab_size),
                          world.rank == mesh.topology.first_rank)
    trained = engine(job.init_from if job.resume is None else None)
    trained.measure_on_device = job.profile  # a lean step: device events (one sync a step) only under --profile
    optimizer = _make_optimizer(trained, job, replicas.plan)
    trained.dp_grads = replicas.connect(mesh, trained, world)  # who sums the dp gradients: one answer
    scaler = _loss_scaler(precision.loss_scaling)
    start = 0
    restart = restarted(job.checkpoint_dir, job.log_file)
    resume = restart.checkpoint if restart is not None and restart.checkpoint is not None else job.resume
    if resume is not None:
        meta = load_checkpoint(resume, trained, optimizer, replicas.optimizer_source())
        start = int(meta["step"])
        if scaler is not None and meta.get("loss_scale"):
            scaler.load_state_dict(meta["loss_scale"])
        replicas.resume(resume, meta)
    peak = _peak_tflops(backend, world.device, precision.mode)
    # A tied embedding's copy on the last stage equals the first stage's after their sum: counted there.
    skip = frozenset({"embed.weight"}) if trained.module.needs_tied_grad_sync and not trained.first else frozenset()
    return RankRun(job, trained, optimizer, replicas, world.rank, seq, start, job.steps, peak, scaler, clip_skip=skip,
                   restart=restart)


def _say(text: str) -> None:
    """The writer's lines on stderr (``hal train`` shows them above its progress line)."""
    print(f"hal train: {text}", file=sys.stderr, flush=True)


def _loss_scaler(mine: bool) -> PipelineLossScaler | None:
    """The pipeline's loss scaler if any rank's stage runs fp16 (agreed over the world: one MAX of a flag)."""
    from hal.parallel.loop.loss_scale import PipelineLossScaler

    flag = torch.tensor([1.0 if mine else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return PipelineLossScaler() if flag.item() > 0 else None


def _peak_tflops(backend: Backend, device: torch.device, precision: str) -> float:
    """This rank's device's dense peak for the run's precision (the catalog's figure), NaN if unknown."""
    from hal.parallel.config.flops import PEAK_KEY

    index = device.index if device.index is not None else 0
    peak = backend.capabilities(index).peak_tflops.get(PEAK_KEY.get(precision, "fp32"))
    return float("nan") if peak is None else float(peak)


# --- one step ------------------------------------------------------------------------------------------


def train_step(r: RankRun, step: int) -> tuple[float | None, list[float]]:
    """Forward/backward over this replica's rows of the step, the exchange with the other replicas, then the
    optimizer; the loss (last stage) and this rank's times."""
    train, engine, replicas = r.job.train, r.engine, r.replicas
    tokens = replicas.batch(train, step, r.seq, r.job.model.vocab_size)
    timer = engine.timer
    started, wall_started = timer.mark(), time.perf_counter()
    r.grad_norm = None
    set_learning_rate(r.optimizer, learning_rate(step, lr=train.lr, steps=r.steps, warmup_steps=train.warmup_steps,
                                                 schedule=train.lr_schedule, min_lr=train.min_lr))
    r.optimizer.zero_grad(set_to_none=True)
    if r.scaler is not None:
        engine.loss_scale = r.scaler.scale
    replicas.before_backward()
    loss = replicas.after_backward(engine, engine.step(tokens))
    update = r.optimizer.reduce_scatter_and_step if engine.dp_grads == "optimizer" else r.optimizer.step  # type: ignore[attr-defined]

    def optimizer_step() -> None:
        if train.grad_clip is not None:  # the whole pipeline's norm, one collective over the world
            r.grad_norm = clip_global_norm(engine.module, train.grad_clip, tp_rank=engine.coord.tp,
                                           dp_rank=engine.coord.dp, skip=r.clip_skip, ep=engine.layout.ep,
                                           copies=replicas.copies)
        update()

    with timer.phase("optimizer"):
        if r.scaler is None:
            optimizer_step()
        else:  # unscale, agree on inf/NaN over the world, step or skip together
            r.scaler.step([p for p in engine.module.parameters() if p.requires_grad], optimizer_step)
    replicas.after_optimizer(step + 1)  # local SGD: every H steps the outer step over the replicas' deltas
    timer.add("step", started, timer.mark())
    t = engine.times  # with device events: the one wait of a profiled step
    timed = 1.0 if engine.measure_on_device or engine.device.type == "cpu" else 0.0
    # Unmeasured accelerator phases: the step is the host's wall time (the last stage read its loss).
    step_s = t.step if timed else time.perf_counter() - wall_started
    return loss, [t.compute, t.p2p, t.grad_sync, t.optimizer, t.schedule, step_s, r.peak_tflops, timed, _peak_memory(r),
                  *replicas.timing(step_s)]


def _peak_memory(r: RankRun) -> float:
    """This rank's peak memory so far: the device allocator's high-water mark (the cpu: the process's peak RSS)."""
    try:
        return float(r.engine.backend.max_memory_allocated(r.engine.device.index))
    except (RuntimeError, OSError):  # a runtime without allocator statistics: unknown, not zero
        return float("nan")


def evaluate(r: RankRun) -> float | None:
    """The mean loss over ``train.eval_batches`` fixed validation batches (forward only); the last stage's, else None.

    Batch k is the same at every evaluation (``validation_batch`` seeds it by k), so the numbers compare.
    """
    from hal.parallel.data.batches import validation_batch

    train, plan = r.job.train, r.replicas.plan
    losses: list[float] = []
    if r.replicas.index != 0:  # replica 0 evaluates (the replicas hold the same weights; the writer is one of its ranks)
        return None
    for k in range(train.eval_batches):
        rows = validation_batch(train.data, train.seed, k, plan.global_batch_size, r.seq, train.validation)
        loss = r.engine.evaluate(rows.view(plan.micro_batches, plan.micro_batch_size, r.seq + 1))
        if loss is not None:
            losses.append(float(loss))
    r.engine.module.take_moe_tally()  # routing seen by evaluation is not the next step's load
    return sum(losses) / len(losses) if losses else None


def gather_times(row: list[float], writer: int) -> torch.Tensor | None:
    """Every rank's timing row on the writer, (world, len(``observe.records.TIME_FIELDS``)); None elsewhere.

    Over the default group, which ``init_distributed`` always starts on gloo: host tensors travel
    the same way whatever device a rank drives.
    """
    mine = torch.tensor(row, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if dist.get_rank() == writer else None
    dist.gather(mine, out, dst=writer)
    return None if out is None else torch.stack(out)


def gather_moe(r: RankRun) -> dict[str, Any] | None:
    """The step's expert load on the writer (an MoE model; None elsewhere and for a dense model).

    Every rank hands in its MoE layers' tallies (``Stage.take_moe_tally``: one host read per layer per
    step); a layer's load is summed over the dp replicas that split its micro-batches, its losses averaged.
    ``min_max``: the least-loaded expert's tokens over the most-loaded one's (1.0 = even).
    """
    if not r.job.model.is_moe:
        return None
    mine = r.engine.module.take_moe_tally()
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == r.writer else None
    dist.gather_object(mine, out, dst=r.writer)
    if out is None:
        return None
    return merge_moe_tallies(out)


# --- the profiled step's timeline ---------------------------------------------------------------------------


def _common_start(r: RankRun) -> tuple[Any, float]:
    """One barrier over the world, then this rank's timer mark and the host clock beside it (``parallel.observe.timeline``
    lines ranks up by that clock where they share a host, by the barrier elsewhere)."""
    dist.barrier()
    return r.engine.timer.mark(), time.perf_counter()


def write_timeline(r: RankRun, step: int, origin: tuple[Any, float]) -> None:
    """Gather the spans of the step just run, each rank's to its replica's writer (the first rank of its last stage;
    one plan: the run's writer), which writes that replica's document (``Job.timeline_files``). Every rank takes part in
    each replica's gather, sending its record to its own replica's only."""
    import socket

    from hal.parallel.observe.timeline import measured_document, rank_record

    coord = r.engine.coord
    mine = rank_record(r.rank, coord.stage, coord.dp, coord.tp, r.engine.step_spans(origin[0]),
                       host=socket.gethostname(), clock_at_origin=origin[1],
                       clock="events" if r.engine.measure_on_device else "host")
    replicas = r.replicas
    for index, (topology, name) in enumerate(zip(r.job.topologies(), r.job.timeline_files())):
        dst = topology.stages[-1].ranks[0]
        everyone: list[Any] | None = [None] * dist.get_world_size() if r.rank == dst else None
        dist.gather_object(mine if index == replicas.index else None, everyone, dst=dst)
        if everyone is None:
            continue
        ranks = [record for record in everyone if record is not None]
        doc = measured_document(replicas.plan, replicas.topology, ranks, step=step, schedule=r.engine.schedule)
        Path(r.job.run_dir, name).write_text(strict_json.dumps(doc) + "\n", encoding="utf-8")


# --- the loop ----------------------------------------------------------------------------------------------


def _checkpoint_meta(r: RankRun, next_step: int) -> dict[str, Any]:
    train, plans = r.job.train, r.replicas.checkpoint_meta()
    meta = {"model": r.job.model.to_dict(), "plan": plans.pop("plan"), "train": train.to_dict(), "config": r.job.config,
            "data": {"source": train.data, "seed": train.seed, "next_step": next_step, "seq_len": r.seq},
            "init_from": None if r.job.init_from is None else str(r.job.init_from)}
    if r.scaler is not None:
        meta["loss_scale"] = r.scaler.state_dict()
    standin = standin_summary(r.job.replicas).get("standin")
    if standin is not None:  # written by ranks on a vendor's stand-in: the checkpoint says so
        meta["standin"], meta["standin_backends"] = standin["note"], standin["backends"]
    return {**meta, **plans}


def _save(r: RankRun, checkpoint_dir: Path, done: int) -> str:
    from hal.parallel.state.checkpoint import save_checkpoint

    parts = r.replicas.checkpoint_parts(r.engine.coord.stage)
    return str(save_checkpoint(checkpoint_dir, done, r.engine, r.optimizer, _checkpoint_meta(r, done), write=parts.write,
                               outer_momentum=parts.outer_momentum, inner_file=parts.inner_file,
                               inner_files=parts.inner_files, wire=parts.wire, wire_files=parts.wire_files))


def _open_log(path: Path, resumed: bool) -> TextIO:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a" if resumed else "w", encoding="utf-8")


def _open_board(r: RankRun) -> Any:
    """The TensorBoard event file under the run directory with ``train.tensorboard`` (checked before ranks start), else None."""
    if not r.job.train.tensorboard:
        return None
    from hal.parallel.observe.tensorboard import TensorBoardLog, log_dir

    return TensorBoardLog(log_dir(r.job.run_dir))


def _first_step_why(r: RankRun) -> str:
    """What may keep the run's first step long, for ``SlowStepNotice``."""
    if any(plan.stage_compiles(k) for plan in r.job.plans() for k in range(plan.num_stages)):
        return ("the first step compiles the decoder layers (torch.compile, every stage its own: a minute or more "
                "on a GPU; compile: false skips it)")
    return "the first step also allocates memory and loads kernels"


def train(r: RankRun) -> None:
    """Steps ``start+1 .. steps``; the writer logs each one; checkpoints every N steps and at the end."""
    is_writer = r.rank == r.writer
    train, replicas = r.job.train, r.replicas
    checkpoint_dir = r.job.checkpoint_dir
    tokens = replicas.tokens_per_step * r.seq
    restart_line = restart_record(r.restart, r.start, r.job.log_file) if is_writer and r.restart is not None else None
    log = _open_log(r.job.log_file, r.start > 0 or r.restart is not None) if is_writer else None
    if log is not None and restart_line is not None:
        log.write(strict_json.dumps(restart_line) + "\n")
        log.flush()
        _say(f"restart {restart_line['restart']}: resumed at step {r.start} from the latest complete checkpoint "
             f"({restart_line['redone_steps']} step(s) done again)")
    board = _open_board(r) if is_writer else None
    progress = Progress(r.steps) if is_writer else None
    records: list[dict[str, Any]] = []
    checkpoint = None
    write_s: float | None = None  # the last checkpoint's write time (the cadence the summary suggests)
    skipped_before = r.scaler.skipped_steps if r.scaler is not None else 0
    began = time.perf_counter()
    timeline_step = r.steps - 1 if r.job.profile else None
    order = None  # parallel.order: measured — the calibration's choice, once made
    note = measured_order.skipped(replicas.plan, r.start, r.steps)
    if note is not None and is_writer:
        _say(f"warning: {note}")
    try:
        for step in range(r.start, r.steps):
            origin = _common_start(r) if step == timeline_step else None
            calibrating = measured_order.due_anywhere(r.job.plans(), r.start, r.steps, step)
            if measured_order.due(replicas.plan, r.start, r.steps, step):
                r.engine.measure_on_device = True  # the device's own times, not the host's enqueueing
            first = progress is not None and step == r.start  # a long first step says so (once a run: the writer)
            with SlowStepNotice(progress, step + 1, _first_step_why(r)) if first else contextlib.nullcontext():
                loss, row = train_step(r, step)
            if calibrating:
                order = measured_order.calibrate(r.engine, replicas, r.rank, r.writer, r.start, r.steps, step) or order
                r.engine.measure_on_device = r.job.profile
            times = gather_times(row, r.writer)
            moe = gather_moe(r)
            if origin is not None:
                write_timeline(r, step + 1, origin)
            evaluation = evaluate(r) if train.eval_every and (step + 1) % train.eval_every == 0 else None
            if is_writer:
                assert loss is not None and times is not None and log is not None and progress is not None
                scaled = None
                if r.scaler is not None:
                    scaled = (r.engine.loss_scale, r.scaler.skipped_steps > skipped_before, r.scaler.skipped_steps)
                    skipped_before = r.scaler.skipped_steps
                notes = StepNotes(r.optimizer.param_groups[0]["lr"], train.grad_clip is not None, r.grad_norm, evaluation,
                                  moe, replicas.rebalanced,
                                  order.to_dict() if order is not None and step + 1 == order.step - 1 else None, scaled)
                record = run_record(replicas.replicas, r.seq, step + 1, loss, times, tokens, notes)
                records.append(record)
                log.write(strict_json.dumps(record) + "\n")
                log.flush()
                if board is not None:
                    board.write(record)
                progress.update(record)
                if evaluation is not None:
                    progress.evaluated(step + 1, evaluation)
            done = step + 1
            if checkpoint_dir is not None and (done == r.steps or (train.checkpoint_every and done % train.checkpoint_every == 0)):
                wrote = time.perf_counter()
                checkpoint = _save(r, checkpoint_dir, done)
                write_s = time.perf_counter() - wrote
            replicas.rebalance(done, r.steps, r.engine)  # rows: auto shares from measured times, when due
    finally:
        if progress is not None:
            progress.close()
        if log is not None:
            log.close()
        if board is not None:
            board.close()
    if is_writer:
        summary = run_summary(r.job, replicas.replicas, r.seq, r.steps, r.start, records, time.perf_counter() - began,
                              checkpoint)
        summary["restarts"] = restart_records(r.job.log_file)
        steps_s = sorted(rec["step_s"] for rec in records if isinstance(rec.get("step_s"), (int, float)))
        if write_s is not None and steps_s:
            summary["checkpoint_cadence"] = cadence(steps_s[len(steps_s) // 2], write_s, train.checkpoint_every)
        Path(r.job.run_dir, "summary.json").write_text(strict_json.dumps(summary, indent=2) + "\n", encoding="utf-8")


# --- entry point ----------------------------------------------------------------------------------------------


USAGE = "usage: python -m hal.parallel.loop.trainer RUN_DIR/job.json  (one rank of hal train, started by hal train or torchrun)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank; a HalError is one line and exit 2, anything else a traceback and exit 1."""
    from hal.collectives import shutdown
    from hal.cpu_binding import bind_from_env, cpulist
    from hal.parallel.config.job import load_job

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "?")
    finished = False
    try:
        bound = bind_from_env()  # before torch starts its threads: they inherit the rank's cores
        if bound is not None:
            print(f"hal train: rank {rank}: pinned to cpus {cpulist(sorted(os.sched_getaffinity(0)))}", file=sys.stderr)
        train(setup(load_job(args[0])))
        finished = True
        return 0
    except HalError as exc:
        print(f"hal train: rank {rank}: error: {exc}", file=sys.stderr)
        return 2
    except Exception:
        print(f"hal train: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, end="")
        return 1
    finally:
        shutdown(drain=finished)


if __name__ == "__main__":
    from hal.rank.name import take_name

    take_name()  # what ps and top show: hal-rank-N
    sys.exit(main())
