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
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch
import torch.distributed as dist

from hal import strict_json
from hal.errors import HalError
from hal.parallel.config.job import Job
from hal.parallel.config.topology import Topology
from hal.parallel.data.batches import global_batch
from hal.parallel.loop import measured_order
from hal.parallel.loop.optim_schedule import clip_global_norm, decoupled_adamw, learning_rate, set_learning_rate
from hal.parallel.models.layers import expert_shard
from hal.parallel.observe.progress import Progress, SlowStepNotice
from hal.parallel.observe.records import merge_moe_tallies, run_record, run_summary


@dataclass
class RankRun:
    """Everything one rank trains with."""

    job: Job
    topology: Topology
    engine: Any  # PipelineEngine
    optimizer: Any  # torch.optim.AdamW or parallel.loop.zero.Zero1AdamW
    rank: int
    writer: int  # global rank that logs (first rank of the last stage)
    seq: int
    start: int  # steps already done (from a checkpoint)
    steps: int  # the run stops after this many steps in total
    peak_tflops: float = float("nan")  # this rank's device's dense peak for the run's precision (catalog)
    scaler: Any = None  # parallel.loop.loss_scale.PipelineLossScaler when any stage runs fp16, else None
    grad_norm: float | None = None  # the last clipped step's global gradient norm (train.grad_clip)
    clip_skip: frozenset[str] = frozenset()  # parameters another rank counts in the global norm (a tied head copy)
    replica: int = 0  # parallel.replicas: this rank's replica (its plan is ``plan``)
    plan: Any = None  # this rank's plan (its replica's; job.plan without replicas)
    exchange: Any = None  # parallel.replicas.sync.ReplicaExchange with replicas, else None
    local_sgd: Any = None  # parallel.replicas.local_sgd.LocalSGD when the replicas meet every H > 1 steps
    overlap: Any = None  # parallel.replicas.overlap.BackwardOverlap: the every-step exchange during the backward
    replica_sync_s: float = 0.0  # the last step's cross-replica exchange
    shares: Any = None  # parallel.replicas.shares.ShareTracker: rows: auto replicas re-balanced mid-run, else None


# --- setup ---------------------------------------------------------------------------------------------


def _make_optimizer(engine: Any, job: Job, plan: Any) -> Any:
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


