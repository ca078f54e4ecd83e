"""Expert parallelism: the dispatch + combine against raw all-to-alls of the same bytes, and an MoE model's
throughput at ep = world against ep = 1. Both measured in the same run, on the same ranks, card named.

1. **Dispatch + combine** (``parallel.moe.dispatch`` / ``combine``): every rank routes T tokens (hidden H,
   top-k of E experts, drawn from a softmax router over random logits, so the splits are uneven) to the
   ranks holding their experts and back — counts exchange, one host read, the uneven all-to-all, the
   regrouping gather and scatter. The baseline is ``torch.distributed.all_to_all_single`` with the same
   splits, there and back (what the two data all-to-alls cost with nothing around them). Reported: the
   ratio of their times (goal >= 0.95: the bookkeeping costs under 5 %) and each one's GB/s per rank
   (rows sent and received, both directions).
2. **An MoE model** (one stage, dp = world; default 8 experts top-2, about 1.2B total parameters, 0.35B
   active): forward + backward steps through hal's engine at ep = world (each rank holds E / world
   experts, tokens cross ranks) and at ep = 1 (every rank holds every expert; no all-to-all). Reported:
   tokens/s and MFU on the active parameters (``parallel.flops``), peak memory per rank.

    python benchmarks/moe.py [--backend cuda] [--world-size 4] [--tokens 8192] [--hidden 2048] [--experts 8]
        [--top-k 2] [--model-steps 4] [--seq 2048] [--micro-batch-size 1] [--json]

``--backend cpu --world-size 2 --tiny`` runs the same code on gloo in seconds (a smoke test, not a benchmark).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.spawn import failures, launch_ranks  # noqa: E402

MODEL_1B = {"vocab_size": 32000, "hidden_size": 1024, "num_layers": 16, "num_heads": 16, "num_kv_heads": 4,
            "ffn_hidden_size": 2816, "max_seq_len": 2048, "moe_num_experts": 8, "moe_top_k": 2,
            "moe_ffn_hidden_size": 2816, "moe_aux_loss_weight": 0.01}
MODEL_TINY = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 64, "max_seq_len": 64, "moe_num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 64}


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _routing(opts: dict[str, Any], rank: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's expert-sorted rows (T·k, H) and per-expert counts, from a softmax top-k of random logits."""
    gen = torch.Generator().manual_seed(100 + rank)
    T, H, E, k = opts["tokens"], opts["hidden"], opts["experts"], opts["top_k"]
    logits = torch.randn(T, E, generator=gen) * 2.0
    experts = torch.topk(torch.softmax(logits, -1), k, dim=-1).indices.reshape(-1)
    order = torch.argsort(experts, stable=True)
    rows = torch.randn(T, H, generator=gen).to(dtype)[order // k]
    return rows.to(device), torch.bincount(experts, minlength=E).to(device)


def _exchange(rank: int, world: int, opts: dict[str, Any], comm: Any, group: Any, device: torch.device,
              sync: Callable[[], None]) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.parallel.moe import combine, dispatch

    dtype = getattr(torch, opts["dtype"])
    rows, load = _routing(opts, rank, device, dtype)
    local = opts["experts"] // world

    def ours() -> torch.Tensor:
        arrived, route = dispatch(rows, load, comm, local)
        return combine(arrived, route)  # identity experts: the exchange alone

    # the same splits for the baseline, computed once outside its timing
    arrived, route = dispatch(rows, load, comm, local)
    send, recv = route.send_splits, route.recv_splits
    back = torch.empty_like(rows)
    there = torch.empty((sum(recv), rows.shape[1]), dtype=dtype, device=device)

    def raw() -> None:
        dist.all_to_all_single(there, rows, recv, send, group=group)
        dist.all_to_all_single(back, there, send, recv, group=group)

    assert torch.equal(ours(), rows), "dispatch + combine must give every row back unchanged"
    for fn in (ours, raw):  # warm-up
        _timed(fn, sync, opts["warmup"])
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    for _ in range(opts["rounds"]):
        for name, fn in (("ours", ours), ("raw", raw)):
            times[name] += _timed(fn, sync, opts["repeats"])
    moved = (sum(send) + sum(recv)) * rows.shape[1] * rows.element_size() * 2  # both directions, there and back
    return {"ours_s": statistics.median(times["ours"]), "raw_s": statistics.median(times["raw"]), "bytes": moved,
            "send_rows": send, "recv_rows": recv}


def _model(rank: int, world: int, opts: dict[str, Any], ep: int, device: torch.device, backend: Any,
           sync: Callable[[], None]) -> dict[str, Any]:
    from hal.collectives import current_world
    from hal.parallel.engine import PipelineEngine
    from hal.parallel.model_config import ModelConfig
    from hal.parallel.plan import ParallelPlan, StagePlan, validate_plan
    from hal.parallel.topology import Topology, build_groups

    model = ModelConfig(**opts["model"])
    mbs = opts["micro_batch_size"] * world
    plan = ParallelPlan((StagePlan(backend.name, world, model.num_layers, dp=world, ep=ep),), "1f1b",
                        opts["micro_batches"], mbs)
    validate_plan(plan, model, world_size=world, check_backends=False, seq_len=opts["seq"])
    topology = Topology.from_plan(plan)
    groups = build_groups(topology, current_world(), validate=False)
    dtype = getattr(torch, opts["dtype"])
    engine = PipelineEngine(model, plan, topology, groups, backend=backend, seed=0, device=device, dtype=dtype,
                            seq_len=opts["seq"])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab_size, (opts["micro_batches"], mbs, opts["seq"] + 1), generator=gen).to(device)

    def step() -> None:
        engine.module.zero_grad(set_to_none=True)
        engine.step_lazy(tokens)

    _timed(step, sync, opts["warmup"])
    if device.type != "cpu":
        backend.reset_peak_memory_stats()
    times = _timed(step, sync, opts["model_steps"])
    peak = backend.max_memory_allocated() if device.type != "cpu" else 0
    engine.module.take_moe_tally()
    paths = sorted({str(block.path) for block in engine.module.moe_blocks().values()})  # grouped_mm or loop
    del engine
    return {"step_s": statistics.median(times), "tokens": opts["micro_batches"] * mbs * opts["seq"], "peak_bytes": peak,
            "expert_path": "+".join(paths)}


