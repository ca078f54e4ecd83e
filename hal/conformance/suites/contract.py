"""Contract suite: does the backend do what its contract answers say (``Backend.contract()``)?

One case per contract item (``hal.backend.CONTRACT_ITEMS``), run on device 0 of the backend under test — the
matrix OpenReg's tests make of an accelerator integration, here over hal's contract:

* ``capability``: ``capabilities(0)`` names the device, its memory agrees with ``mem_get_info`` (within 10 %),
  fp32 is native;
* ``streams_events``: work queued inside ``stream(s)`` on a new stream computes right once an event recorded
  after it is waited on; timed events measure a non-negative interval;
* ``memory_stats``: a 96 MiB allocation raises ``memory_allocated`` by at least 90 % of it, the peak holds it
  after the tensor is freed, and ``reset_peak_memory_stats`` lowers the peak again;
* ``host_cache``: a pinned 16 MiB host buffer shows in ``host_memory_stats``; ``empty_host_cache`` runs (where
  this torch has none, the reason is in the outcome);
* ``rng``: ``set_rng_state(get_rng_state())`` replays the same draws; ``manual_seed`` makes them again;
* ``graph_capture``: ``y = x * 2 + 1`` captured once, replayed for two new ``x`` written in place;
* ``profiler``: ``profiler()`` records a matmul — on an accelerator as a device kernel, on the host as ``aten::mm``.

An item the backend answers "unsupported" is an ``unsupported`` outcome carrying its reason (never a pass);
an item it answers "supported" that does not behave is a ``fail``.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from hal.backend import CONTRACT_ITEMS
from hal.conformance.cases import Case, Context, Outcome, unsupported
from hal.errors import UnsupportedError

SUITE = "contract"
MIB = 2**20
ALLOC_BYTES = 96 * MIB  # above glibc's largest mmap threshold (32 MiB): the host's resident set grows with it
PINNED_BYTES = 16 * MIB


def cases(ctx: Context) -> list[Case]:
    checks: dict[str, tuple[Callable[[Context], Outcome], str]] = {
        "capability": (_capability, "capabilities(0): name, memory agreeing with mem_get_info, fp32 native"),
        "streams_events": (_streams_events, "work on a new stream, an event waited on, a timed interval"),
        "memory_stats": (_memory_stats, "a 96 MiB allocation in memory_allocated and the peak, reset_peak lowers it"),
        "host_cache": (_host_cache, "a pinned host buffer in host_memory_stats; empty_host_cache"),
        "rng": (_rng, "get/set_rng_state replays draws; manual_seed repeats them"),
        "graph_capture": (_graph_capture, "capture y = 2x + 1 once, replay it for new x"),
        "profiler": (_profiler, "the profiler hook records a matmul (device kernel, or aten::mm on the host)"),
    }
    assert tuple(checks) == CONTRACT_ITEMS  # a new contract item is a new case here
    return [Case(SUITE, item, _guarded(item, fn), description, ("contract",)) for item, (fn, description) in checks.items()]


def _guarded(item: str, check: Callable[[Context], Outcome]) -> Callable[[Context], Outcome]:
    """The check where the backend answers "supported"; its reason as ``unsupported`` otherwise."""

    def run(ctx: Context) -> Outcome:
        answer = ctx.backend.contract()[item]
        if answer.state != "supported":
            return unsupported(f"{answer.state}: {answer.reason} ({answer.api})")
        outcome = check(ctx)
        outcome.data.setdefault("api", answer.api)
        return outcome

    return run


def _fail(metric: str, reason: str, **metrics: float) -> Outcome:
    return Outcome("fail", dict(metrics), {}, metric, reason)


def _capability(ctx: Context) -> Outcome:
    caps = ctx.backend.capabilities(0)
    free, total = ctx.backend.mem_get_info(0)
    metrics = {"memory_bytes": float(caps.memory_bytes or 0), "mem_get_info_total": float(total)}
    if not caps.name:
        return _fail("name", "capabilities(0) names no device", **metrics)
    if not caps.memory_bytes or abs(caps.memory_bytes - total) > 0.1 * total:
        return _fail("memory_bytes", f"capabilities(0) says {caps.memory_bytes} bytes, mem_get_info {total}", **metrics)
    if not 0 <= free <= total:
        return _fail("mem_get_info_free", f"mem_get_info: free {free} outside 0..{total}", **metrics)
    if not caps.is_native("fp32"):
        return _fail("fp32", f"capabilities(0) says fp32 is {caps.support('fp32').value}, not native", **metrics)
    return Outcome("pass", metrics, reason=f"{caps.name}: {total / 2**30:.1f} GiB, native {' '.join(caps.native_dtypes())}")


def _streams_events(ctx: Context) -> Outcome:
    backend, device = ctx.backend, ctx.device
    stream = backend.Stream()
    start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
    x = torch.arange(1 << 20, device=device, dtype=torch.float32)
    backend.synchronize()
    with backend.stream(stream):
        start.record(stream)
        y = (x * 3 + 1).sum()
        end.record(stream)
    end.synchronize()
    want = 3 * (float(1 << 20) * ((1 << 20) - 1) / 2) + (1 << 20)
    got = float(y.item())
    ms = start.elapsed_time(end)
    metrics = {"elapsed_ms": ms, "rel_err": abs(got - want) / want}
    if metrics["rel_err"] > 1e-5:
        return _fail("rel_err", f"the stream's result {got} is not {want}", **metrics)
    if not ms >= 0:
        return _fail("elapsed_ms", f"elapsed_time between the events is {ms} ms", **metrics)
    return Outcome("pass", metrics, reason=f"a stream's work and a timed interval of {ms:.3f} ms")


def _memory_stats(ctx: Context) -> Outcome:
    backend, device = ctx.backend, ctx.device
    backend.synchronize()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    before = backend.memory_allocated()
    held = torch.ones(ALLOC_BYTES // 4, device=device, dtype=torch.float32)  # written: resident on the host too
    backend.synchronize()
    during = backend.memory_allocated()
    del held
    backend.synchronize()
    peak = backend.max_memory_allocated()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    after_reset = backend.max_memory_allocated()
    metrics = {"grew_mib": (during - before) / MIB, "peak_mib": peak / MIB, "peak_after_reset_mib": after_reset / MIB}
    if during - before < 0.9 * ALLOC_BYTES:
        return _fail("grew_mib", f"memory_allocated grew by {metrics['grew_mib']:.1f} MiB for a 96 MiB tensor", **metrics)
    if peak < before + 0.9 * ALLOC_BYTES:
        return _fail("peak_mib", f"max_memory_allocated {metrics['peak_mib']:.1f} MiB misses the freed tensor", **metrics)
    if after_reset >= peak:
        return _fail("peak_after_reset_mib", "reset_peak_memory_stats did not lower the peak", **metrics)
    return Outcome("pass", metrics, reason=f"+{metrics['grew_mib']:.0f} MiB seen, peak {metrics['peak_mib']:.0f} MiB, "
                                           f"reset to {metrics['peak_after_reset_mib']:.0f} MiB")


def _host_cache(ctx: Context) -> Outcome:
    backend = ctx.backend
    key = "allocated_bytes.current"
    before = backend.host_memory_stats().get(key, 0)
    pinned = torch.empty(PINNED_BYTES, dtype=torch.uint8, pin_memory=True)
    pinned.to(ctx.device, non_blocking=True)  # a staged copy, as a data loader's
    backend.synchronize()
    during = backend.host_memory_stats().get(key, 0)
    del pinned
    try:
        backend.empty_host_cache()
        emptied = "empty_host_cache ran"
    except UnsupportedError as exc:  # the statistics are the item; emptying is said where this torch lacks it
        emptied = str(exc)
    metrics = {"host_cache_grew_mib": (during - before) / MIB}
    if during - before < PINNED_BYTES:
        return _fail("host_cache_grew_mib", f"host_memory_stats()['{key}'] grew {metrics['host_cache_grew_mib']:.1f} MiB "
                                            f"for a pinned 16 MiB buffer", **metrics)
    return Outcome("pass", metrics, reason=f"a pinned 16 MiB buffer: +{metrics['host_cache_grew_mib']:.0f} MiB in the "
                                           f"cache; {emptied}")


def _rng(ctx: Context) -> Outcome:
    backend, device = ctx.backend, ctx.device
    saved = backend.get_rng_state()
    first = torch.rand(1024, device=device)
    backend.set_rng_state(saved)
    again = torch.rand(1024, device=device)
    backend.manual_seed(ctx.seed + 1)  # not the run's seed: the saved state may be that seed's
    seeded = torch.rand(1024, device=device)
    backend.manual_seed(ctx.seed + 1)
    reseeded = torch.rand(1024, device=device)
    backend.set_rng_state(saved)  # the run's generator as it was
    if not torch.equal(first, again):
        return _fail("replay", "set_rng_state(get_rng_state()) did not replay the same draws")
    if not torch.equal(seeded, reseeded) or torch.equal(seeded, first):
        return _fail("manual_seed", "manual_seed did not make the same draws twice (or made the saved state's)")
    return Outcome("pass", reason="a saved state replays its draws; a seed repeats its own")


def _graph_capture(ctx: Context) -> Outcome:
    backend, device = ctx.backend, ctx.device
    x = torch.zeros(4096, device=device)
    side = backend.Stream()
    side.wait_stream(backend.current_stream())
    with backend.stream(side):  # warm-up on a side stream first, as PyTorch's graph-capture recipe asks
        y = x * 2 + 1
    backend.current_stream().wait_stream(side)
    graph = backend.Graph()
    with backend.graph(graph):
        y = x * 2 + 1
    worst = 0.0
    for value in (3.0, -7.5):
        x.copy_(torch.full_like(x, value))
        graph.replay()
        backend.synchronize()
        worst = max(worst, float((y - (2 * value + 1)).abs().max()))
    if worst != 0.0:
        return _fail("replay_max_abs", f"a replay computed {worst} away from 2x + 1", replay_max_abs=worst)
    return Outcome("pass", {"replay_max_abs": worst}, reason="captured once, two replays exact")


def _profiler(ctx: Context) -> Outcome:
    backend, device = ctx.backend, ctx.device
    a = torch.randn(256, 256, device=device)
    started = time.perf_counter()
    with backend.profiler() as prof:
        (a @ a).sum()
        backend.synchronize()
    try:
        events = list(prof.events() or [])
    except Exception as exc:  # a hook that never started, or records nothing it can hand back
        return _fail("events", f"the profiler's events cannot be read: {type(exc).__name__}: {exc}")
    on_device = [e for e in events if str(getattr(e, "device_type", "")).split(".")[-1] not in ("CPU", "")]
    host_mm = [e for e in events if e.name == "aten::mm"]
    metrics = {"events": float(len(events)), "device_events": float(len(on_device)),
               "seconds": time.perf_counter() - started}
    if not host_mm:
        return _fail("events", "the profiler recorded no aten::mm for a matmul", **metrics)
    if ctx.device.type != "cpu" and not on_device and backend.standin:  # the host ran the matmul: no device kernel
        return unsupported(f"{ctx.backend_name} runs on a stand-in ({backend.standin}): aten::mm recorded, but its "
                           "operators are the host's, so no device kernel can show; not verified on hardware")
    if ctx.device.type != "cpu" and not on_device:
        return _fail("device_events", "the profiler recorded no device kernel for a matmul on the device", **metrics)
    where = f"{len(on_device)} device event(s)" if on_device else "host events only (the device is the host)"
    return Outcome("pass", metrics, reason=f"aten::mm recorded; {where}")
