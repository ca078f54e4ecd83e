"""Pipeline throughput: hal's 1F1B engine against torch.distributed.pipelining's Schedule1F1B.

The same model (a Llama-style decoder from ``parallel.models.stage``, about 1.1B parameters by default:
hidden 2048, 24 layers, 16 heads / 4 kv-heads, SwiGLU 5632, vocab 32000, sequence 2048, bf16
weights) is split into P stages (equal, or ``--layers`` per stage), one GPU each. Both schedules run on the SAME stage modules
(torch's ``PipelineStage`` wraps ours as they are: the last stage returns logits, and torch's
``loss_fn`` is the engine's), the same micro-batches and the same tokens. Per step both do forward
and backward of every micro-batch (no optimizer). The rounds alternate ours / torch so drift hits both.

Reported, with the card:
  * tokens/s of each and the ratio ours/torch (goal >= 1.0);
  * MFU = tokens/s x FLOPs per token / (P x the catalog's dense bf16 peak), with torchtitan's count
    FLOPs/token = 6 x (parameters - embedding) + 12 x layers x heads x head_dim x sequence;
  * peak memory per stage (max_memory_allocated during the timed steps) of each;
  * the bubble: a separate pass with the device synchronized around every phase measures, per stage,
    1 - compute / schedule time, against the ideal (P-1)/(M+P-1) of equal stages.

    python benchmarks/pipeline.py [--backend cuda] [--stages 4] [--micro-batches 8] [--micro-batch-size 1]
        [--preset 1b|tiny] [--layers 7,6,6,5] [--compile] [--fused-head] [--reference-ops] [--master-weights]
        [--steps 5] [--warmup 2] [--rounds 2] [--order unit|measured] [--json] [--timeout 900] [--trace DIR]

``--master-weights`` keeps the weights in float32 and runs the forward under ``--dtype`` autocast — what
``hal train``'s bf16-mixed does (fp32 master weights and gradients, casts every micro-batch, fp32 boundaries)
— for both schedules, so ``hal train``'s throughput has a baseline in its own precision.

``--fused-head`` makes the last stage return the head's input and the loss apply the head through the
fused linear + cross-entropy (``parallel.models.fused_head``) — for both schedules, which share the loss.
The ratio ours/torch is also given round by round, with its spread (min..max).

``--schedule interleaved-1f1b --virtual-stages V`` gives every rank V chunks of its layers and compares with
torch's ScheduleInterleaved1F1B over the same chunks (one ``PipelineStage`` per chunk, each a view that runs
``Stage.forward_chunk``); ``zero-bubble`` and ``interleaved-zero-bubble`` with torch's ScheduleInterleavedZeroBubble
(ZB1P) over one stage per rank or the same chunks; ``zbv`` with torch's ScheduleZBVZeroBubble over the same two
chunks a rank, placed in a V (rank r holds virtual stages r and 2P-1-r); the others with Schedule1F1B. Each stage's idle share is also
predicted by the simulator fed with that stage's measured compute time (backward = 2 x forward).

``--baseline 1f1b`` compares with our own engine under 1F1B instead, on the same layers a stage (a chunked stage's
chunks summed) with its own copy of the weights: the zero-bubble family's gain over 1F1B, compiled and with the fused
head too (torch's zero-bubble classes split neither). Each peak memory then leaves out the other engine's weights.

``--preset tiny --backend cpu`` runs the same code on gloo in seconds (a smoke test, not a benchmark).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.spawn import failures, launch_ranks  # noqa: E402
from hal.parallel.schedules import get_schedule, schedule_names  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B's shapes with 24 layers (6 per stage at P=4): 1.10e9 parameters untied.
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "num_layers": 24, "num_heads": 16, "num_kv_heads": 4,
           "ffn_hidden_size": 5632, "max_seq_len": 2048},
    "tiny": {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
             "ffn_hidden_size": 128, "max_seq_len": 64},
}


# --- model arithmetic ----------------------------------------------------------------------------------
def parameter_counts(m: dict[str, Any]) -> dict[str, int]:
    """Parameters of the untied decoder: total, and the embedding table's share (hal.parallel.config.flops)."""
    from hal.parallel.config.flops import model_parameters
    from hal.parallel.config.model import ModelConfig

    return {"total": model_parameters(ModelConfig(**m)), "embedding": m["vocab_size"] * m["hidden_size"]}


