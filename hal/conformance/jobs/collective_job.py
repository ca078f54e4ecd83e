"""The collectives job on one rank: run every check, then ``hal bench collectives``' measurement loop.

Started by ``conformance.jobs.worker.run_rank`` (job ``collectives``) on every rank of one world size. Each rank
regenerates every rank's inputs from the seed, so it can compute the exact or float64 reference
locally and judge its own result (``conformance.suites.collective_checks``); the parent merges the ranks'
verdicts. A check that raises becomes an ``error`` verdict and the others still run.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

import torch

from hal.conformance.suites.collective_checks import (
    NUMEL,
    PIECE,
    REPEATS,
    SWEEP_BLOCK,
    Check,
    RankVerdict,
    bits_of,
    bitwise,
    classify,
    describe,
    inputs,
    make_verdict,
    probe_inputs,
    reduce_exact,
    reduction_tolerance,
    summation_bound,
    within,
)

if TYPE_CHECKING:
    from hal.collectives import Communicator, World


# --- the checks, run on one rank ---------------------------------------------------------------------------


def skewed_splits(n: int) -> list[list[int]]:
    """Rows rank r sends to each rank j: none to rank 0, most to the last, a little in between (an MoE dispatch
    whose router prefers the last rank's experts and never picks rank 0's); rank 0 also sends rows."""
    return [[0 if j == 0 else (PIECE + 3 * r if j == n - 1 else 1 + (r + j) % 2) for j in range(n)] for r in range(n)]


class _RankChecks:
    """Runs checks on one rank; every rank runs the same calls in the same order."""

    def __init__(self, comm: Communicator, world_size: int, rank: int, seed: int, on_accelerator: bool) -> None:
        self.comm, self.n, self.rank, self.seed = comm, world_size, rank, seed
        self.dev = comm.device
        self.big = on_accelerator

    def everyone(self, check: Check, shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [inputs(check, r, shape, self.n, self.seed) for r in range(self.n)]

    def judge_reduction(self, check: Check, got: torch.Tensor, exact: torch.Tensor) -> RankVerdict:
        assert check.reduce_op is not None
        if (check.inputs == "int" and check.reduce_op != "avg") or check.reduce_op in ("max", "min"):
            return bitwise(got, exact)  # order-invariant: exact whatever the CCL's reduction order
        return within(got, exact, reduction_tolerance(check.torch_dtype, self.n, check.reduce_op))

    def run(self, check: Check) -> RankVerdict | None:
        handler: Callable[[Check], RankVerdict | None] = getattr(self, f"_{check.op}")
        return handler(check)

    # reductions ------------------------------------------------------------------------------------------
    def _all_reduce(self, c: Check) -> RankVerdict:
        xs = self.everyone(c, (NUMEL,))
        got = self.comm.all_reduce(xs[self.rank].to(self.dev, copy=True), c.reduce_op)
        return self.judge_reduction(c, got, reduce_exact(xs, c.reduce_op or "sum"))

    def _reduce_scatter(self, c: Check) -> RankVerdict:
        xs = self.everyone(c, (self.n * PIECE,))
        got = self.comm.reduce_scatter(xs[self.rank].to(self.dev, copy=True), c.reduce_op or "sum")
        exact = reduce_exact(xs, c.reduce_op or "sum")[self.rank * PIECE:(self.rank + 1) * PIECE]
        return self.judge_reduction(c, got, exact)

    def _reduce(self, c: Check) -> RankVerdict | None:
        xs = self.everyone(c, (NUMEL,))
        dst = self.n - 1  # a non-zero root catches root-handling bugs
        got = self.comm.reduce(xs[self.rank].to(self.dev, copy=True), dst=dst, op=c.reduce_op or "sum")
        return self.judge_reduction(c, got, reduce_exact(xs, c.reduce_op or "sum")) if self.rank == dst else None

    # data movement -------------------------------------------------------------------------------------------
    def _all_gather(self, c: Check) -> RankVerdict:
        xs = self.everyone(c, (PIECE,))
        return bitwise(self.comm.all_gather(xs[self.rank].to(self.dev, copy=True)), torch.cat(xs))

    def _all_gather_uneven(self, c: Check) -> RankVerdict:
        xs = [inputs(c, r, (PIECE + 3 * r, 2), self.n, self.seed) for r in range(self.n)]
        return bitwise(self.comm.all_gather(xs[self.rank].to(self.dev, copy=True)), torch.cat(xs))

    def _all_to_all(self, c: Check) -> RankVerdict:
        xs = self.everyone(c, (self.n * PIECE,))
        got = self.comm.all_to_all(xs[self.rank].to(self.dev, copy=True))
        return bitwise(got, torch.cat([x[self.rank * PIECE:(self.rank + 1) * PIECE] for x in xs]))

    def _all_to_all_uneven(self, c: Check) -> RankVerdict:
        splits = [[1 + (r + 2 * j) % 3 for j in range(self.n)] for r in range(self.n)]
        xs = [inputs(c, r, (sum(splits[r]),), self.n, self.seed) for r in range(self.n)]
        got = self.comm.all_to_all(xs[self.rank].to(self.dev, copy=True), input_splits=splits[self.rank])
        return bitwise(got, torch.cat([x.split(s)[self.rank] for x, s in zip(xs, splits)]))

    def _all_to_all_skewed(self, c: Check) -> RankVerdict:
        splits = skewed_splits(self.n)
        xs = [inputs(c, r, (sum(splits[r]), 2), self.n, self.seed) for r in range(self.n)]
        got = self.comm.all_to_all(xs[self.rank].to(self.dev, copy=True), input_splits=splits[self.rank])
        want = torch.cat([x.split(s)[self.rank] for x, s in zip(xs, splits)])
        return bitwise(got, want)

    def _broadcast(self, c: Check) -> RankVerdict:
        src = self.n - 1
        xs = self.everyone(c, (NUMEL,))
        mine = xs[src].to(self.dev, copy=True) if self.rank == src else torch.zeros(NUMEL, dtype=c.torch_dtype, device=self.dev)
        return bitwise(self.comm.broadcast(mine, src=src), xs[src])

    def _gather(self, c: Check) -> RankVerdict | None:
        dst = self.n - 1
        xs = self.everyone(c, (PIECE,))
        got = self.comm.gather(xs[self.rank].to(self.dev, copy=True), dst=dst)
        return bitwise(torch.cat(got), torch.cat(xs)) if self.rank == dst else None

    def _scatter(self, c: Check) -> RankVerdict:
        src = self.n - 1
        xs = self.everyone(c, (PIECE,))
        chunks = [x.to(self.dev, copy=True) for x in xs] if self.rank == src else None
        out = torch.zeros(PIECE, dtype=c.torch_dtype, device=self.dev)
        return bitwise(self.comm.scatter(out, chunks, src=src), xs[self.rank])

    def _send_recv(self, c: Check) -> RankVerdict | None:
        src, dst = 0, self.n - 1
        xs = self.everyone(c, (NUMEL,))
        if self.rank == src:
            self.comm.send(xs[src].to(self.dev, copy=True), dst=dst)
        elif self.rank == dst:
            buf = torch.zeros(NUMEL, dtype=c.torch_dtype, device=self.dev)
            self.comm.recv(buf, src=src)
            return bitwise(buf, xs[src])
        return None

    def _batch_p2p_ring(self, c: Check) -> RankVerdict:
        from hal.collectives import P2P

        right, left = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        xs = self.everyone(c, (NUMEL,))
        buf = torch.zeros(NUMEL, dtype=c.torch_dtype, device=self.dev)
        self.comm.batch_p2p([P2P("send", xs[self.rank].to(self.dev, copy=True), right), P2P("recv", buf, left)])
        return bitwise(buf, xs[left])

    # probes ------------------------------------------------------------------------------------------------------
    def _determinism(self, c: Check) -> RankVerdict:
        numel = (4 << 20) if self.big else 16384
        xs = self.everyone(c, (numel,))
        mine = xs[self.rank].to(self.dev, copy=True)
        results = [self.comm.all_reduce(mine.clone(), "sum").cpu() for _ in range(REPEATS)]
        differing = sum(int((bits_of(r) != bits_of(results[0])).sum()) for r in results[1:])
        verdict = within(results[0], reduce_exact(xs, "sum"), reduction_tolerance(c.torch_dtype, self.n, "sum"))
        verdict["metrics"].update(nondeterministic_elements=float(differing), repeats=float(REPEATS), elements=float(numel))
        verdict["tolerance"]["nondeterministic_elements"] = 0.0
        if differing:
            return make_verdict("fail", verdict["metrics"], verdict["tolerance"], "nondeterministic_elements",
                            f"{differing} element(s) changed between {REPEATS} identical all_reduce calls of {numel} elements")
        return verdict

    def _reduction_probe(self, c: Check) -> RankVerdict:
        """How the library sums (``collective_checks.classify``): fails only when the result is farther from the exact
        sum than any order of rounded additions could put it (``summation_bound``); the reason states which model
        of the sum it matches bitwise, if any."""
        xs = [probe_inputs(c, r, self.n, self.seed) for r in range(self.n)]
        got = self.comm.all_reduce(xs[self.rank].to(self.dev, copy=True), "sum").cpu()
        models, shares = classify(got, xs)
        exact = reduce_exact(xs, "sum")
        ratio = float(((got.double() - exact).abs() / summation_bound(xs).clamp_min(1e-300)).max())
        metrics = {"bound_ratio": ratio, **{f"matches_{name}": share for name, share in shares.items()}}
        data = {"models": models, "shares": shares}
        if not ratio <= 1.0:
            return make_verdict("fail", metrics, {"bound_ratio": 1.0}, "bound_ratio",
                                f"{c.dtype} all_reduce sum is {ratio:.3g}x farther from the exact sum than rounded "
                                "additions in any order can be", data)
        return make_verdict("pass", metrics, {"bound_ratio": 1.0}, None,
                            f"{c.dtype} all_reduce sum over {self.n} ranks: {describe(models, shares)}", data)

    def sweep_sizes(self) -> list[int]:
        if self.big:
            return [SWEEP_BLOCK, 1 << 16, 1 << 20, 1 << 24, 1 << 26]  # up to 64 Mi elements (256 MiB fp32)
        return [SWEEP_BLOCK, 1 << 14, 1 << 18]

    def _size_sweep(self, c: Check) -> RankVerdict:
        blocks = self.everyone(c, (SWEEP_BLOCK,))
        exact = reduce_exact(blocks, "sum")
        tol = reduction_tolerance(c.torch_dtype, self.n, "sum")
        sizes, ratios, firsts, worst = self.sweep_sizes(), [], [], None
        for size in sizes:
            message = torch.full((size,), 0.5 * (self.rank + 1), dtype=c.torch_dtype, device=self.dev)
            message[:SWEEP_BLOCK] = blocks[self.rank].to(self.dev, copy=True)
            got = self.comm.all_reduce(message, "sum")[:SWEEP_BLOCK].cpu()
            del message
            v = within(got, exact, tol, f"at {size} elements: ")
            ratios.append(v["metrics"]["tol_ratio"])
            firsts.append(got)
            if v["status"] != "pass" and worst is None:
                worst = v
        same = all(bool((bits_of(f) == bits_of(firsts[0])).all()) for f in firsts[1:])
        spread = max(float((f.double() - firsts[0].double()).abs().max()) for f in firsts) if firsts else 0.0
        metrics = {"tol_ratio": max(ratios), "bitwise_equal_across_sizes": 1.0 if same else 0.0,
                   "max_abs_across_sizes": spread, "sizes": float(len(sizes))}
        data = {"sizes_elements": sizes, "tol_ratio": ratios}
        bounds = {**tol.to_dict(), "tol_ratio": 1.0}
        if worst is not None:
            return make_verdict("fail", {**worst["metrics"], **metrics}, bounds, worst["failed_metric"], worst["reason"], data)
        return make_verdict("pass", metrics, bounds, data=data)


# --- the job: every rank -------------------------------------------------------------------------------------


def make_communicator(factory: str | None, *, validate: bool) -> Communicator:
    """The communicator under test: ``collectives.world_communicator`` or the injected factory.

    A factory is ``"module:callable"``, called collectively on every rank as ``fn(validate=...)``
    and returning a ``collectives.Communicator`` (e.g. a subclass with a planted fault).
    """
    from hal.collectives import Communicator, world_communicator

    if not factory:
        return world_communicator(validate=validate)
    from hal.conformance.jobs.worker import resolve

    comm = resolve(factory, "communicator_factory")(validate=validate)
    if not isinstance(comm, Communicator):
        raise TypeError(f"communicator_factory {factory!r} returned {type(comm).__name__}, not a collectives.Communicator")
    return comm


def run_rank(world: World, spec: dict[str, Any]) -> dict[str, Any]:
    """The collectives job on one rank: every check, then the busbw sweep through collectives.bench."""
    checks = [Check(**c) for c in spec["checks"]]
    comm = make_communicator(spec.get("communicator_factory"), validate=True)
    runner = _RankChecks(comm, world.size, world.rank, int(spec.get("seed", 0)), world.device.type != "cpu")
    verdicts: dict[str, RankVerdict | None] = {}
    for check in checks:
        try:
            verdicts[check.name] = runner.run(check)
        except Exception as exc:  # one broken check must not hide the others
            first_line = (str(exc).splitlines() or [""])[0][:300]
            verdicts[check.name] = make_verdict("error", reason=f"{type(exc).__name__}: {first_line}")
    comm.barrier()
    bench: dict[str, Any] | None = None
    bench_error = None
    if spec.get("bench_sizes"):
        try:
            bench = _bench(world, spec, make_communicator(spec.get("communicator_factory"), validate=False))
        except Exception as exc:
            bench_error = f"{type(exc).__name__}: {exc}"
    return {"checks": verdicts, "bench": bench, "bench_error": bench_error}


def _bench(world: World, spec: dict[str, Any], comm: Communicator) -> dict[str, Any]:
    """``hal bench collectives``' own measurement loop (collectives.bench), on this job's world."""
    from hal.collectives import bench

    plan = bench.BenchPlan(
        backend=world.backend.name, world_size=world.size, sizes=tuple(spec["bench_sizes"]),
        dtypes=tuple(spec.get("bench_dtypes", ("float32",))), ops=tuple(spec.get("bench_ops", bench.OPS)),
        iters=int(spec.get("bench_iters", 2)), warmup=int(spec.get("bench_warmup", 1)), rounds=int(spec.get("bench_rounds", 1)),
    )
    # run_bench_rank is the per-rank body of `hal bench collectives` (timing, exact check, nccl-tests busbw).
    report = bench.run_bench_rank(bench.BenchRank(world, comm, plan))
    return json.loads(json.dumps(report, default=str))  # plain data (the header holds a TorchVersion)
