"""Measure a device type present on this host: one decoder layer, the embedding, the head, AdamW, and the links.

Why in-process and tiny: the planner needs relative stage costs, and one layer at a few micro-batch
sizes is enough to fit time = a + b × rows (``profile.DeviceProfile.layer``). Each part is built
with ``build_stage`` — the module the engine runs — and timed on the backend object (synchronize,
then the host clock), median of ``repeats`` after one warm-up. Activation memory is what autograd
saves for backward (saved-tensor hooks, parameters excluded, each storage counted once): exact,
and the same on every device. Links reuse the collectives benchmark library (``collectives.bench``):
a broadcast between two ranks, at a small and a large size, gives latency and bandwidth — inside one
island, and across the bridge between two declared islands.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch

from hal.backend import Backend
from hal.parallel.config.flops import PEAK_KEY
from hal.parallel.config.memory import layer_parameters
from hal.parallel.config.model import ModelConfig
from hal.parallel.loop.optim_schedule import decoupled_adamw
from hal.parallel.models.stage import build_stage
from hal.parallel.models.weight_grad import WeightGradStore, collecting, splittable
from hal.parallel.planner.device_profile import MEASURED, DeviceProfile, LayerPoint, LinkProfile, PerToken
from hal.parallel.replicas.sync import BUCKET_BYTES

Progress = Callable[[str], None]
MIN_MEASURED_S, MAX_REPEATS = 0.3, 50


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Compute threads while measuring: the count each rank of a run gets (hal train: cores / ranks)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def saved_bytes() -> Iterator[list[int]]:
    """Bytes autograd saves for backward inside the block (each storage once; parameters, and views of them such as
    a transposed weight, are not activations)."""
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def _timed(backend: Backend, fn: Callable[[], Any]) -> float:
    backend.synchronize()
    start = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - start


Clocks = tuple[float, float, float, float]  # host forward, host backward, device forward, device backward (s)


def _split_cost(whole: tuple[float, float, Clocks | None], split: tuple[float, float, Clocks | None]) -> tuple[float, float]:
    """(host, device) time of the split program over the whole one's, forward and backward together; one clock (the
    cpu's wall time) gives both."""
    (f, b, clocks), (sf, sb, split_clocks) = whole, split
    if clocks is None or split_clocks is None:
        wall = (sf + sb) / max(f + b, 1e-12)
        return wall, wall
    host = (split_clocks[0] + split_clocks[1]) / max(clocks[0] + clocks[1], 1e-12)
    device = (split_clocks[2] + split_clocks[3]) / max(clocks[2] + clocks[3], 1e-12)
    return host, device


def _weight_share(backend: Backend, forward: Callable[[], torch.Tensor], repeats: int) -> float:
    """The share of a backward the zero-bubble split's weight half ``W`` takes: its input half ``I`` timed with the
    linears' weight gradients deferred, then ``W`` running them; the median over ``repeats`` after a warm-up (which
    also compiles a compiled layer's split variant). Attention's backward has no weights, so this is under half."""
    shares = []
    for i in range(repeats + 1):
        with splittable(True):
            out = forward()
        grad = torch.ones_like(out)
        store = WeightGradStore()
        with collecting(store):
            t_input = _timed(backend, lambda: out.backward(grad))
        t_weight = _timed(backend, store.run)
        if i:
            shares.append(t_weight / max(t_input + t_weight, 1e-12))
    return statistics.median(shares)


def _fwd_bwd(backend: Backend, forward: Callable[[], torch.Tensor], repeats: int,
             grad: Callable[[torch.Tensor], torch.Tensor], adaptive: bool = True) -> tuple[float, float, int, Clocks | None]:
    """Forward and backward seconds of one call, the bytes saved for backward, and (accelerators) the two clocks.

    The host runs each call alone; an accelerator queues ``QUEUED`` calls back to back between two
    synchronizations (``_queued``) — in a run, the host queues the next layer's kernels while the device
    runs this one's, so a synchronized single call would charge the launch latency a run hides."""
    if backend.device_type == "cpu":
        return (*_fwd_bwd_each(backend, forward, repeats, grad, adaptive), None)
    return _queued(backend, forward, repeats, grad)


