"""Collectives suite: every Communicator op, in every dtype the CCL serves, at the world sizes the machine allows.

One multi-process job per world size (``conformance.jobs.collective_job``) runs ALL checks
(``conformance.suites.collective_checks``), then ``hal bench collectives``' measurement loop, and returns
every rank's verdicts; each check is still its own case (the cases of one world size share the job's
cached result, so a ``-k`` filter that keeps one case starts one job). Process start-up costs seconds on a small host, a check costs
milliseconds.

Options (``ctx.options``):

- ``communicator_factory``: ``"module:callable"`` the ranks import and call as ``fn(validate=...)``
  instead of ``collectives.world_communicator`` — a vendor's own Communicator subclass, or a test's
  planted fault. Its package must be importable (``PYTHONPATH``; the repository root and the
  current directory are added).
- ``collectives_world_sizes``: e.g. ``[2, 4]`` (default: 2, the powers of two below the slots, and
  ``ctx.max_world_size``).
- ``collectives_timeout_s``: the deadline of one job (default 300 s); past it every rank is killed and
  the job's cases are errors.
- ``ccl_accumulation``: how the CCL's sums accumulate per dtype name ("dtype" or "wide"), over the backend's own
  declaration (``Backend.ccl_accumulation``): the reduction probe holds the library to it.
- ``busbw_sizes``: message sizes for the bandwidth table, a list of bytes or ``"MIN..MAX"``
  (default 1 KiB, 16 KiB, 256 KiB on the CPU; 1 MiB..256 MiB on accelerators).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from hal.conformance.cases import SELECTED_OPTION, Case, Context, Outcome, skip
from hal.conformance.jobs.launch import JobFailed, JobResult, run_job
from hal.conformance.suites.collective_checks import (
    ACCUMULATION_WORDS,
    DTYPES,
    Check,
    accumulation_kind,
    merge_ranks,
    not_runnable,
    plan_checks,
)

SUITE = "collectives"
CPU_BUSBW_SIZES = (1 << 10, 1 << 14, 1 << 18)  # host memory (``_host_memory``)
ACCEL_BUSBW_SIZES = (1 << 20, 1 << 23, 1 << 26, 1 << 28)
DEFAULT_TIMEOUT_S = 300.0
_CAPABILITY_KEYS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def world_sizes(ctx: Context) -> list[int]:
    """The world sizes to check: the option, or 2, powers of two below the slots, and the slot count."""
    top = ctx.max_world_size
    chosen = ctx.options.get("collectives_world_sizes")
    if chosen is not None:
        sizes = [int(n) for n in chosen]
        bad = [n for n in sizes if not 2 <= n <= top]
        if bad:
            raise ValueError(f"collectives_world_sizes {bad}: each must be 2..{top} (this machine's process slots)")
        return sorted(set(sizes))
    if top < 2:
        return []
    sizes, n = {2, top}, 4
    while n < top:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


def dtypes(ctx: Context) -> list[str]:
    """Dtype names the device supports (native or emulated); integers always."""
    return [name for name, dt in DTYPES.items() if not dt.is_floating_point or ctx.dtype_supported(dt)]


def _host_memory(ctx: Context) -> bool:
    """Whether the device's memory is the host's: the cpu, or a host-backed stand-in (its bandwidth is the host's)."""
    return ctx.device.type == "cpu" or ctx.backend.standin is not None


def busbw_sizes(ctx: Context) -> list[int]:
    raw = ctx.options.get("busbw_sizes")
    if raw is None:
        return list(CPU_BUSBW_SIZES if _host_memory(ctx) else ACCEL_BUSBW_SIZES)
    if isinstance(raw, str):
        from hal.collectives.bench import parse_sizes

        return parse_sizes(raw)
    return [int(s) for s in raw]


class _Job:
    """One world size's job, run on first use and shared by its cases."""

    def __init__(self, ctx: Context, world_size: int, checks: list[Check]) -> None:
        self.world_size, self.checks = world_size, checks
        self.spec: dict[str, Any] = {
            "checks": [c.to_dict() for c in checks], "seed": ctx.seed,
            "communicator_factory": ctx.options.get("communicator_factory"),
            "bench_sizes": busbw_sizes(ctx), "bench_rounds": 1 if _host_memory(ctx) else 3,
        }
        self.timeout_s = float(ctx.options.get("collectives_timeout_s", DEFAULT_TIMEOUT_S))
        self._lock = threading.Lock()
        self._result: JobResult | None = None
        self._error: str | None = None

    def get(self, ctx: Context) -> tuple[JobResult | None, str | None]:
        with self._lock:
            if self._result is None and self._error is None:
                try:
                    self._result = run_job(ctx.launch, "collectives", self._selected(ctx), self.world_size, ctx.backend.name,
                                           timeout_s=self.timeout_s)
                except JobFailed as exc:
                    self._error = str(exc)
            return self._result, self._error

    def _selected(self, ctx: Context) -> dict[str, Any]:
        """The job's spec cut to the cases this run selected (``-k``): only their checks, and the bandwidth sweep only
        when a busbw case of this world is among them. Every check when the run says nothing of its selection."""
        chosen = ctx.options.get(SELECTED_OPTION)
        if chosen is None:
            return self.spec
        world = f"/world{self.world_size}"
        checks = [c for c in self.spec["checks"] if f"{SUITE}::{c['name']}{world}" in chosen]
        busbw = any(i.startswith(f"{SUITE}::busbw/") and i.endswith(world) for i in chosen)
        return {**self.spec, "checks": checks, "bench_sizes": self.spec["bench_sizes"] if busbw else []}


def _check_case(job: _Job, check: Check) -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        result, error = job.get(ctx)
        if result is None:
            return Outcome("error", reason=f"the world-{job.world_size} job failed: {error}")
        v = merge_ranks([rank["checks"].get(check.name) for rank in result.values])
        outcome = Outcome(v["status"], v["metrics"], v["tolerance"], v["failed_metric"], v["reason"], v["data"])
        if check.op == "reduction_probe" and outcome.status == "pass":
            declared = {**ctx.backend.ccl_accumulation, **ctx.options.get("ccl_accumulation", {})}.get(check.dtype)
            return held_to_declaration(outcome, check.dtype, declared)
        return outcome

    return run


def held_to_declaration(outcome: Outcome, dtype: str, declared: str | None) -> Outcome:
    """A passing reduction probe against the backend's declared accumulation for ``dtype`` ("dtype" or "wide"): a fail
    where the library's sums are bitwise only of the other kind; confirmed, or not confirmed where no model matched."""
    if declared is None:
        return outcome
    models = list(outcome.data.get("models") or [])
    kinds = {accumulation_kind(m) for m in models}
    if models and declared not in kinds:
        (found,) = kinds
        return Outcome("fail", {**outcome.metrics, "matches_declared": 0.0}, {**outcome.tolerance, "matches_declared": 1.0},
                       "matches_declared", f"declared to accumulate {dtype} sums {ACCUMULATION_WORDS[declared]}, but they "
                       f"are bitwise {ACCUMULATION_WORDS[found]}: {outcome.reason}", outcome.data)
    said = "confirmed" if models else "not confirmed: its sums match no model"
    return Outcome("pass", outcome.metrics, outcome.tolerance, None,
                   f"{outcome.reason} (declared: {ACCUMULATION_WORDS[declared]}; {said})", outcome.data)


def _busbw_case(job: _Job, op: str, dtype: str) -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        result, error = job.get(ctx)
        if result is None:
            return Outcome("error", reason=f"the world-{job.world_size} job failed: {error}")
        report = result.values[0]
        if report["bench"] is None:
            return Outcome("error", reason=f"the busbw sweep failed: {report['bench_error']}")
        rows = [r for r in report["bench"]["rows"] if r["op"] == op and r["dtype"] == dtype]
        if not rows:
            return Outcome("error", reason=f"the busbw sweep measured no {op} {dtype}")
        wrong = sum(r["ours"]["wrong"] + r["raw"]["wrong"] for r in rows)
        data = {
            "op": op, "dtype": dtype, "sizes_bytes": [r["size"] for r in rows],
            "busbw_gbs": [r["ours"]["busbw_gbps"] for r in rows], "raw_busbw_gbs": [r["raw"]["busbw_gbps"] for r in rows],
            "time_us": [r["ours"]["time_us"] for r in rows],
        }
        metrics = {"wrong": float(wrong), "peak_busbw_gbs": max(data["busbw_gbs"]), "raw_peak_busbw_gbs": max(data["raw_busbw_gbs"])}
        if wrong:
            bad = next(r for r in rows if r["ours"]["wrong"] or r["raw"]["wrong"])
            return Outcome("fail", metrics, {"wrong": 0.0}, "wrong",
                           f"{wrong} wrong element(s) in the bench's exact check (first at {bad['size']} B: "
                           f"ours {bad['ours']['wrong']}, raw {bad['raw']['wrong']})", data)
        return Outcome("pass", metrics, {"wrong": 0.0}, None, "bandwidth is informational; every element was exact", data)

    return run


def _fixed(outcome: Outcome) -> Callable[[Context], Outcome]:
    return lambda ctx: Outcome(outcome.status, reason=outcome.reason)


def cases(ctx: Context) -> list[Case]:
    sizes = world_sizes(ctx)
    if not sizes:
        why = f"{ctx.max_world_size} process slot(s) on backend {ctx.backend_name}: no multi-rank collectives to check"
        return [Case(SUITE, "multi_rank", _fixed(skip(why)), "collectives need at least 2 ranks")]
    from hal.collectives.bench import OPS

    out: list[Case] = []
    for n in sizes:
        checks = [(check, not_runnable(ctx.backend, check, n)) for check in plan_checks(dtypes(ctx))]
        job = _Job(ctx, n, [check for check, blocked in checks if blocked is None])
        for check, blocked in checks:
            run = _check_case(job, check) if blocked is None else _fixed(Outcome(blocked[0], reason=blocked[1]))  # type: ignore[arg-type]
            out.append(Case(SUITE, f"{check.name}/world{n}", run, check.description, ("multi-process", f"world{n}")))
        for op in OPS:
            out.append(Case(SUITE, f"busbw/{op}/float32/world{n}", _busbw_case(job, op, "float32"),
                            f"hal bench collectives: {op} busbw over a size sweep (exact check of every element)",
                            ("multi-process", f"world{n}", "bandwidth")))
    return out
