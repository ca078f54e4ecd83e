"""The writer's records of a run: one JSON line a step (``step_record``, ``run_record``: loss, throughput, each
stage's breakdown, each replica's exchange) from every rank's timing row, and ``summary.json`` over them
(``run_summary``). Pure functions of the gathered rows and the job: the training loop (``parallel.loop.trainer``)
gathers and writes, this module says what the numbers mean."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hal.parallel.config.job import Job
from hal.parallel.config.replicas import ReplicatedPlan
from hal.parallel.config.topology import StageMesh, Topology
from hal.parallel.schedules.pairs import stage_pairs

# Per-rank timing row gathered to the writer each step (seconds).
# "timed": 1 where the phases are real (a host device, or --profile: device events on an accelerator).
# "replica_sync": the cross-replica exchange (parallel.replicas), 0 without replicas.
TIME_FIELDS: tuple[str, ...] = ("compute", "p2p", "grad_sync", "optimizer", "schedule", "step", "peak_tflops", "timed",
                                "peak_memory", "replica_sync", "replica_bytes", "replica_early")

def merge_moe_tallies(tallies: list[dict[int, dict[str, Any]] | None]) -> dict[str, Any]:
    """Per-rank tallies → {"layers": {i: {load, min_max, aux_loss, z_loss, exchange}}, "min_max", "aux_loss", "exchange"}
    (see gather_moe; ``exchange``: under ep, the path tokens took between ranks, None without ep)."""
    layers: dict[int, dict[str, Any]] = {}
    for tally in tallies:
        for layer, t in (tally or {}).items():
            got = layers.setdefault(int(layer), {"load": [0] * len(t["load"]), "aux": [], "z": [], "exchange": set()})
            got["load"] = [a + b for a, b in zip(got["load"], t["load"])]
            if t.get("exchange"):
                got["exchange"].add(t["exchange"])
            got["aux"].append(t["aux_loss"])
            got["z"].append(t["z_loss"])
    report: dict[str, Any] = {}
    for layer, got in sorted(layers.items()):
        load = got["load"]
        report[str(layer)] = {"load": load, "min_max": min(load) / max(max(load), 1),
                              "aux_loss": sum(got["aux"]) / len(got["aux"]), "z_loss": sum(got["z"]) / len(got["z"]),
                              "exchange": "+".join(sorted(got["exchange"])) or None}
    if not report:
        return {"layers": {}, "min_max": None, "aux_loss": None, "exchange": None}
    paths = sorted({v["exchange"] for v in report.values() if v["exchange"]})
    return {"layers": report, "min_max": min(v["min_max"] for v in report.values()),
            "aux_loss": sum(v["aux_loss"] for v in report.values()) / len(report), "exchange": "+".join(paths) or None}

def step_record(step: int, loss: float, times: torch.Tensor, topology: Topology, tokens: int) -> dict[str, Any]:
    """One JSON line: loss, throughput, and each stage's breakdown (mean over its ranks).

    Without ``--profile`` an accelerator is never synchronized for timing, so the phases of its
    asynchronous step are not measured: a stage on one has null phases (a host stage's are exact;
    with ``--profile`` they are device events, ``parallel.observe.phase_timer``),
    and ``step_s`` is the host's wall time of the step (the last stage reads its loss, so the host
    cannot run a step ahead).

    ``schedule_s`` is the pipeline's forward/backward wall time (the slowest rank's); a stage's
    ``bubble_s`` = schedule_s − its compute − its p2p: the part of the schedule it neither computed
    nor spent in send/recv. Waiting for a neighbour stage inside a blocking send/recv is counted in
    ``p2p_s`` (the transfer and the wait cannot be told apart there). Gradient sync and the
    optimizer come after the schedule and are reported on their own.
    """
    col = {name: i for i, name in enumerate(TIME_FIELDS)}
    step_s = float(times[:, col["step"]].max())
    schedule_s = float(times[:, col["schedule"]].max())
    stages = []
    for mesh in topology.stages:
        mine = times[list(mesh.ranks)].mean(dim=0)
        compute, p2p = float(mine[col["compute"]]), float(mine[col["p2p"]])
        phases: dict[str, float | None] = {
            "compute_s": compute, "p2p_s": p2p, "bubble_s": max(0.0, schedule_s - compute - p2p),
            "grad_sync_s": float(mine[col["grad_sync"]]), "optimizer_s": float(mine[col["optimizer"]]),
        }
        if float(times[list(mesh.ranks), col["timed"]].min()) < 1.0:
            phases = dict.fromkeys(phases)
        memory = float(times[list(mesh.ranks), col["peak_memory"]].max()) if "peak_memory" in col else float("nan")
        stage_peak = float(times[list(mesh.ranks), col["peak_tflops"]].sum())  # NaN where one rank's device has none
        stages.append({"stage": mesh.index, "backend": mesh.backend, "ranks": list(mesh.ranks), **phases,
                       "peak_memory_bytes": None if math.isnan(memory) else int(memory),
                       "peak_tflops": None if math.isnan(stage_peak) else stage_peak})
    peak = float(times[:, col["peak_tflops"]].sum())
    all_timed = float(times[:, col["timed"]].min()) >= 1.0
    return {"step": step, "loss": loss, "tokens": tokens, "step_s": step_s, "schedule_s": schedule_s if all_timed else None,
            "tokens_per_s": tokens / step_s if step_s > 0 else None, "stages": stages,
            "peak_tflops": None if math.isnan(peak) else peak}

@dataclass(frozen=True)
class StepNotes:
    """What the writer adds to a step's line beyond the timing rows, each only where it applies."""

    lr: float
    clipped: bool = False  # train.grad_clip is set: the line carries the norm before clipping (None: step skipped)
    grad_norm: float | None = None
    evaluation: float | None = None  # the validation loss of an evaluation after this step
    moe: dict[str, Any] | None = None  # the expert load (``merge_moe_tallies``)
    rebalanced: list[int] | None = None  # the rows this step, the first on re-balanced shares, ran with
    order: dict[str, Any] | None = None  # the calibration step: what it chose (``parallel.order: measured``)
    loss_scale: tuple[float, bool, int] | None = None  # fp16: (the scale it ran with, skipped, skipped steps so far)


