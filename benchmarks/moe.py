"""Expert parallelism: the dispatch + combine against raw all-to-alls of the same bytes, and an MoE model's
throughput at ep = world against ep = 1. Both measured in the same run, on the same ranks, card named.

1. **Dispatch + combine** (``parallel.models.moe.dispatch`` / ``combine``): every rank routes T tokens (hidden H,
   top-k of E experts, drawn from a softmax router over random logits, so the splits are uneven) to the
   ranks holding their experts and back — counts exchange, one host read, one uneven all-to-all per local
   expert each way (rows land grouped by expert: no regrouping copies). The baseline is one
   ``torch.distributed.all_to_all_single`` each way with the same per-rank splits (what moving those bytes
   costs with nothing around it); beside them the design dispatch replaced (one all-to-all each way and a
   regrouping gather on the receiving side) and the count exchange alone (its fixed cost). Each variant runs
   ``--repeats`` times back to back between two synchronisations (what a step sees: raw all-to-alls queue
   behind each other, ours waits once a call for its counts); rounds interleave the variants and the median
   round is kept. Reported: the ratio raw / ours (goal >= 0.95: the bookkeeping costs under 5 %) and GB/s
   per rank (rows sent and received, both directions), for each ``--tokens`` size. On CUDA GPUs of one host
   the symmetric-memory exchange (``hal.collectives.symmetric_exchange``) is timed too, at every size, with
   which path an MoE block would take there and how many of its exchanges had to copy out of staging.
2. **An MoE model** (one stage, dp = world; default 8 experts top-2, about 1.2B total parameters, 0.35B
   active): forward + backward steps through hal's engine at ep = world (each rank holds E / world
   experts, tokens cross ranks) and at ep = 1 (every rank holds every expert; no all-to-all). Reported:
   tokens/s and MFU on the active parameters (``parallel.config.flops``), peak memory per rank.

    python benchmarks/moe.py [--backend cuda] [--world-size 4] [--tokens 8192] [--hidden 2048] [--experts 8]
        [--top-k 2] [--model-steps 4] [--seq 2048] [--micro-batch-size 1] [--compile] [--json]

``--world-size 1`` times the model alone (ep 1: nothing to exchange).

``--backend cpu --world-size 2 --tiny`` runs the same code on gloo in seconds (a smoke test, not a benchmark).
"""
from __future__ import annotations

import argparse
import importlib.util
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