def flops_per_token(m: dict[str, Any], seq: int) -> float:
    """Training FLOPs per token (forward + backward): hal.parallel.config.flops's convention, as hal train reports."""
    from hal.parallel.config.flops import flops_per_token as per_token
    from hal.parallel.config.model import ModelConfig

    return per_token(ModelConfig(**m), seq)


# --- what every rank runs ------------------------------------------------------------------------------
def _reference_ops_only() -> None:
    """Remove every implementation but the reference from hal's op registry (this rank only)."""
    from hal.ops import registry
    from hal.ops.registry import REFERENCE

    for op in registry.names():
        for impl in registry.implementations(op):
            if impl.name != REFERENCE:
                registry.unregister(op, impl.name)



def _rank_main(rank: int, world_size: int, store: str, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.collectives import init_distributed, shutdown
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import ParallelPlan, StagePlan, validate_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    torch.set_num_threads(max(1, opts["threads"]))
    if opts.get("baseline") == "in-turn":  # at once on compiled stages too: that comparison is the point
        os.environ.setdefault("HAL_PAIR_OVERLAP", "1")
    if opts.get("reference_ops"):
        _reference_ops_only()
    world = init_distributed(opts["backend"], init_method=f"file://{store}", rank=rank, world_size=world_size)
    backend, device = world.backend, world.device
    try:
        model = ModelConfig(**opts["model"])
        layers = opts.get("layers") or _split_layers(model.num_layers, world_size)
        plan = ParallelPlan(tuple(StagePlan(backend.name, 1, tuple(n) if isinstance(n, list) else n) for n in layers),
                            opts.get("schedule", "1f1b"), opts["micro_batches"],
                            opts["micro_batch_size"], compile=opts.get("compile", False),
                            fused_head=opts.get("fused_head", False), virtual_stages=opts.get("virtual_stages", 1),
                            order=opts.get("order", "unit"))
        validate_plan(plan, model, world_size=world_size, check_backends=False, seq_len=opts["seq"])
        topology = Topology.from_plan(plan)
        groups = build_mesh(topology, world, validate=False)
        dtype = getattr(torch, opts["dtype"])
        autocast = None
        if opts.get("master_weights"):  # hal train's mixed precision: fp32 weights, the forward under autocast
            autocast, dtype = (lambda d=dtype: backend.autocast(d)), torch.float32
        engine = build_engine(model, plan, groups, backend=backend, seed=0, device=device, dtype=dtype,
                                seq_len=opts["seq"], autocast=autocast)
        M, mbs, seq = plan.micro_batches, plan.micro_batch_size, opts["seq"]
        gen = torch.Generator().manual_seed(1)  # the same tokens on every rank
        tokens = torch.randint(0, model.vocab_size, (M, mbs, seq + 1), generator=gen).to(device)

        def ours() -> None:
            engine.module.zero_grad(set_to_none=True)
            engine.step_lazy(tokens)  # no host read of the loss, as torch's schedule (losses stay tensors)

        if opts.get("baseline", "torch") == "torch":
            torch_step, other = _torch_schedule(engine, tokens, backend, world_size, rank), None
        elif opts["baseline"] == "in-turn":  # the same engine, its pairs one after the other
            torch_step, other = _in_turn(engine, ours), None
        else:  # our own engine with another schedule over the same layers a stage (its own copy of them)
            torch_step, other = _own_baseline(model, plan, layers, opts, world, dtype, autocast, tokens)
        modules = [engine.module] + ([other] if other is not None else [])
        # With a second engine, each peak leaves out the other's resting weights (both copies live on the device).
        resting = {"ours": _bytes(other), "torch": _bytes(engine.module)} if other is not None else {"ours": 0, "torch": 0}

        def sync() -> None:
            backend.synchronize()
            dist.barrier()

        report: dict[str, Any] = {"rank": rank, "stage": rank, "layers": layers[rank], "device": str(device),
                                  "device_name": backend.device_name(device.index or 0) if device.type != "cpu" else "cpu"}
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        peak: dict[str, int] = {"ours": 0, "torch": 0}
        for fn in (ours, torch_step):  # warm up both (torch's first step also infers shapes)
            for _ in range(opts["warmup"]):
                fn()
        if opts.get("order") == "measured":  # hal train's calibration: one step with device events, then the links
            report_order = _measured_order(engine, plan, rank, ours)
        for _ in range(opts["rounds"]):
            for name, fn in (("ours", ours), ("torch", torch_step)):
                for module in modules:  # neither step's gradients are held while the other is measured
                    module.zero_grad(set_to_none=True)
                sync()
                if device.type != "cpu":
                    backend.reset_peak_memory_stats()
                start = time.perf_counter()
                for _ in range(opts["steps"]):
                    fn()
                sync()
                times[name].append((time.perf_counter() - start) / opts["steps"])
                if device.type != "cpu":
                    peak[name] = max(peak[name], backend.max_memory_allocated() - resting[name])
        report["step_s"] = times
        if opts.get("order") == "measured":
            report["order"] = report_order
        report["peak_memory_bytes"] = peak
        if engine.pair_overlap is not None:  # dualpipev: how its pairs ran, and how many at once
            report["pairs"] = {"how": engine.pair_overlap, "at_once": engine.pairs_run}
        report["bubble"] = _bubble(engine, tokens, opts["steps"])
        if opts.get("trace"):
            report["trace"] = _trace(opts["trace"], rank, device, {"ours": ours, "torch": torch_step}, sync)
        if rank == 0 and device.type != "cpu":
            caps = backend.capabilities(device.index or 0)
            report["peak_bf16_tflops"] = caps.peak_tflops.get("bf16")
        sync()
        return report
    finally:
        shutdown()


def _measured_order(engine: Any, plan: Any, rank: int, step: Any) -> dict[str, Any]:
    """``--order measured``: one step timed with device events, each link's round trip, and every rank's engine
    switched to the order the simulator finds fastest with those times (``parallel.loop.measured_order``, as
    ``hal train`` does on its second step); what it chose, for the summary."""
    from hal.parallel.config.replicas import ReplicatedPlan
    from hal.parallel.loop import measured_order
    from hal.parallel.replicas.replica_set import ReplicaSet

    engine.measure_on_device = True
    step()
    engine.measure_on_device = False
    replicas = ReplicaSet(ReplicatedPlan.single(plan), rank)  # one plan: the set of one replica
    choice = measured_order.calibrate(engine, replicas, rank, -1, 0, measured_order.CALIBRATION_STEP + 2,
                                      measured_order.CALIBRATION_STEP)  # writer -1: nobody prints
    assert choice is not None
    return {**choice.to_dict(), "said": choice.text().replace(f"; it runs from step {choice.step}", "; the timed rounds run it")}


def _split_layers(num_layers: int, stages: int) -> list[int]:
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def _bubble(engine: Any, tokens: torch.Tensor, steps: int) -> dict[str, float]:
    """Per-stage time shares of the schedule, from device events at every phase boundary (host clock on the CPU).

    ``compute_s`` also feeds the simulator (``summarise``): the idle share the schedule should have had."""
    engine.measure_on_device = True
    compute = p2p = schedule = 0.0
    for _ in range(steps):
        engine.module.zero_grad(set_to_none=True)
        engine.step(tokens)
        t = engine.times
        compute, p2p, schedule = compute + t.compute, p2p + t.p2p, schedule + t.schedule
    engine.measure_on_device = False
    return {"compute_s": compute / steps, "p2p_s": p2p / steps, "schedule_s": schedule / steps,
            "idle_fraction": 1.0 - compute / schedule}


def _trace(directory: str, rank: int, device: torch.device, steps: dict[str, Any], sync: Any) -> dict[str, Any]:
    """Profile one step of each schedule on this rank (torch.profiler): where the host and the device spend it.

    Writes ``rank{r}_{name}.txt`` (operators by self device time and by host time) and, for ranks 0 and 1,
    a gzipped Chrome trace; returns each step's device-busy share (kernel time over the step's wall time),
    which tells a device-bound step (near 1) from a host-bound one.
    """
    from torch.profiler import ProfilerActivity, profile

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    shares: dict[str, Any] = {}
    for name, fn in steps.items():
        sync()
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            fn()
            sync()
        wall = time.perf_counter() - start
        averages = prof.key_averages()
        device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in averages)
        tables = []
        for key in ("self_device_time_total", "cpu_time_total", "self_cpu_time_total"):
            try:
                tables.append(f"--- by {key}\n" + averages.table(sort_by=key, row_limit=30))
            except Exception as exc:  # noqa: BLE001 - a sort key this torch lacks: say so, keep the others
                tables.append(f"--- by {key}: {exc}")
        (out / f"rank{rank}_{name}.txt").write_text(f"wall {wall:.4f} s, device kernels {device_us / 1e6:.4f} s\n"
                                                    + "\n".join(tables))
        if rank < 2:
            trace = out / f"rank{rank}_{name}.json"
            prof.export_chrome_trace(str(trace))
            import gzip
            import shutil

            with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
        shares[name] = {"wall_s": wall, "device_busy_s": device_us / 1e6}
    # The host's own speed on this rank: a fixed pure-Python loop (a rank sharing its core runs it slower).
    start = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i & 7
    shares["python_loop_s"] = time.perf_counter() - start
    shares["cpus_allowed"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return shares


class _ChunkView(torch.nn.Module):
    """One model chunk of an interleaved stage as its own module, for torch's one-PipelineStage-per-chunk API.

    It registers exactly the submodules the chunk runs (its layers; the embedding, norm and head where it
    holds them), so torch's per-stage parameter work — the weight-gradient half of its zero-bubble schedules,
    gradient scaling — covers the chunk's parameters and no others; the stage itself is held unregistered.
    """

    def __init__(self, stage: torch.nn.Module, chunk: int) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)
        self.chunk = chunk
        self.layers = torch.nn.ModuleList(stage.layers[str(i)] for i in stage.chunks[chunk])
        if stage.first and chunk == 0:
            self.embed = stage.embed
        if stage.last and chunk == len(stage.chunks) - 1:
            self.norm = stage.norm
            self.head_owner = stage.embed if stage.tied else stage.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage.forward_chunk(x, self.chunk)