def run_record(replicas: ReplicatedPlan, seq: int, step: int, loss: float, times: torch.Tensor, tokens: int,
               notes: StepNotes) -> dict[str, Any]:
    """One step's JSON line: ``step_record`` over every stage, then ``notes``; with several replicas, every replica's
    stages (each marked with its replica) and a line per replica — its rows, tokens/s, the cross-replica exchange's
    seconds and share of the step, bytes it sent. ``replicas``: the rows in force this step."""
    record = _replica_record(replicas, seq, step, loss, times, tokens)
    record["lr"] = notes.lr
    if notes.clipped:
        record["grad_norm"] = notes.grad_norm
    if notes.evaluation is not None:
        record["eval_loss"], record["eval_ppl"] = notes.evaluation, math.exp(min(notes.evaluation, 80.0))
    if notes.moe is not None:
        record["moe"] = notes.moe
    if notes.rebalanced is not None:
        record["rebalanced"] = notes.rebalanced
    if notes.order is not None:
        record["order"] = notes.order
    if notes.loss_scale is not None:  # the scale the step ran with; the same on every rank
        record["loss_scale"], record["skipped"], record["skipped_steps"] = notes.loss_scale
    return record


def _replica_record(replicas: ReplicatedPlan, seq: int, step: int, loss: float, times: torch.Tensor,
                    tokens: int) -> dict[str, Any]:
    topologies = replicas.topologies()
    record = step_record(step, loss, times, topologies[0], tokens)
    if not replicas.several:
        return record
    col = {name: i for i, name in enumerate(TIME_FIELDS)}
    record["stages"], record["replicas"] = [], []
    for index, (replica, topology) in enumerate(zip(replicas.replicas, topologies)):
        own = step_record(step, loss, times, topology, (replica.rows or 0) * seq)
        record["stages"] += [{**stage, "replica": index} for stage in own["stages"]]
        ranks = list(topology.ranks)
        sync_s = float(times[ranks, col["replica_sync"]].max())
        step_s = record["step_s"]
        record["replicas"].append({
            "replica": index, "rows": replica.rows, "backends": sorted({m.backend for m in topology.stages}),
            "tokens_per_s": (replica.rows or 0) * seq / step_s if step_s > 0 else None, "sync_s": sync_s,
            "sync_share": sync_s / step_s if step_s > 0 else None,
            "cross_replica_bytes": int(times[ranks, col["replica_bytes"]].sum()),
            # buckets whose exchange began during the backward (null: none of its stages overlaps)
            "buckets_during_backward": _buckets_early([times[list(m.ranks), col["replica_early"]] for m in topology.stages])})
    return record