QUEUED = 8  # calls an accelerator measurement queues between two synchronizations
BLOCKER_SIDE = 4096  # the square matmul that keeps a device busy while the host enqueues (``_DeviceClock``)


class _DeviceClock:
    """The device's own time for a batch of enqueued calls, free of the host's launch gaps.

    Why: with the host slower than the device, a synchronized wall clock measures the host. Here the device
    is first given enough matmuls to stay busy for about twice the host's enqueue time, so by the time it
    reaches the calls they are all queued and run back to back; two events around them time the device."""

    def __init__(self, backend: Backend, device: torch.device) -> None:
        self.backend = backend
        self.a = torch.randn(BLOCKER_SIDE, BLOCKER_SIDE, device=device)  # fp32: every accelerator multiplies it
        self.a @ self.a  # warm-up: the library's handle and kernel choice
        backend.synchronize()
        self.block_s = max(self._events(lambda: self.a @ self.a), 1e-6)

    def time(self, enqueue: Callable[[], Any], host_s: float) -> float:
        """Device seconds of what ``enqueue`` queues, when the host takes about ``host_s`` to queue it."""
        self.backend.synchronize()
        for _ in range(int(2 * host_s / self.block_s) + 1):
            self.a @ self.a
        return self._events(enqueue)

    def _events(self, enqueue: Callable[[], Any]) -> float:
        stream = self.backend.current_stream()
        start, end = self.backend.Event(enable_timing=True), self.backend.Event(enable_timing=True)
        start.record(stream)
        enqueue()
        end.record(stream)
        self.backend.synchronize()
        return start.elapsed_time(end) / 1e3


def _queued(backend: Backend, forward: Callable[[], torch.Tensor], repeats: int,
            grad: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, float, int, Clocks]:
    """Median over ``repeats`` rounds (one warm-up) of QUEUED forwards, then their QUEUED backwards, per call:
    the synchronized wall time, the host's enqueue time, and the device's time (``_DeviceClock``)."""
    clock = _DeviceClock(backend, forward().device)
    fwd, bwd, host_f, host_b, dev_f, dev_b, saved = [], [], [], [], [], [], 0
    for i in range(repeats + 1):
        outs: list[torch.Tensor] = []
        with saved_bytes() as box:
            first = forward()
        saved = box[0]
        outs.append(first)
        backend.synchronize()
        start = time.perf_counter()
        outs.extend(forward() for _ in range(QUEUED))
        queued_f = time.perf_counter() - start
        backend.synchronize()
        t_f = (time.perf_counter() - start) / QUEUED
        grads = [grad(o) for o in outs]
        outs[0].backward(grads[0])
        backend.synchronize()
        start = time.perf_counter()
        for o, g in zip(outs[1:], grads[1:]):
            o.backward(g)
        queued_b = time.perf_counter() - start
        backend.synchronize()
        t_b = (time.perf_counter() - start) / QUEUED
        # the same calls again, timed on the device behind a blocker
        outs = []
        d_f = clock.time(lambda: outs.extend(forward() for _ in range(QUEUED)), queued_f)
        grads = [grad(o) for o in outs]
        d_b = clock.time(lambda: [o.backward(g) for o, g in zip(outs, grads)], queued_b)
        if i:
            fwd.append(t_f)
            bwd.append(t_b)
            host_f.append(queued_f / QUEUED)
            host_b.append(queued_b / QUEUED)
            dev_f.append(d_f / QUEUED)
            dev_b.append(d_b / QUEUED)
    med = statistics.median
    return med(fwd), med(bwd), saved, (med(host_f), med(host_b), med(dev_f), med(dev_b))