def _back_to_back(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    """Seconds per call of ``fn`` run ``repeats`` times in a row, synchronised once before and once after: what a
    training step sees (calls queue behind each other; a call that reads the device waits for what is queued)."""
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def _routing(opts: dict[str, Any], tokens: int, rank: int, world: int, device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (T·k, H) in dispatch order and per-expert counts, from a softmax top-k of random logits."""
    from hal.parallel.models.moe import dispatch_key

    gen = torch.Generator().manual_seed(100 + rank)
    T, H, E, k = tokens, opts["hidden"], opts["experts"], opts["top_k"]
    logits = torch.randn(T, E, generator=gen) * 2.0
    experts = torch.topk(torch.softmax(logits, -1), k, dim=-1).indices.reshape(-1)
    order = torch.argsort(dispatch_key(experts, world, E // world), stable=True)
    rows = torch.randn(T, H, generator=gen).to(dtype)[order // k]
    return rows.to(device), torch.bincount(experts, minlength=E).to(device)


def _expert_of_rows(opts: dict[str, Any], tokens: int, rank: int, world: int, device: torch.device) -> torch.Tensor:
    """The global expert of each of ``_routing``'s rows (the same draw), for the symmetric exchange."""
    from hal.parallel.models.moe import dispatch_key

    gen = torch.Generator().manual_seed(100 + rank)
    logits = torch.randn(tokens, opts["experts"], generator=gen) * 2.0
    experts = torch.topk(torch.softmax(logits, -1), opts["top_k"], dim=-1).indices.reshape(-1)
    return experts[torch.argsort(dispatch_key(experts, world, opts["experts"] // world), stable=True)].to(device)


def _regrouped(rows: torch.Tensor, load: torch.Tensor, comm: Any, world: int, local: int) -> torch.Tensor:
    """The design ``dispatch`` replaced, timed beside it: rows sorted by global expert (rank-major), one all-to-all
    each way, and a gather on the receiving side to regroup by expert (and its inverse before the way back)."""
    sent = load.view(world, local).contiguous()
    sent_c, recv_c = torch.stack([sent, comm.all_to_all(sent)]).cpu().tolist()
    send, recv = [sum(r) for r in sent_c], [sum(r) for r in recv_c]
    arrived = comm.all_to_all(rows, input_splits=send, output_splits=recv)
    sizes = torch.tensor(recv_c, dtype=torch.long)  # (source, local expert) blocks as they arrived
    starts = (sizes.flatten().cumsum(0) - sizes.flatten()).view_as(sizes)
    lengths, firsts = sizes.t().flatten().to(rows.device), starts.t().flatten().to(rows.device)
    total = int(sizes.sum())
    perm = (torch.repeat_interleave(firsts, lengths, output_size=total) + torch.arange(total, device=rows.device)
            - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths, output_size=total))
    by_expert = arrived.index_select(0, perm)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(total, device=perm.device)
    return comm.all_to_all(by_expert.index_select(0, inverse), input_splits=recv, output_splits=send)


def _exchange(rank: int, world: int, opts: dict[str, Any], tokens: int, comm: Any, group: Any, device: torch.device,
              sync: Callable[[], None]) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.parallel.models.moe import CountExchange, combine, dispatch

    dtype = getattr(torch, opts["dtype"])
    rows, load = _routing(opts, tokens, rank, world, device, dtype)
    rank_major, _ = _routing(opts, tokens, rank, 1, device, dtype)  # sorted by global expert, for _regrouped
    local = opts["experts"] // world

    def ours() -> torch.Tensor:
        arrived, route = dispatch(rows, load, comm, local)
        return combine(arrived, route)  # identity experts: the exchange alone

    from hal.collectives.symmetric_exchange import agree, choose, exchange_for

    picked, why = choose(comm, rows.shape[0], rows.shape[1], rows.dtype)  # what an MoE block would take here
    expert_of_row = _expert_of_rows(opts, tokens, rank, world, device)
    symmetric: Callable[[], torch.Tensor] | None = None
    if agree(comm, rows.shape[0]).problem is None:  # timed at every size, also above the size the block would take it to
        ex = exchange_for(comm, rows.shape[0], rows.shape[1], rows.dtype, opts["experts"])

        def symmetric() -> torch.Tensor:
            arrived, droute = ex.dispatch(rows, expert_of_row, load)
            return ex.combine(arrived, droute)

    # the same splits for the baseline, computed once outside its timing
    arrived, route = dispatch(rows, load, comm, local)
    send, recv = route.send_splits, route.recv_splits
    back = torch.empty_like(rows)
    there = torch.empty((sum(recv), rows.shape[1]), dtype=dtype, device=device)

    def raw() -> None:
        dist.all_to_all_single(there, rows, recv, send, group=group)
        dist.all_to_all_single(back, there, send, recv, group=group)

    def counts() -> None:  # the fixed part of ours: the count all-gather and its host read
        CountExchange(load, comm, local).blocks()

    def regrouped() -> torch.Tensor:
        return _regrouped(rank_major, load, comm, world, local)

    assert torch.equal(ours(), rows), "dispatch + combine must give every row back unchanged"
    assert torch.equal(regrouped(), rank_major), "the regrouping exchange must give every row back unchanged"
    fns = {"ours": ours, "raw": raw, "counts": counts, "regrouped": regrouped}
    if symmetric is not None:
        assert torch.equal(symmetric(), rows), "the symmetric exchange must give every row back unchanged"
        fns["symmetric"] = symmetric
    for fn in fns.values():  # warm-up
        _timed(fn, sync, opts["warmup"])
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(opts["rounds"]):  # the rounds interleave the variants; each is the median round
        for name, fn in fns.items():
            times[name].append(_back_to_back(fn, sync, opts["repeats"]))
    moved = (sum(send) + sum(recv)) * rows.shape[1] * rows.element_size() * 2  # both directions, there and back
    return {"tokens": tokens, "ours_s": statistics.median(times["ours"]), "raw_s": statistics.median(times["raw"]),
            "counts_s": statistics.median(times["counts"]), "regrouped_s": statistics.median(times["regrouped"]),
            "symmetric_s": statistics.median(times["symmetric"]) if symmetric is not None else None,
            "symmetric_slots": {"durable": len(ex.durable_rows), "exchanges": ex.calls, "copied": ex.copied}
            if symmetric is not None else None,
            "picked": picked, "picked_why": why, "bytes": moved, "send_rows": send, "recv_rows": recv}


def _model(rank: int, world: int, opts: dict[str, Any], ep: int, device: torch.device, backend: Any,
           sync: Callable[[], None]) -> dict[str, Any]:
    from hal.collectives import current_world
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import ParallelPlan, StagePlan, validate_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    model = ModelConfig(**opts["model"])
    mbs = opts["micro_batch_size"] * world
    plan = ParallelPlan((StagePlan(backend.name, world, model.num_layers, dp=world, ep=ep),), "1f1b",
                        opts["micro_batches"], mbs, compile=opts["compile"])
    validate_plan(plan, model, world_size=world, check_backends=False, seq_len=opts["seq"])
    topology = Topology.from_plan(plan)
    groups = build_mesh(topology, current_world(), validate=False)
    dtype = getattr(torch, opts["dtype"])
    engine = build_engine(model, plan, groups, backend=backend, seed=0, device=device, dtype=dtype,
                            seq_len=opts["seq"])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab_size, (opts["micro_batches"], mbs, opts["seq"] + 1), generator=gen).to(device)

    def step() -> None:
        engine.module.zero_grad(set_to_none=True)
        engine.step_lazy(tokens)

    from hal.collectives.symmetric_exchange import tally

    _timed(step, sync, opts["warmup"])
    if device.type != "cpu":
        backend.reset_peak_memory_stats()
    before = tally()
    times = _timed(step, sync, opts["model_steps"])
    after = tally()
    peak = backend.max_memory_allocated() if device.type != "cpu" else 0
    engine.module.take_moe_tally()
    paths = sorted({str(block.path) for block in engine.module.moe_blocks().values()})  # grouped_mm or loop
    exchanges = sorted({str(block.exchange) for block in engine.module.moe_blocks().values()})  # ep > 1: the path taken
    engine = None  # free the model before the next configuration builds its own
    return {"step_s": statistics.median(times), "tokens": opts["micro_batches"] * mbs * opts["seq"], "peak_bytes": peak,
            "expert_path": "+".join(paths), "exchange": "+".join(exchanges),
            "symmetric_exchanges": after["exchanges"] - before["exchanges"], "symmetric_copied": after["copied"] - before["copied"],
            "symmetric_pool_gib": after["pool_bytes"] / 2**30}


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
        if importlib.util.find_spec("triton") is not None:  # how the exchange's kernels launch here, or why not cached
            from hal.kernels.triton import moe_exchange

            why = moe_exchange.launch_problem()
            report["triton_launch"] = "cached" if why is None else f"Triton's own ({why})"
        # one rank has nothing to exchange: the model alone (ep 1)
        report["exchange"] = [_exchange(rank, world, opts, tokens, comm, group, device, sync) for tokens in opts["tokens"]] if world > 1 else []
        if opts["model_steps"]:
            report["model"] = {f"ep{world}": _model(rank, world, opts, world, device, backend, sync)} if world > 1 else {}
            if world > 1 and report["model"][f"ep{world}"]["exchange"] == "symmetric":  # and the same through the all-to-alls
                import os

                from hal.collectives.symmetric_exchange import ENV

                os.environ[ENV] = "all_to_all"
                report["model"][f"ep{world}-all_to_all"] = _model(rank, world, opts, world, device, backend, sync)
                del os.environ[ENV]
            report["model"]["ep1"] = _model(rank, world, opts, 1, device, backend, sync)
        if rank == 0 and device.type != "cpu":
            report["peak_bf16_tflops"] = backend.capabilities(device.index or 0).peak_tflops.get("bf16")
        sync()
        return report
    finally:
        shutdown()


def summarise(reports: dict[int, dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    from hal.parallel.config.flops import flops_per_token, model_parameters
    from hal.parallel.config.model import ModelConfig

    world = len(reports)
    r0 = reports[0]
    exchanges = []
    for i, tokens in enumerate(opts["tokens"] if world > 1 else []):
        ours = max(r["exchange"][i]["ours_s"] for r in reports.values())
        raw = max(r["exchange"][i]["raw_s"] for r in reports.values())
        sym = [r["exchange"][i]["symmetric_s"] for r in reports.values()]
        sym_s = max(sym) if all(t is not None for t in sym) else None
        picked = r0["exchange"][i]["picked"]
        block_s = sym_s if picked == "symmetric" and sym_s is not None else ours
        exchanges.append({"tokens_per_rank": tokens, "hidden": opts["hidden"], "experts": opts["experts"],
                          "top_k": opts["top_k"], "ours_s": ours, "raw_s": raw, "ratio_raw_over_ours": raw / ours,
                          "symmetric_s": sym_s, "ratio_raw_over_symmetric": raw / sym_s if sym_s else None,
                          "symmetric_slots": r0["exchange"][i].get("symmetric_slots"),
                          "block_picks": picked, "block_picks_why": r0["exchange"][i]["picked_why"],
                          "ratio_raw_over_block": raw / block_s,
                          "counts_s": max(r["exchange"][i]["counts_s"] for r in reports.values()),
                          "regrouped_s": max(r["exchange"][i]["regrouped_s"] for r in reports.values()),
                          "gbps_per_rank_ours": statistics.mean(r["exchange"][i]["bytes"] for r in reports.values()) / ours / 1e9,
                          "recv_rows_rank0": r0["exchange"][i]["recv_rows"]})
    out: dict[str, Any] = {"card": r0["device"], "torch": torch.__version__, "world_size": world, "dtype": opts["dtype"],
                           "compile": opts.get("compile", False),
                           "triton_launch": r0.get("triton_launch"),
                           "exchange": exchanges}
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
                         "expert_path": r0["model"][key].get("expert_path"), "exchange": r0["model"][key].get("exchange"),
                         "symmetric_exchanges": r0["model"][key].get("symmetric_exchanges"),
                         "symmetric_copied": r0["model"][key].get("symmetric_copied"),
                         "symmetric_pool_gib": r0["model"][key].get("symmetric_pool_gib")}
        out["model"] = {"parameters": model_parameters(model), "active_parameters": model_parameters(model, active=True),
                        "seq": opts["seq"], "micro_batches": opts["micro_batches"],
                        "rows_per_rank": opts["micro_batch_size"], "runs": runs}
    return out


def table(s: dict[str, Any]) -> str:
    lines = [f"MoE on {s['world_size']} x {s['card']} (torch {s['torch']}), {s['dtype']}, "
             f"{'compiled' if s.get('compile') else 'eager'}, Triton launches: {s.get('triton_launch')}"]
    for x in s["exchange"]:
        lines.append(f"dispatch + combine, {x['tokens_per_rank']} tokens/rank, hidden {x['hidden']}, {x['experts']} experts "
                     f"top-{x['top_k']}: ours {x['ours_s'] * 1e3:.3f} ms (counts + host read alone {x['counts_s'] * 1e3:.3f} ms), "
                     f"raw all_to_all_single x2 {x['raw_s'] * 1e3:.3f} ms, one all-to-all + regrouping gathers "
                     f"{x['regrouped_s'] * 1e3:.3f} ms, ratio raw/ours {x['ratio_raw_over_ours']:.3f} "
                     f"(goal >= 0.95), {x['gbps_per_rank_ours']:.1f} GB/s per rank")
        if x["symmetric_s"] is not None:
            slots = x["symmetric_slots"]
            lines.append(f"  symmetric memory (no host read) {x['symmetric_s'] * 1e3:.3f} ms, ratio raw/symmetric "
                         f"{x['ratio_raw_over_symmetric']:.3f}; {slots['durable']} durable slots, {slots['copied']} forward "
                         f"exchanges landed in staging and copied out (of {slots['exchanges']} exchanges run)")
        lines.append(f"  an MoE block takes {x['block_picks']} here ({x['block_picks_why']}): ratio raw/block "
                     f"{x['ratio_raw_over_block']:.3f} (goal >= 0.95)")
    if "model" in s:
        m = s["model"]
        lines.append(f"model: {m['parameters'] / 1e9:.2f}B parameters, {m['active_parameters'] / 1e9:.2f}B active, seq {m['seq']}, "
                     f"{m['micro_batches']} micro-batches x {m['rows_per_rank']} rows per rank")
        for key, run in m["runs"].items():
            mfu = "" if run["mfu_active"] is None else f", MFU (active) {100 * run['mfu_active']:.1f}%"
            lines.append(f"  {key}: {run['step_s']:.3f} s/step, {run['tokens_per_s']:.0f} tokens/s{mfu}, peak {run['peak_gib']:.2f} GiB, "
                         f"experts via {run.get('expert_path')}, exchange {run.get('exchange')}")
            if run.get("exchange") == "symmetric":
                lines.append(f"    symmetric: {run['symmetric_copied']} of {run['symmetric_exchanges']} timed exchanges' forward "
                             f"halves copied out of staging; durable slots {run['symmetric_pool_gib']:.2f} GiB a rank")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tokens", default="8192", help="tokens per rank for the exchange (a comma list: one exchange each)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=20, help="exchanges run back to back in a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model-steps", type=int, default=4, help="timed model steps per ep (0: skip the model)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="rows per rank per micro-batch")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--compile", action="store_true", help="compile the decoder layers (the plan's compile: true)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and exchange (smoke test)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.tokens = [int(t) for t in str(args.tokens).split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: give whole numbers separated by commas, e.g. 8192,32768")
    if min(args.tokens) < 1:
        parser.error("--tokens must be at least 1")
    for name in ("world_size", "hidden", "experts", "top_k", "repeats", "rounds", "micro_batches",
                 "micro_batch_size", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.experts % args.world_size or args.top_k > args.experts:
        parser.error(f"--experts {args.experts} must be a multiple of --world-size {args.world_size} and >= --top-k")
    model = dict(MODEL_TINY if args.tiny else MODEL_1B)
    if args.tiny:
        args.seq, args.tokens, args.hidden = min(args.seq, 64), [min(t, 256) for t in args.tokens], min(args.hidden, 64)
    model["moe_num_experts"] = max(model["moe_num_experts"], args.world_size)
    model["max_seq_len"] = max(model["max_seq_len"], args.seq)
    opts = {**vars(args), "model": model}
    reports = launch_ranks(_rank_main, args.world_size, opts, args.timeout, opts["backend"])
    problems = failures(reports, args.world_size, args.timeout)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    summary = summarise(reports, opts)
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