def _buckets_early(stages: list[torch.Tensor]) -> int | None:
    """A replica's buckets begun during the backward: each stage's (its ranks share its buckets: their max), summed."""
    counted = [float(c[~torch.isnan(c)].max()) for c in stages if (~torch.isnan(c)).any()]
    return int(sum(counted)) if counted else None

def steady_rate(records: list[dict[str, Any]]) -> float | None:
    """Tokens per second of the steps after the first: the first step's warm-up (allocator, kernels,
    autotuning) and checkpoint writes (outside ``step_s``) are not training speed. One step: that step.
    With ``parallel.order: measured`` the steps from the one after the calibration: the order that trains."""
    after = [i + 1 for i, rec in enumerate(records) if "order" in rec]
    steady = (records[after[0]:] if after and after[0] < len(records) else records[1:]) or records
    seconds = sum(rec["step_s"] for rec in steady)
    return sum(rec["tokens"] for rec in steady) / seconds if seconds > 0 else None

EXPLODED = 3.0  # a loss above this many times the larger of ln(vocab) (a uniform guess) and the run's first: diverged
DIVERGED_STATUS = 3  # hal train's exit status for a run that completed with a diverged loss


def divergence(losses: list[float | None], vocab_size: int, first_step: int) -> dict[str, Any] | None:
    """Where the run's loss diverged — the first step whose loss was not finite (the log writes None) or exploded past
    ``EXPLODED`` times the larger of ln(vocab) and the run's first loss — as ``{"step", "loss", "reason"}``; None
    where it did not. A cross-entropy far above a uniform guess's means the weights were driven off, whatever did it
    (a learning rate, an outer momentum, a precision, a bad batch)."""
    first = next((v for v in losses if v is not None and math.isfinite(v)), None)
    bound = EXPLODED * max(math.log(vocab_size), first if first is not None else 0.0)
    for offset, value in enumerate(losses):
        step = first_step + offset
        if value is None or not math.isfinite(value):
            return {"step": step, "loss": None, "reason": f"the loss at step {step} was not finite"}
        if value > bound:
            return {"step": step, "loss": value, "reason": f"the loss at step {step} ({value:.4g}) exploded past {bound:.4g} "
                    f"({EXPLODED:g} x the larger of ln(vocab) and the run's first loss)"}
    return None


def run_summary(job: Job, replicas: ReplicatedPlan, seq: int, steps: int, start: int, records: list[dict[str, Any]],
                wall_s: float, checkpoint: str | None) -> dict[str, Any]:
    """``summary.json``: the run's losses, speed, MFU and each stage's share of the step, over the writer's records.
    ``replicas``: the rows in force at the end (a rebalance moves them)."""
    from hal.parallel.config.flops import flops_per_token, mfu

    tokens = sum(rec["tokens"] for rec in records)
    rate = steady_rate(records)
    peak = records[0]["peak_tflops"] if records else None
    stages = [stage_summary(m, records, at) for at, m in enumerate(all_stages(replicas))]
    plans = [plan for plan, topology in zip(replicas.plans(), replicas.topologies()) for _ in topology.stages]
    for stage, plan, mesh in zip(stages, plans, all_stages(replicas)):
        how = stage_pairs(plan.schedule, plan.num_stages, plan.micro_batches, mesh, job.model)  # DualPipeV: "at once", or "in turn: " and why
        if how is not None:
            stage["pairs"] = how
    value = mfu(rate, job.model, seq, peak)
    orders = [rec["order"] for rec in records if "order" in rec]  # parallel.order: measured — what the calibration chose
    return {
        "config": job.config, "precision": job.precision, "world_size": job.world_size, "steps": steps, "resumed_from_step": start,
        "first_step": records[0]["step"] if records else None, "last_step": records[-1]["step"] if records else None,
        "losses": [rec["loss"] for rec in records], "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "diverged": divergence([rec["loss"] for rec in records], job.model.vocab_size, records[0]["step"]) if records else None,
        "evals": [{"step": rec["step"], "loss": rec["eval_loss"]} for rec in records if "eval_loss" in rec],
        "tokens": tokens, "wall_s": wall_s,
        "tokens_per_s": rate, "tokens_per_s_wall": tokens / wall_s if wall_s > 0 else None,
        "mfu": value, "mfu_note": None if value is not None else mfu_note(records, stages, job.precision),
        "peak_tflops": peak,
        "flops_per_token": flops_per_token(job.model, seq), "profile": job.profile,
        "first_step_s": records[0]["step_s"] if records else None, "log_file": str(job.log_file), "checkpoint": checkpoint,
        "stages": stages,
        **({"replicas": replica_summary(records)} if records and "replicas" in records[0] else {}),
        **standin_summary(replicas),
        **({"order": orders[-1]} if orders else {}),
    }

