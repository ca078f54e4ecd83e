"""What ``hal train`` adds to its engine's step: the training loop against the engine and optimizer it builds.

For a CONFIG of one plan (any stages and grids; replicas: time a replica's plan on its own), three rates of the same
model, plan and precision, in one run:

  * engine — on every rank, ``hal train``'s own setup builds the engine and the optimizer; each step is the
    engine's forward + backward (``step_lazy``: no host read of the loss) on fixed tokens already on the device,
    then the optimizer's step (ZeRO-1's where the plan shards it): the baseline;
  * step — ``hal train``'s ``train_step`` on the same objects: the step's batch from the config's data (copied to
    the device), the learning-rate schedule, the loss read, clipping where the config clips, the optimizer;
  * hal train — ``hal train CONFIG`` itself in a subprocess (run first, on otherwise idle devices): its steady
    tokens/s as its summary reports it (the first step and the checkpoint at the end left out, as it leaves them).

engine and step alternate over ``--rounds`` rounds of ``--steps`` steps after ``--warmup``, each round between two
synchronisations of every rank; medians are reported, with each rate's ratio to the engine's and MFU where the
catalog has the devices' peaks. Against ``benchmarks/pipeline.py`` (its own engine on its own modules) this says
whether a gap is the training loop's or the engine's.

    python benchmarks/train_vs_engine.py CONFIG [--steps 8] [--rounds 3] [--warmup 2] [--json]

Measured on one H200 (docs/benchmarks.md): the 1.21B model as one compiled stage, ``hal train`` 1.00x its engine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _hal_train(config: str, steps: int, timeout: float) -> dict[str, Any]:
    """``hal train CONFIG`` for ``steps`` steps in a scratch run directory; its JSON summary."""
    with tempfile.TemporaryDirectory(prefix="train-vs-engine-") as run_dir:
        done = subprocess.run([sys.executable, "-m", "hal", "train", config, "--steps", str(steps), "--json",
                               "--run-dir", os.path.join(run_dir, "run")], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"train_vs_engine: hal train {config} failed (exit {done.returncode}): {tail}")
    return json.loads(done.stdout)


def _rank_main(rank: int, world: int, store: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank: ``hal train``'s setup builds its engine and optimizer; the engine's and ``train_step``'s seconds a
    step, alternated in rounds, each round between two synchronisations of every rank."""
    import torch.distributed as dist

    from hal.collectives import shutdown
    from hal.parallel.data.batches import global_batch
    from hal.parallel.loop.job_runner import prepare, rank_envs
    from hal.parallel.loop.trainer import setup, train_step

    steps, rounds, warmup = opts["steps"], opts["rounds"], opts["warmup"]
    job = prepare(opts["config"], steps=warmup + 2 * rounds * steps, run_dir=opts["run_dir"])
    os.environ.update(rank_envs(job, opts["port"])[rank])  # the torchrun variables hal train gives this rank
    r = setup(job)
    try:
        plan, train, backend = r.replicas.plan, job.train, r.engine.backend
        tokens = global_batch(train.data, train.seed, 0, plan.micro_batches, plan.micro_batch_size, r.seq,
                              job.model.vocab_size, validation=train.validation).to(r.engine.device)
        update = r.optimizer.reduce_scatter_and_step if r.engine.dp_grads == "optimizer" else r.optimizer.step  # ZeRO-1's
        done = [0]

        def engine() -> None:
            r.optimizer.zero_grad(set_to_none=True)
            r.engine.step_lazy(tokens)
            update()

        def step() -> None:
            train_step(r, done[0])
            done[0] += 1

        def sync() -> None:
            backend.synchronize()
            dist.barrier()

        for fn in (engine, step):
            for _ in range(warmup):
                fn()
        times: dict[str, list[float]] = {"engine": [], "step": []}
        for _ in range(rounds):
            for name, fn in (("engine", engine), ("step", step)):
                sync()
                began = time.perf_counter()
                for _ in range(steps):
                    fn()
                sync()
                times[name].append((time.perf_counter() - began) / steps)
        device = r.engine.device
        return {"seconds": times, "tokens": plan.global_batch_size * r.seq, "peak_tflops": r.peak_tflops,
                "card": backend.device_name(device.index or 0) if device.type != "cpu" else "cpu"}
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a hal train config of one plan (parallel.stages)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="engine/step alternations; medians reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (compiles, allocator)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds hal train's subprocess, and then the ranks, may take")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    for name in ("steps", "rounds", "warmup"):
        if getattr(a, name) < 1:
            parser.error(f"--{name} must be at least 1 (got {getattr(a, name)})")

    from hal.errors import HalError
    from hal.parallel.config.flops import flops_per_token
    from hal.parallel.loop.job_runner import prepare

    try:
        with tempfile.TemporaryDirectory(prefix="train-vs-engine-") as run_dir:
            job = prepare(a.config, steps=1, run_dir=os.path.join(run_dir, "run"))
    except HalError as exc:
        parser.exit(2, f"train_vs_engine: {exc}\n")
    if job.replicas.several:
        parser.exit(2, f"train_vs_engine: {a.config} trains parallel.replicas; this benchmark takes one plan (time a "
                       "replica's plan on its own)\n")

    from benchmarks.spawn import failures, launch_ranks
    from hal.parallel.loop.job_runner import free_port

    summary = _hal_train(a.config, a.warmup + a.rounds * a.steps, a.timeout)
    with tempfile.TemporaryDirectory(prefix="train-vs-engine-") as run_dir:
        opts = {"config": a.config, "steps": a.steps, "rounds": a.rounds, "warmup": a.warmup, "port": free_port(),
                "run_dir": os.path.join(run_dir, "run")}
        backends = {t.backend_of(r) for t in job.topologies() for r in t.ranks}
        reports = launch_ranks(_rank_main, job.world_size, opts, a.timeout, backends.pop() if len(backends) == 1 else None)
    failed = failures(reports, job.world_size, a.timeout)
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    inside = reports[0]  # every round is timed between two synchronisations of all ranks: rank 0's clock is the step's
    inside["card"] = ", ".join(sorted({rep["card"] for rep in reports.values()}))
    peaks = [rep["peak_tflops"] for rep in reports.values()]
    inside["peak_tflops"] = sum(peaks) if all(p == p and p for p in peaks) else float("nan")
    inside["model"], inside["seq"] = job.model, job.train.seq_len or job.model.max_seq_len
    rates = {name: inside["tokens"] / statistics.median(s) for name, s in inside["seconds"].items()}
    rates["hal_train"] = summary["tokens_per_s"]
    per_token = flops_per_token(inside["model"], inside["seq"])
    peak = inside["peak_tflops"]
    result = {"config": a.config, "card": inside["card"], "tokens_per_step": inside["tokens"],
              "tokens_per_s": rates, "vs_engine": {k: v / rates["engine"] for k, v in rates.items()},
              "mfu": {k: v * per_token / (peak * 1e12) for k, v in rates.items()} if peak == peak and peak else None,
              "step_s": inside["seconds"], "hal_train_first_step_s": summary.get("first_step_s")}
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{a.config} on {result['card']}: {inside['tokens']} tokens a step; medians of {a.rounds} rounds of {a.steps} steps")
    for name in ("engine", "step", "hal_train"):
        mfu = f"  MFU {100 * result['mfu'][name]:.1f} %" if result["mfu"] else ""
        print(f"  {name:10} {rates[name]:12.0f} tok/s  {result['vs_engine'][name]:.3f}x the engine{mfu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