def _precision_plan(backend: Any, job: Job, index: int, stage: Any) -> Any:
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
    """Join the world, build groups, engine and optimizer, and load the checkpoint when resuming."""
    from hal.backend_registry import get_backend
    from hal.collectives import init_distributed
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_meshes
    from hal.parallel.state.checkpoint import load_checkpoint

    rank = int(os.environ.get("RANK", "0"))
    replica, plan, topology, first_stage = job.replica_view(rank)
    world = init_distributed(get_backend(os.environ.get("HAL_BACKEND") or topology.backend_of(rank)))
    backend = world.backend  # resolved once; everything below is handed this object
    mesh = build_meshes(job.topologies(), world, validate=False,  # the engine's calls are fixed by the plan
                        tied_embeddings=job.model.tie_embeddings)
    torch.manual_seed(job.train.seed)
    seq = job.train.seq_len or job.model.max_seq_len
    own = topology.stage_of(world.rank)
    precision = _precision_plan(backend, job, first_stage + own, plan.stages[own])
    shares = _share_tracker(job)
    if job.replicas is not None and not job.replicas.resolved:  # rows: auto -> rows from a short calibration
        job = _resolve_auto_rows(job, replica, plan, mesh, world, backend, precision, seq)
        plan = job.replicas.replicas[replica].plan  # type: ignore[union-attr]
    engine = build_engine(job.model, plan, mesh, backend=backend, seed=job.train.seed, device=world.device,
                            seq_len=seq, autocast=lambda: precision.autocast(backend), fp8_dtype=precision.fp8_dtype,
                            init_from=job.init_from if job.resume is None else None)
    engine.measure_on_device = job.profile  # a lean step: device events (one sync a step) only under --profile
    optimizer = _make_optimizer(engine, job, plan)
    # ZeRO-1 sums gradients with a reduce-scatter inside its step instead of the engine's all-reduce,
    # except where a tied embedding must be summed across stages first (that needs the full dp sum), or where the
    # replicas' exchange needs every gradient whole first.
    engine.reduce_dp_grads = not (plan.zero1 and mesh.dp.size > 1 and not engine.module.needs_tied_grad_sync
                                  and job.replicas is None)
    exchange, local_sgd, overlap = _replica_sync(job, mesh, engine, replica, world)
    scaler = _loss_scaler(precision.loss_scaling)
    start = 0
    if job.resume is not None:
        meta = load_checkpoint(job.resume, engine, optimizer, replica)
        start = int(meta["step"])
        if scaler is not None and meta.get("loss_scale"):
            scaler.load_state_dict(meta["loss_scale"])
        if local_sgd is not None:  # anchored at the loaded weights, with the outer momentum saved beside them
            from hal.parallel.state.checkpoint import read_outer_momentum

            velocity = read_outer_momentum(job.resume, meta) if local_sgd.momentum else None
            if local_sgd.momentum and velocity is None and world.rank == job.writer:
                print("hal train: the checkpoint holds no local SGD outer momentum (it was not a local SGD run): "
                      "the momentum starts at zero", file=sys.stderr, flush=True)
            local_sgd.resume(velocity)
        _resume_wire(job, meta, exchange, replica, world.rank == job.writer)
    writer = job.writer
    peak = _peak_tflops(backend, world.device, precision.mode)
    # A tied embedding's copy on the last stage equals the first stage's after their sum: counted there.
    skip = frozenset({"embed.weight"}) if engine.module.needs_tied_grad_sync and not engine.first else frozenset()
    return RankRun(job, topology, engine, optimizer, world.rank, writer, seq, start, job.steps, peak, scaler,
                   clip_skip=skip, replica=replica, plan=plan, exchange=exchange, local_sgd=local_sgd, shares=shares,
                   overlap=overlap)


def _resume_wire(job: Job, meta: dict[str, Any], exchange: Any, replica: int, is_writer: bool) -> None:
    """The fp8 wire's residuals from the checkpoint into this speaker (matched by parameter name), or a line saying why
    they are not used: a resumed fp8 run then carries the error feedback the uninterrupted run would."""
    from hal.parallel.state.checkpoint import read_wire_residuals

    assert job.resume is not None
    kept = read_wire_residuals(job.resume, meta)
    if not kept:
        return
    fp8 = exchange is not None and exchange.fp8 is not None
    if not fp8 or replica not in kept:
        if is_writer:
            why = ("this run's cross-replica wire is not fp8" if not fp8 else
                   f"the checkpoint's run had replicas {sorted(kept)}, not this run's replica {replica}")
            print(f"hal train: the checkpoint's fp8 wire residuals are not used: {why}", file=sys.stderr, flush=True)
        return
    missing = exchange.load_residuals(kept[replica])
    if missing:
        print(f"hal train: warning: the checkpoint keeps no fp8 wire residual for {len(missing)} parameter(s) of replica "
              f"{replica} (e.g. {missing[0]}): their buckets start without error feedback", file=sys.stderr, flush=True)


def _share_tracker(job: Job) -> Any:
    """With ``rows: auto`` replicas and ``replica_sync.rebalance_every`` > 0: the mid-run rebalance, else None."""
    if job.replicas is None or job.replicas.sync.rebalance_every == 0 or job.replicas.resolved:
        return None
    from hal.parallel.replicas.shares import ShareTracker

    movable = [r.rows is None for r in job.replicas.replicas]
    return ShareTracker(movable, job.replicas.sync.rebalance_every) if sum(movable) >= 2 else None


