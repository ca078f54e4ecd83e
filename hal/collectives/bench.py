"""The measurement library of ``hal bench collectives``: nccl-tests-style timings of hal's collective API
against raw torch.distributed, returned as data (the command — ranks, table, JSON — is ``hal/cli/bench.py``).

Each of N ranks (one per device on accelerators; started by hal.launch, joining through
``bench_in_world``) times, for every op × dtype × size, K iterations after W warm-ups twice on the same process group: through
``collectives.Communicator`` with
``validate=False`` ("ours") and through the plain ``torch.distributed`` call ("raw"). Validation
— the cross-rank check of every call — is a correctness feature with its own cost; it is off
here so the ratio shows what the API itself costs. Each timing is bracketed by a barrier and
``backend.synchronize()`` and measured with the backend's timing events; the reported time is
the average over ranks (as nccl-tests does).

Sizes, counts and bandwidths follow nccl-tests (https://github.com/NVIDIA/nccl-tests,
``src/*.cu`` and ``doc/PERFORMANCE.md``): ``size`` is the larger of one rank's send and
receive buffers — the buffer for all_reduce, broadcast and reduce, the gathered output for
all_gather (each rank sends size/n), the full input for reduce_scatter (each rank receives
size/n), one rank's whole send buffer for all_to_all (size/n to each peer). ``count`` is
size / element size; ``algbw = size / time``; ``busbw = algbw × factor(op, n)``.

Correctness, like nccl-tests' verifiable mode, is exact: after timing, each op runs once more
on freshly filled inputs and every element is compared bitwise against a reference computed
on the rank from the known inputs of all ranks (``#wrong`` counts mismatches over all ranks).
The rule that keeps every reduction exact in every dtype, in any summation order: inputs are
integers in 1..k with ``k = min(3, L // n)``, where L is the largest integer up to which every
integer is exactly representable (2^(mantissa bits + 1) for floats: 256 for bfloat16, 2048 for
float16; the maximum for integer types). Every partial sum of any subset of ranks is then an
integer ≤ k·n ≤ L, hence exact, whatever the count (the value depends on the element index
only through a modulus). A dtype whose L is below n cannot be checked exactly and is refused.
Data-movement ops (all_gather, all_to_all, broadcast) use 1 + (i + 7·rank) mod 61, which is
exact in every dtype and differs between ranks; 0 never is a right answer, and receive
buffers are zeroed before the check so an element nobody wrote counts as wrong.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import re
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from hal.errors import ConfigError, HalError

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")
REDUCING = frozenset({"all_reduce", "reduce_scatter", "reduce"})
SPLIT = frozenset({"all_gather", "reduce_scatter", "all_to_all"})  # size is n equal per-rank pieces
ROOT = 0  # broadcast source and reduce destination (nccl-tests' default root)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
}  # fmt: skip
NCCL_TESTS_PERFORMANCE = "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md"

# Bus-bandwidth correction factors, from nccl-tests doc/PERFORMANCE.md ("Summary"; NCCL_TESTS_PERFORMANCE):
# AllReduce 2(n-1)/n, ReduceScatter (n-1)/n, AllGather (n-1)/n, Broadcast 1, Reduce 1, AlltoAll (n-1)/n.
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}

MOVE_PERIOD = 61  # prime: rank patterns differ for ranks < 61 apart; values ≤ 61 are exact in every dtype above
CHECK_CHUNK = 1 << 24  # elements per reference chunk (bounds the check's temporary memory)
DEFAULT_SIZES = {"cpu": "8B..1MiB"}  # accelerators: 8B..1GiB
DEFAULT_CPU_RANKS = 2

OURS = "collectives.Communicator(validate=False)"
RAW = "torch.distributed on the same process group"
VALIDATION_NOTE = (
    "validation is off for 'ours': the cross-rank check of every call is a correctness feature with "
    "its own cost (one small host all-gather per call), not part of the collective"
)


class BenchFailed(HalError):
    """A rank of the benchmark crashed; the run produced no complete report."""


# --- arguments ------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MAX_SIZE = 16 << 30  # one message: above any link benchmark's need, below what a device holds world-size times over
ITERS_LIMIT = 1_000_000  # --iters / --warmup: beyond it a run outlives its user


def parse_size(text: str) -> int:
    """'8B', '64K', '1M', '1GiB' → bytes (K/M/G are powers of 1024, as in nccl-tests)."""
    match = _SIZE.match(text)
    if not match or int(match.group(1)) < 1:
        raise ConfigError(f"--sizes: {text!r} is not a size; use a positive number of bytes like 8B, 64K, 1M or 1GiB")
    size = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if size > MAX_SIZE:
        raise ConfigError(f"--sizes: {text!r} is above {MAX_SIZE >> 30} GiB, the largest buffer a benchmark allocates "
                          "(a gather holds world-size of them); give e.g. 8B..1GiB")
    return size


def parse_sizes(text: str) -> list[int]:
    """'MIN..MAX' → MIN, 2·MIN, 4·MIN, … up to MAX (a single size is a range of one)."""
    low_text, sep, high_text = text.partition("..")
    low = parse_size(low_text)
    high = parse_size(high_text) if sep else low
    if high < low:
        raise ConfigError(f"--sizes: {text!r} ends below where it starts; write MIN..MAX, e.g. 8B..1GiB")
    sizes = [low]
    while sizes[-1] * 2 <= high:
        sizes.append(sizes[-1] * 2)
    return sizes


def parse_choices(text: str | None, allowed: Sequence[str], flag: str, default: Sequence[str]) -> list[str]:
    """Comma-separated names from ``allowed`` ('all' for every one), in the order given."""
    if text is None:
        return list(default)
    names = [t.strip() for t in text.split(",")]
    if "" in names:
        raise ConfigError(f"{flag}: {text!r} has an empty name; use a comma-separated list of {', '.join(allowed)} "
                          "(or all), with no empty entries")
    if names == ["all"]:
        return list(allowed)
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ConfigError(f"{flag}: {', '.join(unknown) or repr(text)} is not allowed; use a comma-separated list of {', '.join(allowed)} (or all)")
    return list(dict.fromkeys(names))


def exact_int_limit(dtype: torch.dtype) -> int:
    """The largest L such that every integer in 0..L is exactly representable in ``dtype``."""
    if dtype.is_floating_point:
        return int(round(2 / torch.finfo(dtype).eps))  # eps = 2^-mantissa bits → 2^(mantissa bits + 1)
    return int(torch.iinfo(dtype).max)


def reduce_levels(dtype: torch.dtype, world_size: int) -> int:
    """k: reduction inputs are 1..k, so any partial sum over ``world_size`` ranks stays ≤ L (exact)."""
    return min(3, exact_int_limit(dtype) // world_size)


MIN_MEASURE_US = 25_000.0  # one timed loop lasts at least this long (more iterations for fast calls)
MAX_ITERS = 2_000

@dataclass(frozen=True)
class BenchPlan:
    """Everything the ranks need (picklable: names, not objects)."""

    backend: str
    world_size: int
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    ops: tuple[str, ...]
    iters: int
    warmup: int
    stream_table: bool = False  # the command shows table rows as they are measured (else one JSON document)
    rounds: int = 5  # ours and raw measured alternately this many times; the median is reported


def make_plan(
    *, backend: str | None, world_size: int | None, sizes: str | None, dtypes: str | None, ops: str | None,
    iters: int, warmup: int, stream_table: bool = False, rounds: int = 5,
) -> BenchPlan:
    """Check every argument before any rank starts; one HalError line otherwise."""
    from hal.config import load_config
    from hal.selection import choose_backend

    chosen = choose_backend(load_config(None, overrides={"backend": backend}).backend)[0]
    count = chosen.device_count()
    n = world_size if world_size is not None else (DEFAULT_CPU_RANKS if chosen.device_type == "cpu" else count)
    if n < 1:
        raise ConfigError(f"--world-size {n} is not a rank count; give 1 or more")
    if chosen.device_type != "cpu" and n > count:
        raise ConfigError(f"--world-size {n} but backend '{chosen.name}' has {count} device(s); use {count} or less (one rank per device)")
    if not (1 <= iters <= ITERS_LIMIT and 0 <= warmup <= ITERS_LIMIT):
        raise ConfigError(f"--iters {iters} / --warmup {warmup}: give 1 to {ITERS_LIMIT:,} timed iterations and 0 to "
                          f"{ITERS_LIMIT:,} warm-ups")
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: give at least 1 round")
    size_list = parse_sizes(sizes if sizes is not None else DEFAULT_SIZES.get(chosen.device_type, "8B..1GiB"))
    dtype_list = parse_choices(dtypes, list(DTYPES), "--dtype", ["float32"])
    widest = max(dtype_list, key=lambda name: torch.empty((), dtype=DTYPES[name]).element_size())
    width = torch.empty((), dtype=DTYPES[widest]).element_size()
    if size_list[0] % width:  # the doubling sizes after it are whole elements when it is
        raise ConfigError(f"--sizes: {size_list[0]} B is not a whole number of {widest} elements ({width} B each); "
                          f"start at a multiple of {width} B, e.g. {max(width, size_list[0] // width * width)}B")
    op_list = parse_choices(ops, OPS, "--ops", OPS)
    if REDUCING & set(op_list):
        for name in dtype_list:
            if reduce_levels(DTYPES[name], n) < 1:
                raise ConfigError(
                    f"--dtype {name}: a sum over {n} ranks cannot be checked exactly in {name} (exact integers only up to "
                    f"{exact_int_limit(DTYPES[name])}); use a wider dtype or fewer ranks"
                )
    return BenchPlan(chosen.name, n, tuple(size_list), tuple(dtype_list), tuple(op_list), iters, warmup, stream_table, rounds)


# --- sizes, inputs and the exact reference ------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One measurement's buffers, in nccl-tests' convention (see the module docstring)."""

    size: int  # bytes: algbw = size / time
    count: int  # elements in ``size``
    numel_in: int  # one rank's input elements
    numel_out: int  # one rank's output elements