def standin_summary(replicas: ReplicatedPlan) -> dict[str, Any]:
    """{"standin": {backends, note}} where stages ran on a vendor's host-backed stand-in (``hal.standin``), else {}:
    such a run proves the paths, not the hardware, and its summary says so."""
    from hal.standin import STANDIN_NOTE, requested

    used = sorted({m.backend for m in all_stages(replicas)} & set(requested()))
    return {"standin": {"backends": used, "note": STANDIN_NOTE}} if used else {}


def replica_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each replica over the steady steps (after the first): the rows in force at the end (and at the start, where a
    rebalance moved them), tokens/s, the exchange's share of the step, bytes, buckets begun during the backward."""
    steady = records[1:] or records
    seconds = sum(rec["step_s"] for rec in steady)
    seq = records[0]["tokens"] // sum(r["rows"] for r in records[0]["replicas"])  # tokens a row
    out = []
    for index, first in enumerate(records[0]["replicas"]):
        own = [rec["replicas"][index] for rec in steady]
        ok = seconds > 0
        out.append({"replica": index, "rows": records[-1]["replicas"][index]["rows"], "first_rows": first["rows"],
                    "backends": first["backends"],
                    "tokens_per_s": sum(r["rows"] for r in own) * seq / seconds if ok else None,
                    "sync_share": sum(r["sync_s"] for r in own) / seconds if ok else None,
                    "cross_replica_bytes_per_step": sum(r["cross_replica_bytes"] for r in own) / len(own),
                    "buckets_during_backward_per_step": (None if own[-1].get("buckets_during_backward") is None else
                                                         sum(r["buckets_during_backward"] or 0 for r in own) / len(own))})
    return out

def all_stages(replicas: ReplicatedPlan) -> list[StageMesh]:
    """Every stage of the run in record order: replica 0's, then replica 1's ... (one plan: its stages)."""
    return [m for topology in replicas.topologies() for m in topology.stages]

def stage_summary(mesh: StageMesh, records: list[dict[str, Any]], at: int) -> dict[str, Any]:
    """One stage in the summary: its grid and layers, its largest rank's peak memory over the run (the
    allocator's high-water mark; cpu: peak RSS), its devices' summed peak TFLOP/s (None: one has none in the
    catalog) and the share of the steady steps it spent computing (None where its phases were not measured)."""
    own = [rec["stages"][at] for rec in records]
    memory = [s["peak_memory_bytes"] for s in own if s.get("peak_memory_bytes") is not None]
    return {"stage": mesh.index, "backend": mesh.backend, "ranks": list(mesh.ranks), "tp": mesh.tp, "dp": mesh.dp,
            "sp": mesh.sp, "layers": mesh.layer_ids, "peak_memory_bytes": max(memory) if memory else None,
            "peak_tflops": own[0].get("peak_tflops") if own else None, "compute_share": compute_share(records, at),
            **({"replica": own[0]["replica"]} if own and "replica" in own[0] else {})}

def compute_share(records: list[dict[str, Any]], stage: int) -> float | None:
    """The share of the steady steps' time (after the first, as ``steady_rate``) that ``stage`` spent computing,
    mean over its ranks: 1 − it is the stage's idle share (waiting in send/recv, bubble, sync, optimizer).
    None where a step's phases were not measured (an accelerator without ``--profile``)."""
    steady = records[1:] or records
    compute = [rec["stages"][stage]["compute_s"] for rec in steady]
    seconds = sum(rec["step_s"] for rec in steady)
    if not steady or any(c is None for c in compute) or seconds <= 0:
        return None
    return min(1.0, sum(compute) / seconds)

def mfu_note(records: list[dict[str, Any]], stages: list[dict[str, Any]], precision: str) -> str:
    """Why the summary has no MFU, in a few words: no step ran, no rate, or a device whose peak the catalog lacks."""
    from hal.parallel.config.flops import PEAK_KEY

    if not records:
        return "no step ran"
    if not steady_rate(records):
        return "no step time measured"
    unknown = sorted({s["backend"] for s in stages if s.get("peak_tflops") is None})
    if unknown:
        return f"no {PEAK_KEY.get(precision, precision)} peak FLOP/s known for {', '.join(unknown)}"
    return "no peak FLOP/s known"