def _resolve_auto_rows(job: Job, replica: int, plan: Any, mesh: Any, world: Any, backend: Any, precision: Any,
                       seq: int) -> Job:
    """The job with every ``rows: auto`` replica's rows set from measured speed (``parallel.replicas.shares``; said
    on the writer's stderr). Collective over the world."""
    from dataclasses import replace

    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.replicas.shares import resolve_shares, rows_per_second

    def measure() -> float:
        probe = build_engine(job.model, plan, mesh, backend=backend, seed=job.train.seed, device=world.device,
                             seq_len=seq, autocast=lambda: precision.autocast(backend), fp8_dtype=precision.fp8_dtype)
        return rows_per_second(probe, plan, seq, job.model.vocab_size)

    say = (lambda text: print(f"hal train: {text}", file=sys.stderr, flush=True)) if world.rank == job.writer else None
    assert job.replicas is not None
    resolved = resolve_shares(job.replicas, replica, measure, world.rank == mesh.topology.first_rank, say)
    return replace(job, replicas=resolved, plan=resolved.replicas[0].plan)


def _replica_sync(job: Job, mesh: Any, engine: Any, replica: int, world: Any) -> tuple[Any, Any, Any]:
    """With replicas: the cross-replica exchange (collective over the world); every H > 1, local SGD; every step,
    the exchange during the backward where a stage allows it (``replica_sync.overlap``)."""
    if job.replicas is None or len(job.replicas.replicas) == 1:  # one replica is its plan: nothing to meet
        return None, None, None
    from hal.parallel.replicas.local_sgd import LocalSGD
    from hal.parallel.replicas.overlap import BackwardOverlap
    from hal.parallel.replicas.sync import ReplicaExchange

    sync = job.replicas.sync
    exchange = ReplicaExchange(mesh, engine.module, replica, job.topologies(), world, compress=sync.compress)
    local = LocalSGD(exchange, sync.every, sync.outer_lr, sync.outer_momentum) if sync.every > 1 else None
    overlap = (BackwardOverlap(exchange, engine, job.topologies(), sync.overlap)
               if sync.every == 1 and sync.overlap == "on" else None)
    return exchange, local, overlap