def shape_for(op: str, size: int, element_size: int, world_size: int) -> Shape:
    """The buffers for ``size`` bytes; split ops round down to equal per-rank pieces (≥ 1 element)."""
    count = max(1, size // element_size)
    numel_in = numel_out = count
    if op in SPLIT:
        piece = max(1, count // world_size)
        count = piece * world_size
        numel_in = piece if op == "all_gather" else count
        numel_out = piece if op == "reduce_scatter" else count
    return Shape(count * element_size, count, numel_in, numel_out)


def input_values(op: str, rank: int | torch.Tensor, index: torch.Tensor, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The int64 values rank ``rank`` puts at flat ``index`` of its input (see the exactness rule)."""
    if op in REDUCING:
        return 1 + (index + rank) % reduce_levels(dtype, world_size)
    return 1 + (index + 7 * rank) % MOVE_PERIOD


def expected_values(op: str, rank: int, world_size: int, dtype: torch.dtype, index: torch.Tensor, piece: int) -> torch.Tensor:
    """What rank ``rank`` must hold at flat output ``index``, from every rank's known input (int64).

    ``piece`` is the per-rank piece for split ops (the output's numel for reduce_scatter, the
    output's numel / n for all_gather and all_to_all).
    """
    if op in ("all_reduce", "reduce"):
        return sum(input_values(op, r, index, world_size, dtype) for r in range(world_size))  # type: ignore[return-value]
    if op == "reduce_scatter":
        return sum(input_values(op, r, rank * piece + index, world_size, dtype) for r in range(world_size))  # type: ignore[return-value]
    if op == "broadcast":
        return input_values(op, ROOT, index, world_size, dtype)
    source, offset = index // piece, index % piece
    if op == "all_gather":
        return input_values(op, source, offset, world_size, dtype)
    if op == "all_to_all":  # rank ``source`` sent us its piece number ``rank``
        return input_values(op, source, rank * piece + offset, world_size, dtype)
    raise ValueError(f"unknown op {op!r}")


def _chunks(numel: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, CHECK_CHUNK):
        yield start, min(numel, start + CHECK_CHUNK)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fill_input(tensor: torch.Tensor, op: str, rank: int, world_size: int) -> torch.Tensor:
    """Write this rank's input pattern (broadcast receivers start from zeros: never a right answer)."""
    flat = tensor.view(-1)
    if op == "broadcast" and rank != ROOT:
        return tensor.zero_()
    for start, stop in _chunks(flat.numel()):
        index = torch.arange(start, stop, dtype=torch.int64, device=flat.device)
        flat[start:stop] = input_values(op, rank, index, world_size, flat.dtype).to(flat.dtype)
    return tensor


def count_wrong(op: str, result: torch.Tensor, *, rank: int, world_size: int) -> int:
    """Elements of ``result`` (this rank's output of ``op``) that differ bitwise from the exact reference."""
    if op == "reduce" and rank != ROOT:
        return 0  # only the root's result is defined
    flat = result.reshape(-1)
    piece = flat.numel() if op == "reduce_scatter" else max(1, flat.numel() // world_size)
    bits = _SAME_WIDTH_INT[flat.element_size()]
    wrong = 0
    for start, stop in _chunks(flat.numel()):
        index = torch.arange(start, stop, dtype=torch.int64, device=flat.device)
        want = expected_values(op, rank, world_size, flat.dtype, index, piece).to(flat.dtype)
        wrong += int((flat[start:stop].view(bits) != want.view(bits)).sum().item())
    return wrong


def bandwidths(op: str, size: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes/s), nccl-tests' definitions."""
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * BUS_FACTORS[op](world_size)


# --- the two implementations ----------------------------------------------------------------------------


def ours_call(op: str, comm: Any, inp: torch.Tensor, out: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """One call of ``op`` through hal's Communicator (preallocated output, as raw); returns the result."""
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "all_reduce": lambda: comm.all_reduce(inp),
        "all_gather": lambda: comm.all_gather(inp, out=out),
        "reduce_scatter": lambda: comm.reduce_scatter(inp, out=out),
        "all_to_all": lambda: comm.all_to_all(inp, out=out),
        "broadcast": lambda: comm.broadcast(inp, src=ROOT),
        "reduce": lambda: comm.reduce(inp, dst=ROOT),
    }
    return calls[op]


def raw_call(op: str, group: Any, inp: torch.Tensor, out: torch.Tensor | None) -> Callable[[], torch.Tensor]:
    """One call of ``op`` straight through torch.distributed (preallocated output); returns the result."""
    import torch.distributed as dist

    from .validation import all_gather_single, reduce_scatter_single

    def run(fn: Callable[[], Any], result: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: (fn(), result)[1]

    calls: dict[str, Callable[[], torch.Tensor]] = {
        "all_reduce": run(lambda: dist.all_reduce(inp, group=group), inp),
        "broadcast": run(lambda: dist.broadcast(inp, src=ROOT, group=group), inp),
        "reduce": run(lambda: dist.reduce(inp, dst=ROOT, group=group), inp),
    }
    if out is not None:
        calls["all_gather"] = run(lambda: all_gather_single(out, inp, group=group), out)
        calls["reduce_scatter"] = run(lambda: reduce_scatter_single(out, inp, group=group), out)
        calls["all_to_all"] = run(lambda: dist.all_to_all_single(out, inp, group=group), out)
    return calls[op]


# --- one rank --------------------------------------------------------------------------------------------


@dataclass
class BenchRank:
    """What a rank measures with: its world, the communicator, and the backend's timing primitives."""

    world: Any
    comm: Any
    plan: BenchPlan

    @property
    def backend(self) -> Any:
        return self.world.backend

    def time_us(self, call: Callable[[], torch.Tensor], iters: int | None = None) -> float:
        """Average µs per call over ``iters`` after ``warmup``: device idle and ranks aligned before timing."""
        iters = iters or self.plan.iters
        for _ in range(self.plan.warmup):
            call()
        self.backend.synchronize()
        self.comm.barrier()
        start, end = self.backend.Event(enable_timing=True), self.backend.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        self.backend.synchronize()
        return float(start.elapsed_time(end)) * 1e3 / iters

    def iterations_for(self, call: Callable[[], torch.Tensor]) -> int:
        """``--iters`` or more, so one measurement lasts ≥ MIN_MEASURE_US (short ones are mostly jitter).

        Every rank must loop the same number of times: the largest choice across ranks wins.
        """
        import torch.distributed as dist

        probe = self.time_us(call)
        wanted = max(self.plan.iters, min(MAX_ITERS, math.ceil(MIN_MEASURE_US / max(probe, 1e-3))))
        agreed = torch.tensor([wanted], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.comm.layout.host_group)
        return int(agreed.item())

    def check(self, op: str, call: Callable[[], torch.Tensor], inp: torch.Tensor, out: torch.Tensor | None) -> int:
        """Run ``op`` once on fresh inputs (zeroed receive buffer) and count wrong elements here."""
        fill_input(inp, op, self.world.rank, self.world.size)
        if out is not None:
            out.zero_()
        result = call()
        self.backend.synchronize()
        return count_wrong(op, result, rank=self.world.rank, world_size=self.world.size)

    def measure(self, op: str, dtype: torch.dtype, shape: Shape) -> dict[str, Any]:
        """Ours and raw for one op/dtype/size: times averaged over ranks, wrong elements summed."""
        import torch.distributed as dist

        device = self.world.device
        inp = torch.empty(shape.numel_in, dtype=dtype, device=device)
        out = torch.empty(shape.numel_out, dtype=dtype, device=device) if op in SPLIT else None
        ours = ours_call(op, self.comm, inp, out)
        raw = raw_call(op, self.comm.native_group, inp, out)
        fill_input(inp, op, self.world.rank, self.world.size)
        # Alternate which side goes first, round by round, and keep the median of each side:
        # one measurement of a large collective varies by several percent from run to run.
        times: dict[str, list[float]] = {"ours": [], "raw": []}
        iters = self.iterations_for(raw)
        for round_index in range(self.plan.rounds):
            order = ("ours", "raw") if round_index % 2 == 0 else ("raw", "ours")
            for side in order:
                times[side].append(self.time_us(ours if side == "ours" else raw, iters))
        t_ours, t_raw = statistics.median(times["ours"]), statistics.median(times["raw"])
        wrong_ours = self.check(op, ours, inp, out)
        fill_input(inp, op, self.world.rank, self.world.size)
        wrong_raw = self.check(op, raw, inp, out)
        stats = torch.tensor([t_ours, t_raw, wrong_ours, wrong_raw], dtype=torch.float64)
        dist.all_reduce(stats, group=self.comm.layout.host_group)
        n = self.world.size
        return _row(op, dtype, shape, n, stats[0].item() / n, stats[1].item() / n, int(stats[2].item()), int(stats[3].item()))


def _row(op: str, dtype: torch.dtype, shape: Shape, n: int, t_ours: float, t_raw: float, w_ours: int, w_raw: int) -> dict[str, Any]:
    def side(t_us: float, wrong: int) -> dict[str, Any]:
        algbw, busbw = bandwidths(op, shape.size, t_us / 1e6, n)
        return {"time_us": t_us, "algbw_gbps": algbw, "busbw_gbps": busbw, "wrong": wrong}

    # busbw ours/raw: same size and factor on both sides, so it is raw time / our time (defined for n = 1 too).
    ratio = t_raw / t_ours if t_ours > 0 else None
    return {
        "op": op, "dtype": _name(dtype), "size": shape.size, "count": shape.count,
        "ours": side(t_ours, w_ours), "raw": side(t_raw, w_raw), "busbw_ratio": ratio,
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _header(rank: BenchRank) -> dict[str, Any]:
    import torch.distributed as dist

    world, backend = rank.world, rank.backend
    mine = f"{world.device} {backend.device_name(world.device.index or 0)}"
    names: list[Any] = [None] * world.size
    dist.all_gather_object(names, mine)
    plan = rank.plan
    return {
        "tool": "hal bench collectives",
        "backend": backend.name, "ccl": backend.ccl, "process_group_backend": backend.process_group_backend(),
        "world_size": world.size, "devices": [f"rank {i}: {n}" for i, n in enumerate(names)],
        "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
        "ops": list(plan.ops), "dtypes": list(plan.dtypes), "sizes": list(plan.sizes),
        "iters": plan.iters, "warmup": plan.warmup, "rounds": plan.rounds, "root": ROOT,
        "ours": OURS, "raw": RAW, "validation": VALIDATION_NOTE,
        "time": "µs per call: mean over max(iters, enough for 25 ms), median over rounds (ours and raw alternate), averaged over ranks; "
                "backend events after synchronize + barrier",
        "size_convention": "nccl-tests: larger of one rank's send/receive buffer; algbw = size/time (GB/s = 1e9 B/s)",
        "bus_factors": {op: BUS_FACTORS[op](world.size) for op in plan.ops}, "bus_factor_source": NCCL_TESTS_PERFORMANCE,
        "check": "exact, bitwise, every element, after timing; reduction inputs in 1..min(3, L//n), L = largest exact integer",
    }


def _points(plan: BenchPlan, op: str, dtype: torch.dtype) -> list[Shape]:
    """This op's distinct shapes (tiny sizes can round to the same buffers for split ops)."""
    shapes: dict[int, Shape] = {}
    for size in plan.sizes:
        shape = shape_for(op, size, torch.empty((), dtype=dtype).element_size(), plan.world_size)
        shapes.setdefault(shape.size, shape)
    return list(shapes.values())


Progress = Callable[[int, int, str, str, list[Shape]], None]  # (number, of, op, dtype name, shapes)


def run_bench_rank(
    rank: BenchRank,
    *,
    on_header: Callable[[dict[str, Any]], None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    on_progress: Progress | None = None,
) -> dict[str, Any]:
    """Time and check every (op, dtype, size) of ``rank.plan`` on this rank (``hal bench collectives``, conformance).

    The callbacks see the header, each row and each op/dtype's start as they come (the command
    streams its table with them); the result is the whole report.
    """
    plan = rank.plan
    header = _header(rank)
    if on_header:
        on_header(header)
    rows: list[dict[str, Any]] = []
    combos = [(op, name) for op in plan.ops for name in plan.dtypes]
    for number, (op, name) in enumerate(combos, 1):
        points = _points(plan, op, DTYPES[name])
        if on_progress:
            on_progress(number, len(combos), op, name, points)
        for shape in points:
            row = rank.measure(op, DTYPES[name], shape)
            rows.append(row)
            if on_row:
                on_row(row)
    return {"header": header, "rows": rows, "correct": all(r["ours"]["wrong"] == 0 and r["raw"]["wrong"] == 0 for r in rows)}


def bench_in_world(
    plan: BenchPlan,
    *,
    on_header: Callable[[dict[str, Any]], None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    on_progress: Progress | None = None,
) -> dict[str, Any] | None:
    """One launched rank (RANK, WORLD_SIZE, LOCAL_RANK and HAL_INIT_METHOD from its launcher): join, measure, leave.

    Rank 0 returns the report, the others None.
    """
    os.environ.pop("HAL_ISLANDS", None)  # the benchmark measures one native group, not the bridge
    from . import init_distributed, shutdown, world_communicator

    world = init_distributed(
        plan.backend, init_method=os.environ.get("HAL_INIT_METHOD"), world_size=plan.world_size,
        timeout=datetime.timedelta(minutes=10),
    )
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # N ranks share the host: one compute thread each (torchrun's default)
    try:
        report = run_bench_rank(
            BenchRank(world, world_communicator(validate=False), plan), on_header=on_header, on_row=on_row, on_progress=on_progress,
        )
    finally:
        shutdown()
    return report if world.rank == 0 else None