def _bytes(module: torch.nn.Module | None) -> int:
    """The resting bytes of a module's parameters and buffers (0 for none)."""
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _in_turn(engine: Any, ours: Any) -> Any:
    """``--baseline in-turn``: a step of the same DualPipeV engine with its pairs one after the other."""
    if engine.pair_overlap != "at once":
        raise RuntimeError(f"--baseline in-turn: stage {engine.coord.stage} runs its pairs one after the other anyway "
                           f"({engine.pair_overlap})")

    def step() -> None:
        engine.run_pairs_at_once(False)
        try:
            ours()
        finally:
            engine.run_pairs_at_once(True)

    return step


def _own_baseline(model: Any, plan: Any, layers: list[Any], opts: dict[str, Any], world: Any,
                  dtype: torch.dtype, autocast: Any, tokens: torch.Tensor) -> tuple[Any, torch.nn.Module]:
    """``--baseline 1f1b``: our engine under plain 1F1B with the same layers on each stage (a stage's chunks
    summed), the same precision, compile and head — the zero-bubble paper's comparison. Returns its step and
    module; it keeps its own copy of the weights."""
    import dataclasses

    from hal.parallel.config.plan import StagePlan
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh
    from hal.parallel.schedules import get_schedule

    counts = [sum(n) if isinstance(n, (list, tuple)) else n for n in layers]
    base = dataclasses.replace(plan, stages=tuple(StagePlan(s.backend, 1, n) for s, n in zip(plan.stages, counts)),
                               schedule=get_schedule("1f1b"), virtual_stages=1, order="unit")
    mesh = build_mesh(Topology.from_plan(base), world, validate=False)  # its own groups: the placement differs
    engine = build_engine(model, base, mesh, backend=world.backend, seed=0, device=world.device, dtype=dtype,
                          seq_len=opts["seq"], autocast=autocast)

    def step() -> None:
        engine.module.zero_grad(set_to_none=True)
        engine.step_lazy(tokens)

    return step, engine.module