def _fwd_bwd_each(backend: Backend, forward: Callable[[], torch.Tensor], repeats: int,
                  grad: Callable[[torch.Tensor], torch.Tensor], adaptive: bool = True) -> tuple[float, float, int]:
    """Median forward and backward seconds over ``repeats`` or more (one warm-up first), and the bytes saved.

    Short parts are repeated until about ``MIN_MEASURED_S`` was measured (at most ``MAX_REPEATS``): three
    millisecond-long samples on a shared host swing by tens of percent, which the planner would inherit.
    Not ``adaptive``: exactly ``repeats`` — ranks calling collectives together must make the same calls."""
    fwd, bwd, saved = [], [], 0
    i = 0
    while i <= repeats or (adaptive and sum(fwd) + sum(bwd) < MIN_MEASURED_S and i <= MAX_REPEATS):
        holder: dict[str, torch.Tensor] = {}

        def run_forward() -> None:
            holder["out"] = forward()

        with saved_bytes() as box:
            t_f = _timed(backend, run_forward)
        out = holder.pop("out")
        g = grad(out)
        t_b = _timed(backend, lambda: out.backward(g))
        if i:
            fwd.append(t_f)
            bwd.append(t_b)
        saved = box[0]
        i += 1
    return statistics.median(fwd), statistics.median(bwd), saved


def compile_for_profiling(stage: Any, compile_backend: str, first_forward: Callable[[], torch.Tensor]) -> None:
    """Compile ``stage``'s layers as ``hal train`` does (``compile_stage``), after one eager forward and backward that
    fill hal's op caches, with static shapes: each row count then gets the graph a run of that shape compiles."""
    from hal.parallel.pipeline.compile_stage import compile_layers, eager_first_forward

    with eager_first_forward():
        out = first_forward()
        out.backward(torch.ones_like(out))
    compile_layers(stage, compile_backend, dynamic=False)


def measure_device(backend: Backend, model: ModelConfig, *, seq: int, rows: tuple[int, ...], autocast: Callable[[], ContextManager[Any]],
                   precision: str, repeats: int = 3, threads: int | None = None, progress: Progress | None = None,
                   compile_backend: str | None = None) -> DeviceProfile:
    """The profile of ``backend``'s device 0 for ``model``: layers at tp 1 for every row count, recompute off and on
    (compiled with ``compile_backend`` when the plan compiles its layers: a compiled layer is another program)."""
    device = backend.device(0)
    caps = backend.capabilities(0)
    say = progress or (lambda _: None)
    weight_share: float | None = None  # the split backward, measured at the largest rows with recompute off
    split_cost: tuple[float, float] | None = None
    with _threads(threads):
        points = []
        for recompute in (False, True):
            layer = build_stage(model, range(0, 1), first=False, last=False, tp_comm=None, sp=False, seed=0,
                                device=device, checkpoint=recompute)
            if compile_backend is not None:
                first = torch.randn(rows[0], seq, model.hidden_size, device=device, requires_grad=True)
                compile_for_profiling(layer, compile_backend, lambda: _under(autocast, layer, first))
            for r in rows:
                say(f"{caps.catalog_id or backend.name}: one layer, {r} row(s) × {seq} tokens, recompute {'on' if recompute else 'off'}")
                x = torch.randn(r, seq, model.hidden_size, device=device, requires_grad=True)

                def forward() -> torch.Tensor:
                    with autocast():
                        return layer(x)

                f, b, act, clocks = _fwd_bwd(backend, forward, repeats, torch.ones_like)
                points.append(LayerPoint(1, r, seq, recompute, f, b, act, *(clocks or (None,) * 4)))
                if not recompute and r == max(rows):
                    say(f"{caps.catalog_id or backend.name}: the backward split in its input and weight halves (zero-bubble)")
                    weight_share = _weight_share(backend, forward, repeats)

                    def split_forward() -> torch.Tensor:
                        with splittable(True):
                            return forward()

                    sf, sb, _, split_clocks = _fwd_bwd(backend, split_forward, repeats, torch.ones_like)
                    split_cost = _split_cost((f, b, clocks), (sf, sb, split_clocks))
        say(f"{caps.catalog_id or backend.name}: embedding, head and loss (plain and fused), AdamW")
        embedding, head = _ends(backend, model, device, seq, max(rows), autocast, repeats)
        fused_head = _fused_head(backend, model, device, seq, (min(rows), max(rows)), autocast, repeats)
        optimizer = _optimizer_s_per_param(backend, model, device, repeats)
    big = max((p for p in points if not p.recompute), key=lambda p: p.rows)
    achieved = _layer_flops(model, big.rows * seq, seq) / (big.forward_s + big.backward_s) / 1e12
    peak = caps.peak_tflops.get(PEAK_KEY.get(precision, "fp32"))
    basis = (f"measured on this host ({caps.name}), tp 1, median of {repeats} after a warm-up"
             + (f", {threads} compute thread(s) per rank" if threads else "")
             + (f", layers compiled ({compile_backend})" if compile_backend else ""))
    return DeviceProfile(caps.catalog_id or backend.name, backend.name, MEASURED, basis, tuple(points), embedding, head,
                         optimizer, threads, achieved, achieved / peak if peak else None, fused_head,
                         weight_share=weight_share, split_cost=split_cost)