def _loss_scaler(mine: bool) -> Any:
    """The pipeline's loss scaler if any rank's stage runs fp16 (agreed over the world: one MAX of a flag)."""
    from hal.parallel.loop.loss_scale import PipelineLossScaler

    flag = torch.tensor([1.0 if mine else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return PipelineLossScaler() if flag.item() > 0 else None


def _peak_tflops(backend: Any, device: torch.device, precision: str) -> float:
    """This rank's device's dense peak for the run's precision (the catalog's figure), NaN if unknown."""
    from hal.parallel.config.flops import PEAK_KEY

    index = device.index if device.index is not None else 0
    peak = backend.capabilities(index).peak_tflops.get(PEAK_KEY.get(precision, "fp32"))
    return float("nan") if peak is None else float(peak)


# --- one step ------------------------------------------------------------------------------------------


def train_step(r: RankRun, step: int) -> tuple[float | None, list[float]]:
    """Forward/backward over the step's batch, then the optimizer; the loss (last stage) and this rank's times."""
    plan, train = r.plan, r.job.train
    weight = 1.0
    if r.job.replicas is None:
        tokens = global_batch(train.data, train.seed, step, plan.micro_batches, plan.micro_batch_size, r.seq,
                              r.job.model.vocab_size, validation=train.validation)
    else:  # the step's rows over every replica (the same data as one plan of that many rows); this replica's part
        from hal.parallel.replicas.sync import token_weights

        rows = global_batch(train.data, train.seed, step, 1, r.job.replicas.global_batch, r.seq, r.job.model.vocab_size,
                            validation=train.validation)[0]
        ranges = r.job.replicas.row_ranges()
        weight = token_weights(rows, ranges)[r.replica]
        mine = ranges[r.replica]
        tokens = rows[mine.start:mine.stop].reshape(plan.micro_batches, plan.micro_batch_size, r.seq + 1)
    timer = r.engine.timer
    started, wall_started = timer.mark(), time.perf_counter()
    r.grad_norm = None
    set_learning_rate(r.optimizer, learning_rate(step, lr=train.lr, steps=r.steps, warmup_steps=train.warmup_steps,
                                                 schedule=train.lr_schedule, min_lr=train.min_lr))
    r.optimizer.zero_grad(set_to_none=True)
    if r.scaler is not None:
        r.engine.loss_scale = r.scaler.scale
    own = time.perf_counter() if r.shares is not None else 0.0
    during = r.overlap is not None and r.overlap.eligible
    if during:
        r.overlap.begin(weight)  # buckets start from the gradient hooks as the backward finishes them
    loss = r.engine.step(tokens)
    own_s = None
    if r.shares is not None:  # this rank's own time of the step, before it waits for the other replicas
        r.engine.backend.synchronize()
        own_s = time.perf_counter() - own
    r.replica_sync_s = 0.0
    if r.exchange is not None:
        began = time.perf_counter()
        if during:
            r.overlap.finish()  # what is left of the exchange after the backward: the part the step waits for
        elif r.local_sgd is None:
            r.exchange.sync_grads(weight)  # every replica's gradient becomes the step's token-weighted mean
        loss = r.exchange.step_loss(loss, weight)
        r.replica_sync_s = time.perf_counter() - began
    update = r.optimizer.step if r.engine.reduce_dp_grads else r.optimizer.reduce_scatter_and_step

    def optimizer_step() -> None:
        if train.grad_clip is not None:  # the whole pipeline's norm, one collective over the world
            copies = 1 if r.exchange is None else len(r.job.replicas.replicas)  # type: ignore[union-attr]  # synced: alike
            r.grad_norm = clip_global_norm(r.engine.module, train.grad_clip, tp_rank=r.engine.coord.tp,
                                           dp_rank=r.engine.coord.dp, skip=r.clip_skip, ep=r.engine.layout.ep,
                                           copies=copies)
        update()

    with timer.phase("optimizer"):
        if r.scaler is None:
            optimizer_step()
        else:  # unscale, agree on inf/NaN over the world, step or skip together
            r.scaler.step([p for p in r.engine.module.parameters() if p.requires_grad], optimizer_step)
    if r.local_sgd is not None:
        began = time.perf_counter()
        r.local_sgd.after_step(step + 1, weight)  # every H steps: the outer step over the replicas' deltas
        r.replica_sync_s += time.perf_counter() - began
    timer.add("step", started, timer.mark())
    t = r.engine.times  # with device events: the one wait of a profiled step
    timed = 1.0 if r.engine.measure_on_device or r.engine.device.type == "cpu" else 0.0
    # Unmeasured accelerator phases: the step is the host's wall time (the last stage read its loss).
    step_s = t.step if timed else time.perf_counter() - wall_started
    if r.shares is not None and own_s is not None:
        r.shares.record(own_s, step_s)
    sent = 0.0 if r.exchange is None else float(r.local_sgd.bytes_sent if r.local_sgd is not None else r.exchange.bytes_sent)
    early = float(r.overlap.early) if during else float("nan")
    return loss, [t.compute, t.p2p, t.grad_sync, t.optimizer, t.schedule, step_s, r.peak_tflops, timed, _peak_memory(r),
                  r.replica_sync_s, sent, early]


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

    train, plan = r.job.train, r.plan
    losses: list[float] = []
    if r.replica != 0:  # replica 0 evaluates (the replicas hold the same weights; the writer is one of its ranks)
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
    for index, (topology, name) in enumerate(zip(r.job.topologies(), r.job.timeline_files())):
        dst = topology.stages[-1].ranks[0]
        everyone: list[Any] | None = [None] * dist.get_world_size() if r.rank == dst else None
        dist.gather_object(mine if index == r.replica else None, everyone, dst=dst)
        if everyone is None:
            continue
        ranks = [record for record in everyone if record is not None]
        doc = measured_document(r.plan, r.topology, ranks, step=step, schedule=r.engine.schedule)
        Path(r.job.run_dir, name).write_text(strict_json.dumps(doc) + "\n", encoding="utf-8")


# --- the loop ----------------------------------------------------------------------------------------------


def _checkpoint_meta(r: RankRun, next_step: int) -> dict[str, Any]:
    train = r.job.train
    meta = {"model": r.job.model.to_dict(), "plan": r.job.plan.to_dict(), "train": train.to_dict(), "config": r.job.config,
            "data": {"source": train.data, "seed": train.seed, "next_step": next_step, "seq_len": r.seq},
            "init_from": None if r.job.init_from is None else str(r.job.init_from)}
    if r.scaler is not None:
        meta["loss_scale"] = r.scaler.state_dict()
    if r.job.replicas is not None:
        meta["replicas"] = r.job.replicas.to_dict()  # "plan" is replica 0's, whose ranks wrote the files
    return meta


def _rebalance(r: RankRun, done: int) -> list[int] | None:
    """The look at the replicas' measured times (collective over the world); a change is applied on every rank, said
    on the writer's stderr, and returned (the new rows, for the step's record)."""
    from dataclasses import replace

    from hal.parallel.replicas.shares import rebalance_text

    before = r.job.replicas
    assert before is not None and r.shares is not None
    after, note = r.shares.look(before, r.replica)
    if note is not None and r.rank == r.writer:
        print(f"hal train: warning: {note}", file=sys.stderr, flush=True)
    if after is None:
        return None
    r.job = replace(r.job, replicas=after, plan=after.replicas[0].plan)
    r.plan = after.replicas[r.replica].plan
    r.engine.set_micro_batches(r.plan.micro_batches)
    if r.rank == r.writer:
        print(f"hal train: {rebalance_text(before, after, done)}", file=sys.stderr, flush=True)
    return [rep.rows for rep in after.replicas]


def _save(r: RankRun, checkpoint_dir: Path, done: int) -> str:
    from hal.parallel.state.checkpoint import save_checkpoint

    # replicas hold the same weights at a checkpoint (every step, or a meeting of local SGD): replica 0 writes; under
    # local SGD the others add their own inner optimizer states, and the outer momentum goes beside the weights
    inner_file, inner_files, outer = None, [], None
    if r.local_sgd is not None:
        from hal.parallel.state.checkpoint import inner_file_name

        assert r.job.replicas is not None
        inner_files = [inner_file_name(i, k) for i, rep in enumerate(r.job.replicas.replicas) if i > 0
                       for k in range(rep.plan.num_stages)]
        inner_file = inner_file_name(r.replica, r.engine.coord.stage) if r.replica > 0 else None
        outer = r.local_sgd.velocity if r.local_sgd.momentum else None
    wire, wire_files = None, []
    if r.exchange is not None and r.exchange.fp8 is not None:  # what the fp8 sends rounded away: carried over a restart
        wire_files = r.exchange.residual_files()
        file = r.exchange.residual_file()
        wire = None if file is None else (file, r.replica, r.exchange.residuals_by_name())
    return str(save_checkpoint(checkpoint_dir, done, r.engine, r.optimizer, _checkpoint_meta(r, done), write=r.replica == 0,
                               outer_momentum=outer, inner_file=inner_file, inner_files=inner_files, wire=wire,
                               wire_files=wire_files))


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
    plans = [r.job.plan] if r.job.replicas is None else [replica.plan for replica in r.job.replicas.replicas]
    if any(plan.stage_compiles(k) for plan in plans for k in range(plan.num_stages)):
        return ("the first step compiles the decoder layers (torch.compile, every stage its own: a minute or more "
                "on a GPU; compile: false skips it)")
    return "the first step also allocates memory and loads kernels"


def train(r: RankRun) -> None:
    """Steps ``start+1 .. steps``; the writer logs each one; checkpoints every N steps and at the end."""
    is_writer = r.rank == r.writer
    save_every, eval_every = r.job.train.checkpoint_every, r.job.train.eval_every
    plan = r.job.plan
    checkpoint_dir = r.job.checkpoint_dir
    tokens = (r.job.replicas.global_batch if r.job.replicas is not None else plan.global_batch_size) * r.seq
    log = _open_log(r.job.log_file, r.start > 0) if is_writer else None
    board = _open_board(r) if is_writer else None
    progress = Progress(r.steps) if is_writer else None
    records: list[dict[str, Any]] = []
    checkpoint = None
    skipped_before = r.scaler.skipped_steps if r.scaler is not None else 0
    began = time.perf_counter()
    timeline_step = r.steps - 1 if r.job.profile else None
    rebalanced: list[int] | None = None  # the rows a mid-run rebalance just set (the next step's record says so)
    order = None  # parallel.order: measured — the calibration's choice, once made
    note = measured_order.skipped(r.plan, r.start, r.steps)
    if note is not None and is_writer:
        print(f"hal train: warning: {note}", file=sys.stderr, flush=True)
    try:
        for step in range(r.start, r.steps):
            origin = _common_start(r) if step == timeline_step else None
            calibrating = measured_order.due_anywhere(r.job, r.plan, r.start, r.steps, step)
            if measured_order.due(r.plan, r.start, r.steps, step):
                r.engine.measure_on_device = True  # the device's own times, not the host's enqueueing
            first = progress is not None and step == r.start  # a long first step says so (once a run: the writer)
            with SlowStepNotice(progress, step + 1, _first_step_why(r)) if first else contextlib.nullcontext():
                loss, row = train_step(r, step)
            if calibrating:
                order = measured_order.calibrate(r, step) or order
                r.engine.measure_on_device = r.job.profile
            times = gather_times(row, r.writer)
            moe = gather_moe(r)
            if origin is not None:
                write_timeline(r, step + 1, origin)
            evaluation = evaluate(r) if eval_every and (step + 1) % eval_every == 0 else None
            if is_writer:
                assert loss is not None and times is not None and log is not None and progress is not None
                record = run_record(r.job, r.seq, step + 1, loss, times, tokens)
                record["lr"] = r.optimizer.param_groups[0]["lr"]
                if r.job.train.grad_clip is not None:
                    record["grad_norm"] = r.grad_norm  # before clipping (None: the step was skipped)
                if evaluation is not None:
                    record["eval_loss"], record["eval_ppl"] = evaluation, math.exp(min(evaluation, 80.0))
                if moe is not None:
                    record["moe"] = moe
                if rebalanced is not None:  # this step was the first on re-balanced shares
                    record["rebalanced"] = rebalanced
                if order is not None and step + 1 == order.step - 1:  # the calibration step: what it chose
                    record["order"] = order.to_dict()
                if r.scaler is not None:  # the scale the step ran with; the same on every rank
                    record["loss_scale"] = r.engine.loss_scale
                    record["skipped"] = r.scaler.skipped_steps > skipped_before
                    record["skipped_steps"] = skipped_before = r.scaler.skipped_steps
                records.append(record)
                log.write(strict_json.dumps(record) + "\n")
                log.flush()
                if board is not None:
                    board.write(record)
                progress.update(record)
                if evaluation is not None:
                    progress.evaluated(step + 1, evaluation)
            done = step + 1
            if checkpoint_dir is not None and (done == r.steps or (save_every and done % save_every == 0)):
                checkpoint = _save(r, checkpoint_dir, done)
            rebalanced = _rebalance(r, done) if r.shares is not None and r.shares.due(done, r.steps) else None
    finally:
        if progress is not None:
            progress.close()
        if log is not None:
            log.close()
        if board is not None:
            board.close()
    if is_writer:
        summary = run_summary(r.job, r.seq, r.steps, r.start, records, time.perf_counter() - began, checkpoint)
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
    sys.exit(main())