def _torch_schedule(engine: Any, tokens: torch.Tensor, backend: Any, world_size: int, rank: int) -> Any:
    """A closure running one step of torch's schedule (Schedule1F1B, or ScheduleInterleaved1F1B over the
    engine's chunks) over the same modules and tokens."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    from hal.parallel.schedules.placement import virtual_index

    group = dist.new_group(list(range(world_size)), backend=backend.process_group_backend())
    M, V = tokens.shape[0], engine.chunks
    kind = getattr(pipelining, engine.schedule.torch_class)  # the schedule names torch's class of the same order
    # The engine's loss: the token sum over one micro-batch's tokens, the mean of each of torch's chunks.
    placement = engine.mesh.topology.placement
    if V > 1:  # one PipelineStage per chunk, numbered in model order (zbv: the V's numbering, as torch's ZBV places them)
        stages = [PipelineStage(_ChunkView(engine.module, v), virtual_index(rank, v, world_size, placement), V * world_size,
                                engine.device, group=group) for v in range(V)]
        schedule: Any = kind(stages, n_microbatches=M, loss_fn=engine.loss_fn)
    else:  # one stage a rank; zero-bubble: torch's ZB1P (a multi-stage class) over that one stage
        stage = PipelineStage(engine.module, rank, world_size, engine.device, group=group)
        schedule = kind([stage] if issubclass(kind, PipelineScheduleMulti) else stage, n_microbatches=M,
                        loss_fn=engine.loss_fn)
    x = tokens[:, :, :-1].reshape(-1, tokens.shape[-1] - 1).contiguous()  # torch checks input strides
    y = tokens[:, :, 1:].reshape(-1, tokens.shape[-1] - 1).contiguous()

    def step() -> None:
        engine.module.zero_grad(set_to_none=True)
        with engine.autocast():  # the same region as ours under --master-weights (a no-op context otherwise)
            if rank == 0 and engine.last:  # zbv: the first rank holds the model's both ends
                schedule.step(x, target=y, losses=[])
            elif rank == 0:
                schedule.step(x)
            elif engine.last:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()

    return step


# --- the parent: launch, summarise ---------------------------------------------------------------------
def summarise(reports: dict[int, dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    P, M, mbs, seq = len(reports), opts["micro_batches"], opts["micro_batch_size"], opts["seq"]
    tokens_per_step = M * mbs * seq
    step = {name: statistics.median(max(r["step_s"][name][i] for r in reports.values())
                                    for i in range(opts["rounds"])) for name in ("ours", "torch")}
    tps = {name: tokens_per_step / s for name, s in step.items()}
    # Round by round: the slowest rank's time of each schedule; ours/torch throughput = torch time / ours.
    per_round = [max(r["step_s"]["torch"][i] for r in reports.values()) / max(r["step_s"]["ours"][i] for r in reports.values())
                 for i in range(opts["rounds"])]
    r0 = reports[0]
    peak = r0.get("peak_bf16_tflops")
    fpt = flops_per_token(opts["model"], seq)
    mfu = {name: (t * fpt / (P * peak * 1e12) if peak else None) for name, t in tps.items()}
    from hal.parallel.schedules import simulate

    schedule = get_schedule(opts.get("schedule", "1f1b"))
    ran = schedule  # the idle our engine should have had: with the order it ran
    order = r0.get("order")
    if order and order["chosen"] == "measured":
        from hal.parallel.schedules.stage_times import StageTimes

        ran = schedule.timed(StageTimes.of(order["forward_s"], order["backward_input_s"], order["backward_weight_s"],
                                           order["links_s"]))

    V = opts.get("virtual_stages", 1)
    compute = [r["bubble"]["compute_s"] / (3 * M) for _, r in sorted(reports.items())]  # F per micro-batch, B = 2F
    chunk_layers = [r["layers"] for _, r in sorted(reports.items())]
    shares = ([[c / sum(n) for c in n] if isinstance(n, list) else [1.0 / V] * V for n in chunk_layers]
              if V > 1 else None)  # uneven chunks ('3+4'): a chunk's share of its stage's time
    predicted = simulate(ran, P, M, forward_s=compute,
                         backward_s=[2 * c for c in compute], virtual_stages=V, chunk_share=shares).bubble
    stages = [{"stage": r["stage"], "layers": r["layers"], "device": r["device_name"],
               "peak_mem_gib_ours": r["peak_memory_bytes"]["ours"] / 2**30,
               "peak_mem_gib_torch": r["peak_memory_bytes"]["torch"] / 2**30,
               "compute_s": r["bubble"]["compute_s"], "p2p_s": r["bubble"]["p2p_s"],
               "schedule_s": r["bubble"]["schedule_s"], "idle_fraction": r["bubble"]["idle_fraction"],
               "idle_simulated": predicted[k], **({"trace": r["trace"]} if "trace" in r else {}),
               **({"pairs": r["pairs"]} if "pairs" in r else {})}
              for k, (_, r) in enumerate(sorted(reports.items()))]
    return {
        "card": r0["device_name"], "torch": torch.__version__, "stages": P, "micro_batches": M,
        "micro_batch_size": mbs, "seq": seq, "dtype": opts["dtype"], "model": opts["model"], "compile": opts.get("compile", False),
        "master_weights": opts.get("master_weights", False),
        "reference_ops": opts.get("reference_ops", False),
        "parameters": parameter_counts(opts["model"])["total"], "flops_per_token": fpt,
        "fused_head": opts.get("fused_head", False), "layers": [r["layers"] for _, r in sorted(reports.items())],
        "schedule": opts.get("schedule", "1f1b"), "virtual_stages": V,
        "torch_schedule": schedule.torch_class if opts.get("baseline", "torch") == "torch" else None,
        "baseline": opts.get("baseline", "torch"), "order": r0.get("order", {"chosen": "unit"}),
        "step_s": step, "tokens_per_s": tps, "ratio_ours_over_torch": tps["ours"] / tps["torch"],
        "ratio_per_round": per_round, "ratio_spread": [min(per_round), max(per_round)],
        "mfu": mfu, "peak_bf16_tflops_per_device": peak, "per_stage": stages,
        # equal stages (F = 1, B = 2): 1F1B's (P-1)/(M+P-1), interleaving's (P-1)/(VM+P-1), the zero-bubble family less
        "bubble_ideal": simulate(schedule, P, M, forward_s=1.0, backward_s=2.0,
                                 virtual_stages=V).bubble_overall,
        "bubble_measured_mean": statistics.mean(s["idle_fraction"] for s in stages),
    }


def table(s: dict[str, Any]) -> str:
    lines = [
        f"pipeline {s.get('schedule', '1f1b')} on {s['stages']} x {s['card']} (torch {s['torch']}): {s['parameters'] / 1e9:.2f}B params, "
        f"seq {s['seq']}, {s['dtype']}" + (" autocast, fp32 master weights" if s.get("master_weights") else "")
        + f", M={s['micro_batches']} x mbs {s['micro_batch_size']}"
        + (", layers compiled" if s.get("compile") else ", eager")
        + (", reference ops" if s.get("reference_ops") else ", registry's kernels")
        + (", fused head" if s.get("fused_head") else "") + f", layers {s.get('layers')}",
        *([f"order: {s['order']['said']}"] if "said" in s.get("order", {}) else []),
        f"{'schedule':<32}{'step s':>9}{'tokens/s':>11}{'MFU':>8}",
    ]
    own = s.get("baseline", "torch") != "torch"
    baseline = {"1f1b": "hal 1f1b (baseline)", "in-turn": "hal dualpipev, pairs in turn"}.get(
        s.get("baseline", "torch"), f"torch {s.get('torch_schedule', 'Schedule1F1B')}")
    for name, label in (("ours", f"hal {s.get('schedule', '1f1b')}"), ("torch", baseline)):
        mfu = s["mfu"][name]
        lines.append(f"{label:<32}{s['step_s'][name]:>9.3f}{s['tokens_per_s'][name]:>11.0f}"
                     f"{'' if mfu is None else f'{100 * mfu:.1f}%':>8}")
    lines.append(f"throughput ratio ours/{s.get('baseline', 'torch') if own else 'torch'}: {s['ratio_ours_over_torch']:.3f} "
                 f"(goal {_GOALS.get(s.get('baseline', 'torch'), '>= 1.0')}); by round "
                 + " ".join(f"{r:.3f}" for r in s["ratio_per_round"])
                 + f" (spread {s['ratio_spread'][0]:.3f}..{s['ratio_spread'][1]:.3f})")
    other = {"1f1b": "mem 1f1b GiB", "in-turn": "in turn GiB"}.get(s.get("baseline", "torch"), "mem torch GiB")
    lines.append(f"{'stage':<6}{'layers':>7}{'mem ours GiB':>14}{other:>15}{'compute s':>11}{'p2p s':>8}{'sched s':>9}"
                 f"{'idle':>7}{'sim idle':>9}")
    for st in s["per_stage"]:
        lines.append(f"{st['stage']:<6}{str(st['layers']):>7}{st['peak_mem_gib_ours']:>14.2f}{st['peak_mem_gib_torch']:>15.2f}"
                     f"{st['compute_s']:>11.3f}{st['p2p_s']:>8.3f}{st['schedule_s']:>9.3f}{st['idle_fraction']:>7.3f}"
                     f"{st['idle_simulated']:>9.3f}")
    lines.append(f"bubble: measured mean idle {s['bubble_measured_mean']:.3f} vs ideal (equal stages) {s['bubble_ideal']:.3f}; "
                 "sim idle: the simulator fed with each stage's measured compute")
    return "\n".join(lines)


_GOALS = {"1f1b": ">= 1.15 for the zero-bubble family at M=8", "in-turn": "> 1.0 where a stage's host sets the pace"}


def _parse_args(argv: list[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages = ranks, one device each")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--seq", type=int, help="sequence length (default: the preset's max_seq_len)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--master-weights", action="store_true",
                        help="float32 weights with the forward under --dtype autocast (hal train's mixed precision), both schedules")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="ours/torch alternations; medians reported")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--reference-ops", action="store_true",
                        help="run hal's reference ops only (no Triton kernels): the kernels' effect, same run otherwise")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each decoder layer (inductor); both schedules run the same compiled modules")
    parser.add_argument("--fused-head", action="store_true",
                        help="the head and the loss as one fused linear + cross-entropy (both schedules)")
    parser.add_argument("--layers", help="decoder layers per stage, comma-separated (default: as equal as possible)")
    parser.add_argument("--schedule", default="1f1b",
                        choices=list(schedule_names()),
                        help="hal's schedule; the baseline is torch's class of the same order (the schedule's "
                             "torch_class: Schedule1F1B for 1f1b, ScheduleGPipe for gpipe, ...)")
    parser.add_argument("--baseline", choices=("torch", "1f1b", "in-turn"), default="torch",
                        help="what ours is compared with: torch's class of the same order (default), our own engine "
                             "under 1F1B with the same layers a stage (the zero-bubble family's gain; it allows "
                             "--compile and --fused-head with a split backward, which torch's classes cannot split), "
                             "or, for dualpipev, the same engine with its pairs one after the other (what running them "
                             "at once gains)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="model chunks per stage for interleaved-1f1b (default 2); each stage's layers must divide")
    parser.add_argument("--order", choices=("unit", "measured"), default="unit",
                        help="measured: after the warm-up, our engine re-plays a zero-bubble-family order from measured "
                             "stage and link times, as hal train does (torch's class keeps its own order)")
    parser.add_argument("--trace", metavar="DIR",
                        help="after the timed rounds, profile one step of each schedule on every rank into DIR")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("stages", "micro_batches", "micro_batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.stages < 2:
        parser.error("--stages must be at least 2 (a pipeline)")
    schedule = get_schedule(args.schedule)
    splits = schedule.splits_backward
    if splits and args.compile and args.baseline == "torch":
        # torch's zero-bubble classes split a stage's backward through the autograd graph; a compiled layer's
        # backward is one node there (its first I action raises, seen on gloo)
        parser.error(f"--schedule {args.schedule} with --compile: torch's baseline cannot split a compiled layer's "
                     "backward; add --baseline 1f1b (our own 1F1B on the same layers)")
    if splits and args.fused_head and args.baseline == "torch":
        # torch's zero-bubble schedules split the weight gradients of the stage module they hold; the fused
        # head's weight is applied inside the loss, outside that module (its first W action raises, 4 x H200)
        parser.error(f"--schedule {args.schedule} with --fused-head: torch's baseline cannot split a head applied "
                     "inside the loss; drop --fused-head or add --baseline 1f1b")
    if args.baseline == "in-turn" and args.schedule != "dualpipev":
        parser.error(f"--baseline in-turn compares dualpipev's pairs at once and in turn; --schedule {args.schedule} "
                     "has no pairs (use --schedule dualpipev)")
    if args.order == "measured" and not schedule.plays_times:
        parser.error(f"--order measured re-plays a zero-bubble-family order; --schedule {args.schedule} has a fixed one")
    virtual = args.virtual_stages or schedule.chunks()
    problem = schedule.chunk_problem(virtual) or schedule.problem(args.stages, args.micro_batches)
    if virtual < 1 or problem:
        parser.error((problem or f"--virtual-stages {virtual} must be at least 1").replace("parallel.virtual_stages", "--virtual-stages")
                     .replace("parallel.micro_batches", "--micro-batches"))
    model = dict(PRESETS[args.preset])
    seq = args.seq or model["max_seq_len"]
    model["max_seq_len"] = max(model["max_seq_len"], seq)
    if model["num_layers"] < args.stages:
        parser.error(f"--stages {args.stages} exceeds the preset's {model['num_layers']} layers")
    layers: list[Any] | None = None
    if args.layers:  # a count per stage, or per chunk joined by '+' (e.g. 2+2,4+3,3+4,3+3 for 2 chunks a stage)
        try:
            layers = [[int(c) for c in n.split("+")] if "+" in n else int(n) for n in args.layers.split(",")]
        except ValueError:
            layers = []
        counts = [sum(n) if isinstance(n, list) else n for n in layers]
        bad_chunks = any(len(n) != virtual or min(n) < 1 if isinstance(n, list) else n % virtual for n in layers)
        if len(layers) != args.stages or min(counts, default=0) < 1 or sum(counts) != model["num_layers"] or bad_chunks:
            parser.error(f"--layers {args.layers}: give {args.stages} positive counts summing to the preset's "
                         f"{model['num_layers']} layers, e.g. {','.join(map(str, _split_layers(model['num_layers'], args.stages)))}"
                         f" (with {virtual} chunks a stage: each divisible by {virtual}, or {virtual} counts joined by '+')")
    return {"backend": args.backend, "stages": args.stages, "micro_batches": args.micro_batches,
            "micro_batch_size": args.micro_batch_size, "model": model, "seq": seq, "dtype": args.dtype,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads": args.threads,
            "timeout_s": args.timeout, "json": args.json, "compile": args.compile, "reference_ops": args.reference_ops,
            "fused_head": args.fused_head, "layers": layers, "schedule": args.schedule, "virtual_stages": virtual,
            "master_weights": args.master_weights, "trace": args.trace, "order": args.order, "baseline": args.baseline}


def main(argv: list[str] | None = None) -> int:
    opts = _parse_args(argv)
    reports = launch_ranks(_rank_main, opts["stages"], opts, opts["timeout_s"], opts["backend"])
    problems = failures(reports, opts["stages"], opts["timeout_s"])
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    summary = summarise(reports, opts)
    print(json.dumps(summary, indent=2) if opts["json"] else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