TP_DEGREE = 2  # the tp degree measured with its group present (every accelerator host with 2 devices can)


@contextlib.contextmanager
def profiling_rank(backend_name: str, precision: str, fallback: str) -> Iterator[tuple[Any, Backend, Any]]:
    """One rank of a profiling job (``launch``ed): joined to its world on ``backend_name`` (no declared islands),
    its precision resolved and applied; (world, backend, precision plan) inside, the world shut down after."""
    import datetime
    import os

    from hal.backend_registry import get_backend
    from hal.collectives import init_distributed, shutdown
    from hal.precision import resolve_precision

    os.environ.pop("HAL_ISLANDS", None)
    world = init_distributed(backend_name, init_method=os.environ.get("HAL_INIT_METHOD"), timeout=datetime.timedelta(minutes=3))
    try:
        backend = get_backend(backend_name)
        plan = resolve_precision(precision, backend, backend.capabilities(), fallback)  # type: ignore[arg-type]
        plan.apply(backend)
        yield world, backend, plan
    finally:
        shutdown()


def _under(autocast: Callable[[], ContextManager[Any]], layer: Any, x: torch.Tensor) -> torch.Tensor:
    with autocast():
        return layer(x)


def tp_layer_rank(backend_name: str, model: dict[str, Any], seq: int, rows: list[int], precision: str, repeats: int,
                  fallback: str = "warn", compile_backend: str | None = None) -> list[dict[str, Any]] | None:
    """One of ``TP_DEGREE`` ranks: one decoder layer split over them, without and with sequence parallelism,
    at each row count — the plain layer's points, its tp collectives included. Rank 0 returns the points."""
    import dataclasses

    from hal.collectives import world_communicator

    with profiling_rank(backend_name, precision, fallback) as (world, backend, plan):
        config = ModelConfig(**model)
        comm = world_communicator(validate=False)  # as the engine's groups: calls fixed by the plan
        points = []
        for sp in (False, True):
            layer = build_stage(config, range(0, 1), first=False, last=False, tp_comm=comm, sp=sp, seed=0, device=world.device)
            if compile_backend is not None:
                first = torch.randn(rows[0], seq // comm.size if sp else seq, config.hidden_size, device=world.device,
                                    requires_grad=True)
                compile_for_profiling(layer, compile_backend, lambda: _under(lambda: plan.autocast(backend), layer, first))
            for r in rows:
                local = seq // comm.size if sp else seq
                x = torch.randn(r, local, config.hidden_size, device=world.device, requires_grad=True)

                def forward() -> torch.Tensor:
                    with plan.autocast(backend):
                        return layer(x)

                f, b, act, clocks = _fwd_bwd(backend, forward, repeats, torch.ones_like, adaptive=False)
                point = LayerPoint(comm.size, r, seq, False, f, b, act, *(clocks or (None,) * 4), sp=sp)
                points.append(dataclasses.asdict(point))
        return points if world.rank == 0 else None


