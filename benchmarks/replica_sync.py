"""The replicas' cross-island gradient sync against one bridge stream carrying the same bytes.

Two replicas, each a dp-N plan of one stage on its own island (``--ranks-per-replica N``: GPUs 0..N-1 and N..2N-1
on a GPU machine, or 2N cpu ranks with ``--cpu-only``), hold the same model; every rank times
``ReplicaExchange.sync_grads`` — gathering, summing across the bridge, handing back — in two settings of one run:

* ``single``: one bucket for the whole model (one pair of speakers) over one host channel
  (``HAL_BRIDGE_CHANNELS=1``): the bytes ride one bridge stream;
* ``striped``: the exchange as it ships: ``BUCKET_BYTES`` buckets (32 MiB) whose speakers take turns over the
  replica's ranks (N pairs at once), each pair's sum striped by the bridge over ``--channels`` host channels.

The ratio ``striped / single`` is the throughput gain on the same bytes (the model's fp32 gradients). ``--wires
bf16,fp8`` adds the shipped exchange with its cross-island part compressed (``replica_sync.compress``): the same
gradients, fewer bytes on the bridge (fp8: with error feedback), timed beside the others.

    python benchmarks/replica_sync.py [--ranks-per-replica 2] [--hidden 2048] [--layers 8] [--iters 5]
                                      [--channels 4] [--wires bf16,fp8] [--cpu-only] [--json] [--timeout 600]
"""
from __future__ import annotations

import argparse
import dataclasses
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


def _rank_body(rank: int, world_size: int, store: str, opts: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1 if opts["cpu_only"] else 2)
    from hal.collectives import Communicator, init_distributed, shutdown
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.config.plan import ParallelPlan, StagePlan
    from hal.parallel.config.replicas import Replica
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_meshes
    from hal.parallel.replicas.sync import BUCKET_BYTES, ReplicaExchange

    n = opts["ranks_per_replica"]
    os.environ["HAL_BRIDGE_CHANNELS"] = str(opts["channels"])
    if opts["cpu_only"]:
        os.environ["HAL_BRIDGE_STAGE"] = "always"  # the staging path even without a device
    backend = "cpu" if opts["cpu_only"] else "cuda"
    islands = [r // n for r in range(world_size)]
    world = init_distributed(backend, init_method=f"file://{store}", rank=rank, world_size=world_size, islands=islands)
    try:
        h = opts["hidden"]
        model = ModelConfig(vocab_size=4096, hidden_size=h, num_layers=opts["layers"], num_heads=max(1, h // 128),
                            num_kv_heads=max(1, h // 512), ffn_hidden_size=4 * h, max_seq_len=16)
        plan = ParallelPlan((StagePlan(backend, n, model.num_layers, dp=n),), "1f1b", 1, n)
        replicas = [Replica(plan, n, 0), Replica(plan, n, n)]
        topologies = [r.topology() for r in replicas]
        mesh = build_meshes(topologies, world, validate=False)
        engine = build_engine(model, plan, mesh, backend=world.backend, seed=0, device=world.device, seq_len=16)
        for p in engine.module.parameters():
            p.grad = torch.randn_like(p)
        params = sum(p.numel() for p in engine.module.parameters())
        times: dict[str, list[float]] = {}
        big = 1 << 62
        settings = [("single", big, 1, "none"), ("striped", BUCKET_BYTES, opts["channels"], "none")]
        settings += [(f"striped_{wire}", BUCKET_BYTES, opts["channels"], wire) for wire in opts["wires"]]
        for name, bucket_bytes, channels, wire in settings:
            exchange = ReplicaExchange(mesh, engine.module, rank // n, topologies, world, bucket_bytes=bucket_bytes,
                                       compress=wire)
            if channels == 1:  # the world opened --channels host channels: this setting keeps the first only
                exchange.groups = {k: None if c is None else
                                   Communicator(dataclasses.replace(c.layout, extra_channels=()), c.world, validate=False)
                                   for k, c in exchange.groups.items()}
            pairs = len({b.speakers for b in exchange.buckets})
            runs = []
            for i in range(opts["iters"] + 1):
                world.backend.synchronize()
                torch.distributed.barrier()
                began = time.perf_counter()
                exchange.sync_grads(0.5)
                world.backend.synchronize()
                elapsed = time.perf_counter() - began
                if i:
                    runs.append(elapsed)
            times[name] = runs
            times[f"{name}_pairs"] = [float(pairs)]
        report = {"params": params, "bytes": params * 4, "times": times, "device": str(world.device)}
        if rank == 0 and not opts["cpu_only"]:
            report["device_name"] = world.backend.device_name(world.device.index or 0)
        return report
    finally:
        shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-replica", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--wires", default="", help="compressed wires timed too, comma-separated (bf16, fp8)")
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    wires = [w for w in args.wires.split(",") if w]
    if any(w not in ("bf16", "fp8") for w in wires):
        parser.error(f"--wires {args.wires}: give bf16 and/or fp8, comma-separated")
    opts = {"ranks_per_replica": args.ranks_per_replica, "hidden": args.hidden, "layers": args.layers,
            "iters": args.iters, "channels": args.channels, "cpu_only": args.cpu_only, "wires": wires}
    world = 2 * args.ranks_per_replica
    reports = launch_ranks(_rank_body, world, opts, args.timeout, "cpu" if opts["cpu_only"] else None)
    problems = failures(reports, world, args.timeout)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    first = reports[0]
    # a step's sync ends when its slowest rank is done: per iteration, the max over ranks; then the median
    result: dict[str, Any] = {"bytes": first["bytes"], "device": first.get("device_name", "cpu"), "ranks": world,
                              "channels": args.channels}
    names = ["single", "striped", *(f"striped_{w}" for w in wires)]
    for name in names:
        per_iter = [max(reports[r]["times"][name][i] for r in range(world)) for i in range(args.iters)]
        median = statistics.median(per_iter)
        result[name] = {"median_s": median, "gb_per_s": first["bytes"] / median / 1e9,
                        "pairs": int(first["times"][f"{name}_pairs"][0])}
    result["striped_over_single"] = result["single"]["median_s"] / result["striped"]["median_s"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"replica sync, {result['bytes'] / 2**20:.0f} MiB of fp32 gradients, 2 replicas × {args.ranks_per_replica} "
              f"ranks ({result['device']})")
        for name in names:
            r = result[name]
            print(f"  {name:13s} {r['pairs']} pair(s)  {r['median_s'] * 1e3:8.1f} ms  {r['gb_per_s']:6.2f} GB/s")
        print(f"  striped / single: {result['striped_over_single']:.2f}×")
        for w in wires:
            print(f"  striped {w} / striped fp32: {result['striped']['median_s'] / result[f'striped_{w}']['median_s']:.2f}× "
                  "(the same gradients: GB/s counts fp32 bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