def _rank_main(rank: int, world: int, store: str, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.collectives import init_distributed, shutdown, world_communicator

    torch.set_num_threads(1)
    w = init_distributed(opts["backend"], init_method=f"file://{store}", rank=rank, world_size=world)
    backend, device = w.backend, w.device
    try:
        comm = world_communicator(validate=False)  # as the engine builds its groups for speed: no split agreement round
        group = dist.new_group(list(range(world)), backend=backend.process_group_backend())

        def sync() -> None:
            backend.synchronize()
            dist.barrier()

        report: dict[str, Any] = {"rank": rank, "device": backend.device_name(device.index or 0) if device.type != "cpu" else "cpu"}
        report["exchange"] = _exchange(rank, world, opts, comm, group, device, sync)
        if opts["model_steps"]:
            report["model"] = {f"ep{ep}": _model(rank, world, opts, ep, device, backend, sync) for ep in (world, 1)}
        if rank == 0 and device.type != "cpu":
            report["peak_bf16_tflops"] = backend.capabilities(device.index or 0).peak_tflops.get("bf16")
        sync()
        return report
    finally:
        shutdown()


def summarise(reports: dict[int, dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    from hal.parallel.flops import flops_per_token, model_parameters
    from hal.parallel.model_config import ModelConfig

    world = len(reports)
    r0 = reports[0]
    ours = max(r["exchange"]["ours_s"] for r in reports.values())
    raw = max(r["exchange"]["raw_s"] for r in reports.values())
    out: dict[str, Any] = {
        "card": r0["device"], "torch": torch.__version__, "world_size": world, "dtype": opts["dtype"],
        "exchange": {"tokens_per_rank": opts["tokens"], "hidden": opts["hidden"], "experts": opts["experts"],
                     "top_k": opts["top_k"], "ours_s": ours, "raw_s": raw, "ratio_raw_over_ours": raw / ours,
                     "gbps_per_rank_ours": statistics.mean(r["exchange"]["bytes"] for r in reports.values()) / ours / 1e9,
                     "recv_rows_rank0": r0["exchange"]["recv_rows"]},
    }
    if "model" in r0:
        model = ModelConfig(**opts["model"])
        peak = r0.get("peak_bf16_tflops")
        fpt = flops_per_token(model, opts["seq"])
        runs = {}
        for key in r0["model"]:
            step = max(r["model"][key]["step_s"] for r in reports.values())
            tps = r0["model"][key]["tokens"] / step
            runs[key] = {"step_s": step, "tokens_per_s": tps, "mfu_active": tps * fpt / (world * peak * 1e12) if peak else None,
                         "peak_gib": max(r["model"][key]["peak_bytes"] for r in reports.values()) / 2**30,
                         "expert_path": r0["model"][key].get("expert_path")}
        out["model"] = {"parameters": model_parameters(model), "active_parameters": model_parameters(model, active=True),
                        "seq": opts["seq"], "micro_batches": opts["micro_batches"],
                        "rows_per_rank": opts["micro_batch_size"], "runs": runs}
    return out


def table(s: dict[str, Any]) -> str:
    x = s["exchange"]
    lines = [f"MoE on {s['world_size']} x {s['card']} (torch {s['torch']}), {s['dtype']}",
             f"dispatch + combine, {x['tokens_per_rank']} tokens/rank, hidden {x['hidden']}, {x['experts']} experts top-{x['top_k']}: "
             f"ours {x['ours_s'] * 1e3:.2f} ms, raw all_to_all_single x2 {x['raw_s'] * 1e3:.2f} ms, "
             f"ratio raw/ours {x['ratio_raw_over_ours']:.3f} (goal >= 0.95), {x['gbps_per_rank_ours']:.1f} GB/s per rank"]
    if "model" in s:
        m = s["model"]
        lines.append(f"model: {m['parameters'] / 1e9:.2f}B parameters, {m['active_parameters'] / 1e9:.2f}B active, seq {m['seq']}, "
                     f"{m['micro_batches']} micro-batches x {m['rows_per_rank']} rows per rank")
        for key, run in m["runs"].items():
            mfu = "" if run["mfu_active"] is None else f", MFU (active) {100 * run['mfu_active']:.1f}%"
            lines.append(f"  {key}: {run['step_s']:.3f} s/step, {run['tokens_per_s']:.0f} tokens/s{mfu}, peak {run['peak_gib']:.2f} GiB, "
                         f"experts via {run.get('expert_path')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank for the exchange")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model-steps", type=int, default=4, help="timed model steps per ep (0: skip the model)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="rows per rank per micro-batch")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and exchange (smoke test)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("world_size", "tokens", "hidden", "experts", "top_k", "repeats", "rounds", "micro_batches",
                 "micro_batch_size", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.experts % args.world_size or args.top_k > args.experts:
        parser.error(f"--experts {args.experts} must be a multiple of --world-size {args.world_size} and >= --top-k")
    model = dict(MODEL_TINY if args.tiny else MODEL_1B)
    if args.tiny:
        args.seq, args.tokens, args.hidden = min(args.seq, 64), min(args.tokens, 256), min(args.hidden, 64)
    model["moe_num_experts"] = max(model["moe_num_experts"], args.world_size)
    model["max_seq_len"] = max(model["max_seq_len"], args.seq)
    opts = {**vars(args), "model": model}
    reports = launch_ranks(_rank_main, args.world_size, opts, args.timeout)
    problems = failures(reports, args.world_size, args.timeout)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    summary = summarise(reports, opts)
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