def measure_tp_layers(backend_name: str, model: ModelConfig, *, seq: int, rows: tuple[int, ...], precision: str, repeats: int,
                      launch: Callable[..., Any], fallback: str = "warn", compile_backend: str | None = None) -> tuple[LayerPoint, ...]:
    """Layer points at tp ``TP_DEGREE`` (sp off and on) measured on two devices of this host.

    Why measure rather than add a ring formula to tp 1's points: on an accelerator the tp collectives cost
    the host too (each is enqueued like a kernel, through the communicator), and a split layer launches
    as many kernels as a whole one — on a host-bound device that, not the bytes, sets the layer's time."""
    import sys

    run = launch(f"{__name__}:tp_layer_rank", TP_DEGREE,
                 {"backend_name": backend_name, "model": model.to_dict(), "seq": seq, "rows": list(rows),
                  "precision": precision, "repeats": repeats, "fallback": fallback, "compile_backend": compile_backend},
                 deadline_s=300, what=f"hal profile: one layer at tp {TP_DEGREE} on {backend_name}", echo_stderr=sys.stderr,
                 env={"HAL_BACKEND": backend_name})
    return tuple(LayerPoint(**p) for p in run.values[0])


def _layer_flops(model: ModelConfig, tokens: int, seq: int) -> float:
    """Forward + backward FLOPs of one layer (parallel.config.flops' convention: 6·params + 12·heads·head_dim·seq a token)."""
    return tokens * (6.0 * layer_parameters(model) + 12.0 * model.num_heads * model.head_dim * seq)


def _ends(backend: Backend, model: ModelConfig, device: torch.device, seq: int, rows: int,
          autocast: Callable[[], ContextManager[Any]], repeats: int) -> tuple[PerToken, PerToken]:
    """The embedding (first stage) and the final norm + head + loss (last stage), per token."""
    from hal.parallel.models.loss import token_sum_cross_entropy

    tokens = rows * seq
    first = build_stage(model, range(0, 0), first=True, last=False, tp_comm=None, sp=False, seed=0, device=device)
    ids = torch.randint(0, model.vocab_size, (rows, seq), device=device)

    def embed() -> torch.Tensor:
        with autocast():
            return first(ids)

    e = _fwd_bwd(backend, embed, repeats, torch.ones_like)
    last = build_stage(model, range(model.num_layers, model.num_layers), first=False, last=True, tp_comm=None, sp=False,
                       seed=0, device=device)
    hidden = torch.randn(rows, seq, model.hidden_size, device=device, requires_grad=True)
    labels = torch.randint(0, model.vocab_size, (rows, seq), device=device)
    loss_fn = token_sum_cross_entropy(None)

    def head() -> torch.Tensor:
        with autocast():
            return loss_fn(last(hidden), labels)

    h = _fwd_bwd(backend, head, repeats, lambda out: torch.ones_like(out))
    transient = _peak_beyond_saved(backend, device, head, h[2]) if backend.device_type != "cpu" else 0
    return (PerToken(e[0] / tokens, e[1] / tokens, e[2] // tokens),
            PerToken(h[0] / tokens, h[1] / tokens, h[2] // tokens, transient // tokens))


def _fused_head(backend: Backend, model: ModelConfig, device: torch.device, seq: int, rows: tuple[int, int],
                autocast: Callable[[], ContextManager[Any]], repeats: int) -> PerToken:
    """The final norm + the head fused with the loss, as a ``fused_head`` plan's last stage runs it, per token.

    Why apart from ``_ends``' head: the fused op keeps no logits but forms the weight's gradient in its forward, a
    (vocab × hidden) buffer each micro-batch holds until its backward whatever its tokens — timed at the larger row
    count, its saved bytes taken at both and split into that fixed part and a per-token part."""
    from hal.parallel.models.fused_head import fused_head_cross_entropy

    stage = build_stage(model, range(model.num_layers, model.num_layers), first=False, last=True, tp_comm=None,
                        sp=False, seed=0, device=device, fused_head=True)
    saved: dict[int, int] = {}
    timed: tuple[float, float, int, Any] | None = None
    transient = 0
    for r in sorted(set(rows)):
        hidden = torch.randn(r, seq, model.hidden_size, device=device, requires_grad=True)
        labels = torch.randint(0, model.vocab_size, (r, seq), device=device)
        loss_fn = fused_head_cross_entropy(stage, r * seq)

        def head(hidden: torch.Tensor = hidden, labels: torch.Tensor = labels, loss_fn: Any = loss_fn) -> torch.Tensor:
            with autocast():
                return loss_fn(stage(hidden), labels)

        timed = _fwd_bwd(backend, head, repeats, lambda out: torch.ones_like(out))
        saved[r * seq] = timed[2]
        if backend.device_type != "cpu" and r == max(rows):  # the peak at the row count the times are taken at
            transient = _peak_beyond_saved(backend, device, head, timed[2])
    assert timed is not None
    tokens = max(saved)
    (lo, s_lo), (hi, s_hi) = min(saved.items()), max(saved.items())
    per_token = (s_hi - s_lo) / (hi - lo) if hi > lo else s_hi / hi
    fixed = max(0, round(s_hi - per_token * hi))
    return PerToken(timed[0] / tokens, timed[1] / tokens, max(0, round(per_token)), transient // tokens, fixed)


def _peak_beyond_saved(backend: Backend, device: torch.device, forward: Callable[[], torch.Tensor], saved: int) -> int:
    """Bytes one forward + backward of ``forward`` holds at its allocator peak beyond the ``saved`` activations
    (an accelerator's allocator statistics; the cpu has none worth reading)."""
    index = device.index if device.index is not None else 0
    backend.synchronize()
    backend.reset_peak_memory_stats(index)
    before = backend.memory_allocated(index)
    out = forward()
    out.backward(torch.ones_like(out))
    backend.synchronize()
    return max(0, backend.max_memory_allocated(index) - before - saved)


def _optimizer_s_per_param(backend: Backend, model: ModelConfig, device: torch.device, repeats: int) -> float:
    """AdamW's step over one decoder layer's parameters (as the trainer builds it), per parameter."""
    layer = build_stage(model, range(0, 1), first=False, last=False, tp_comm=None, sp=False, seed=0, device=device)
    params = list(layer.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = decoupled_adamw(params, device, lr=1e-4)
    times = [_timed(backend, opt.step) for _ in range(repeats + 1)][1:]
    return statistics.median(times) / sum(p.numel() for p in params)


# --- links, through the collectives benchmark library ----------------------------------------------------

LINK_SIZES = (4 << 10, 16 << 20)  # bytes: latency-bound, bandwidth-bound
# bytes of the bridge's sum timed beside its P2P: latency-bound, and one bucket of the replicas' exchange (what it sums)
BRIDGE_SUM_SIZES = (4 << 10, BUCKET_BYTES)


def link_rank(backend: str, bridged: bool, iters: int, init_method: str | None = None) -> dict[str, Any] | None:
    """One of two ranks: broadcast rank 0 → 1 at two sizes; rank 0 returns µs per call for each size. Across the
    bridge also the all-reduce of BRIDGE_SUM_SIZES (``"all_reduce"``: seconds at each): the replicas' exchange sums
    32 MiB buckets, staged through page-locked memory and striped over the host channels, where a broadcast crosses
    as one unstaged stream — about 3× slower on H200 hosts (docs/replicas.md), so one figure cannot price both.
    ``init_method``: the store (default: the launcher's ``HAL_INIT_METHOD``)."""
    import datetime
    import os

    from hal.collectives import init_distributed, shutdown, world_communicator
    from hal.collectives.bench import BenchPlan, BenchRank, ours_call

    os.environ.pop("HAL_ISLANDS", None)
    world = init_distributed(backend, init_method=init_method or os.environ.get("HAL_INIT_METHOD"), world_size=2,
                             islands=[0, 1] if bridged else None, timeout=datetime.timedelta(minutes=2))
    torch.set_num_threads(1)
    try:
        plan = BenchPlan(backend, 2, LINK_SIZES, ("float32",), ("broadcast",), iters, 2, rounds=1)
        rank = BenchRank(world, world_communicator(validate=False), plan)
        out: dict[str, Any] = {}
        for size in LINK_SIZES:
            inp = torch.ones(size // 4, device=world.device)
            out[str(size)] = rank.time_us(ours_call("broadcast", rank.comm, inp))
        if bridged:
            sums = []
            for size in BRIDGE_SUM_SIZES:
                inp = torch.zeros(size // 4, device=world.device)  # zeros: the sums stay finite however many calls
                sums.append(rank.time_us(ours_call("all_reduce", rank.comm, inp), iters=max(3, iters // 4)) * 1e-6)
            out["all_reduce"] = sums
        return out if world.rank == 0 else None
    finally:
        shutdown()


LOADED_OPS = ("all_reduce", "reduce_scatter", "all_gather")  # what a dp gradient sync (ZeRO-1: the last two) runs


def loaded_collectives_rank(backend: str, iters: int, init_method: str | None = None) -> dict[str, list[float]] | None:
    """One of a node's ranks, paired with its neighbour (ranks 2i, 2i+1): every pair runs each of LOADED_OPS at once,
    as a step's dp gradient syncs do, at both LINK_SIZES (bytes of the whole buffer); rank 0 returns seconds a call
    ({op: [small, large]}, the median over ``iters`` calls, each after a barrier)."""
    import datetime
    import os

    from hal.collectives import init_distributed, shutdown, world_communicator

    os.environ.pop("HAL_ISLANDS", None)
    world = init_distributed(backend, init_method=init_method or os.environ.get("HAL_INIT_METHOD"),
                             timeout=datetime.timedelta(minutes=2))
    torch.set_num_threads(1)
    try:
        everyone = world_communicator(validate=False)
        pairs = [everyone.subgroup([r, r + 1], validate=False) for r in range(0, world.size - 1, 2)]
        mine = pairs[world.rank // 2] if world.rank // 2 < len(pairs) else None
        out: dict[str, list[float]] = {}
        for op in LOADED_OPS:
            out[op] = []
            for size in LINK_SIZES:
                full = torch.ones(size // 4, device=world.device)
                half = torch.ones(size // 8, device=world.device)
                calls = {"all_reduce": lambda: mine.all_reduce(full, "sum"), "reduce_scatter": lambda: mine.reduce_scatter(full, "sum"),
                         "all_gather": lambda: mine.all_gather(half)}
                times = []
                for _ in range(iters + 2):
                    everyone.barrier()
                    started = time.perf_counter()
                    if mine is not None:
                        calls[op]()
                    times.append(time.perf_counter() - started)
                out[op].append(statistics.median(times[2:]))
        return out if world.rank == 0 else None
    finally:
        shutdown()


def node_links_rank(backend: str, iters: int, loaded_iters: int) -> dict[str, Any] | None:
    """One of a node's ranks, one launch for what three would measure (each launch starts its processes and imports
    torch again: seconds apiece): ranks 0 and 1 time the link inside one island, then across the bridge, each in a
    world of their own; then every rank (from 2) joins the loaded collectives. Each world has its own store."""
    import os

    store = os.environ.get("HAL_INIT_METHOD", "")
    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out: dict[str, Any] = {}
    if rank < 2:  # link_rank's worlds are these two ranks (its world size is 2 whatever the launch's)
        for kind, bridged in (("island", False), ("bridge", True)):
            out[kind] = link_rank(backend, bridged, iters, f"{store}-{kind}")
    if size >= 2:
        out["loaded"] = loaded_collectives_rank(backend, loaded_iters, f"{store}-loaded")
    return out if rank == 0 else None


def measure_node_links(backend: str, ranks: int, launch: Callable[..., Any], iters: int = 20,
                       loaded_iters: int = 10) -> tuple[LinkProfile, LinkProfile, dict[str, tuple[float, float]] | None]:
    """The island link, the bridge link and (``ranks`` >= 2, an even count of them) the loaded dp-sync collectives of a
    node of ``backend`` ranks, in one launch (``node_links_rank``).

    Why the collectives loaded, and not derived from the P2P link: a gloo all-reduce is the ranks' own cpu work
    (copies, sums), and in a step every dp group of the node syncs at once; on this project's 2-core host the
    result is 2–3× the ring formula over the measured P2P bandwidth. One launch: three took 15.4 s on that host,
    one takes 5.9 s (2 ranks)."""
    import sys

    pairs = max(2, ranks - ranks % 2)
    run = launch(f"{__name__}:node_links_rank", pairs, {"backend": backend, "iters": iters, "loaded_iters": loaded_iters},
                 deadline_s=240, what=f"hal profile: links and dp-sync collectives on {pairs} {backend} ranks",
                 echo_stderr=sys.stderr, env={"HAL_BACKEND": backend})
    got = run.values[0]
    loaded = ({op: (float(a), float(b)) for op, (a, b) in got["loaded"].items()} if ranks >= 2 else None)
    return _link_profile(backend, False, got["island"], iters), _link_profile(backend, True, got["bridge"], iters), loaded


def measure_link(backend: str, bridged: bool, launch: Callable[..., Any], iters: int = 20) -> LinkProfile:
    """Latency and bandwidth of P2P between two ranks of ``backend`` (two islands when ``bridged``).

    ``launch``: ``hal.launch.run_function``, handed in by the command (the launcher sits above this floor)."""
    import sys

    run = launch(f"{__name__}:link_rank", 2, {"backend": backend, "bridged": bridged, "iters": iters},
                       deadline_s=120, what=f"hal profile: {'bridge' if bridged else 'island'} link", echo_stderr=sys.stderr,
                 env={"HAL_BACKEND": backend})
    return _link_profile(backend, bridged, run.values[0], iters)


def _link_profile(backend: str, bridged: bool, t: Mapping[str, float], iters: int) -> LinkProfile:
    """The link from rank 0's µs a broadcast at the two LINK_SIZES."""
    small, large = LINK_SIZES
    t_small, t_large = t[str(small)], t[str(large)]
    gbps = (large - small) / max(t_large - t_small, 1e-3) / 1e3
    kind = "bridge" if bridged else "island"
    sums = t.get("all_reduce") if bridged else None
    return LinkProfile(kind, backend, gbps, t_small, MEASURED,
                       f"broadcast between 2 ranks{' in two declared islands' if bridged else ''} (collectives.bench), "
                       f"{small} B and {large} B, {iters} iterations"
                       + (f"; all_reduce of {BRIDGE_SUM_SIZES[0]} B and {BRIDGE_SUM_SIZES[1]} B" if sums else ""),
                       loaded_collectives={"all_reduce": (float(sums[0]), float(sums[1]))} if sums else {},
                       loaded_sizes=BRIDGE_SUM_SIZES if sums else (0, 0))
