"""Collective correctness checks: what each check sends, what every rank must get back, and the verdict.

Both sides use this module. The suite (the parent) lists the checks and decides, from capability
data alone, which ones the backend's CCL cannot run (``plan_checks``, ``not_runnable``); every rank
of the one collectives job runs them all (``conformance.jobs.collective_job``) and returns a verdict per check,
which the suite merges over ranks (``merge_ranks``).

Inputs and verdicts:

- ``int`` inputs (reductions): small integers (``collectives.bench``'s rule: 1..k with k·n below
  the dtype's largest exact integer; products use 1..2), so every partial result is exact in any
  summation order. The result must equal the exact answer **bitwise** (metric ``mismatches``) —
  except ``avg``, whose division rounds (NCCL may even pre-divide every input), judged like
  random inputs.
- ``random`` inputs (float reductions): sums, averages and products of positive floats in
  [0.5, 1.5) (no cancellation, so a relative bound means something), max/min of normal floats
  (exact whatever the order: bitwise). Judged against the float64 result of the same rounded
  inputs with ``conformance.verdicts.tolerances`` (category ``reduction``, K = world size). A reduction of
  K terms rounds up to K-1 times (K for avg), so its relative error can reach Higham's
  γ_(K-1) = (K-1)u/(1-(K-1)u); where that exceeds the table's rtol (fp16 at K ≥ 4, bf16 at
  K ≥ 6) the bound is widened to it through ``tolerances.override``, with the reason stored.
- Data movement (gathers, all_to_all, broadcast, scatter, send/recv): random values, bitwise.

Two probes look at the failure modes behind real vendor bugs: ``determinism`` (the same float
all_reduce repeated must be bitwise identical) and ``size_sweep`` (the same block of values
reduced inside messages of different sizes must stay within tolerance; whether it is bitwise the
same across sizes is reported as a metric — RCCL once gave bf16 sums that depended on size).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from hal.conformance.verdicts.tolerances import Tolerance, dtype_name, judge, override, tolerance_for

if TYPE_CHECKING:
    from hal.backend import Backend

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
    "int64": torch.int64,
}  # fmt: skip
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product")
MOVEMENT: tuple[str, ...] = (
    "all_gather", "all_gather_uneven", "all_to_all", "all_to_all_uneven", "all_to_all_skewed", "broadcast", "gather",
    "scatter", "send_recv", "batch_p2p_ring",
)  # fmt: skip
PROBE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
MOE_DISPATCH = ("all to all with skewed splits, as an MoE dispatch makes them: the last rank receives most of every "
                "rank's rows, rank 0 receives none (zero-length pieces both ways); bitwise")
PIECE = 257  # elements per rank piece (prime: no accidental alignment with CCL chunk sizes)
NUMEL = 1031  # elements of a whole-tensor check (odd, prime)
SWEEP_BLOCK = 1024
REPEATS = 5
# The Communicator op(s) a check calls, for CCL-gap lookups.
_CCL_OPS: dict[str, tuple[str, ...]] = {
    "all_gather_uneven": ("all_gather",), "all_to_all_uneven": ("all_to_all",), "all_to_all_skewed": ("all_to_all",), "send_recv": ("send", "recv"),
    "batch_p2p_ring": ("send", "recv"), "determinism": ("all_reduce",), "size_sweep": ("all_reduce",),
    "reduction_probe": ("all_reduce",),
}  # fmt: skip


@dataclass(frozen=True)
class Check:
    """One collective check; ``name`` is unique within a world size (the case adds ``/world<n>``)."""

    name: str
    op: str  # a Communicator method, or "determinism" / "size_sweep"
    dtype: str
    reduce_op: str | None = None
    inputs: str = "random"  # "int" (order-invariant integers, bitwise) | "random"
    description: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def ccl_ops(self) -> tuple[str, ...]:
        return _CCL_OPS.get(self.op, (self.op,))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- which checks, and which of them cannot run --------------------------------------------------------


def plan_checks(dtypes: Sequence[str]) -> list[Check]:
    """Every check for ``dtypes`` (names in DTYPES), in a fixed order."""
    checks: list[Check] = []
    for d in dtypes:
        is_float = DTYPES[d].is_floating_point
        for op in REDUCE_OPS:
            if op == "avg" and not is_float:
                continue  # hal refuses integer avg (not exact) by design
            checks.append(Check(f"all_reduce/{op}/{d}/int", "all_reduce", d, op, "int",
                                f"all_reduce {op} of small integers: exact in any order, compared bitwise"
                                if op != "avg" else "all_reduce avg of small integers: the division rounds, within tolerance"))
            if is_float and d != "float64":
                checks.append(Check(f"all_reduce/{op}/{d}/random", "all_reduce", d, op, "random",
                                    f"all_reduce {op} of random floats against the float64 result"))
        checks.append(Check(f"reduce_scatter/sum/{d}/int", "reduce_scatter", d, "sum", "int", "reduce_scatter sum, exact integers"))
        if is_float and d != "float64":
            checks.append(Check(f"reduce_scatter/sum/{d}/random", "reduce_scatter", d, "sum", "random",
                                "reduce_scatter sum of random floats against the float64 result"))
        checks.append(Check(f"reduce/sum/{d}/int", "reduce", d, "sum", "int", "reduce sum to the last rank, exact integers"))
        for op in MOVEMENT:
            what = (MOE_DISPATCH if op == "all_to_all_skewed" else f"{op.replace('_', ' ')}: data movement, bitwise")
            checks.append(Check(f"{op}/{d}", op, d, None, "random", what))
    for d in dtypes:
        if d in PROBE_DTYPES:
            checks.append(Check(f"determinism/all_reduce/{d}", "determinism", d, "sum", "random",
                                f"the same all_reduce sum repeated {REPEATS} times gives bitwise identical results"))
            checks.append(Check(f"size_sweep/all_reduce/{d}", "size_sweep", d, "sum", "random",
                                "the same values reduced inside messages of different sizes agree"))
        if d in PROBE_DTYPES or d == "float16":
            checks.append(Check(f"reduction_probe/all_reduce/{d}", "reduction_probe", d, "sum", "probe",
                                "how the library sums: its result set bitwise beside models of the sum (the float64 sum "
                                "rounded once, rank order rounded at every hop, reverse order, a pairwise tree, a ring)"))
    return checks


def int_levels(check: Check, world_size: int) -> int:
    """Inputs are 1..k: k for this reduction so that every partial result is an exact integer (0: impossible)."""
    from hal.collectives.bench import exact_int_limit

    limit = exact_int_limit(check.torch_dtype)
    if check.reduce_op == "product":
        return 2 if 2 ** math.ceil(world_size / 2) <= limit else 0
    return min(3, limit // world_size)


def not_runnable(backend: Backend, check: Check, world_size: int) -> tuple[str, str] | None:
    """("unsupported" | "skip", reason) when the check cannot run on this backend's CCL, else None."""
    from hal.collectives.communicator import find_gap

    for op in check.ccl_ops:
        gap = find_gap(backend, op, check.torch_dtype, check.reduce_op)
        if gap is not None:
            how = "hal stages it through host gloo" if gap.handling == "host" else "hal refuses it"
            return "unsupported", f"{backend.ccl} cannot do {gap.op or op} on {check.dtype} ({gap.source}); {how}"
    if check.reduce_op and check.reduce_op != "avg" and check.reduce_op not in backend.ccl_reduce_ops:
        return "unsupported", f"{backend.ccl} has no {check.reduce_op} reduction (it has {', '.join(sorted(backend.ccl_reduce_ops))})"
    if check.inputs == "int" and check.reduce_op and int_levels(check, world_size) < 1:
        return "skip", f"a {check.reduce_op} over {world_size} ranks cannot stay exact in {check.dtype}"
    return None


def reduction_tolerance(dtype: torch.dtype, world_size: int, reduce_op: str) -> Tolerance:
    """The table's reduction bound (K = world size), widened to Higham's γ where K roundings exceed it."""
    tol = tolerance_for("reduction", dtype, k=world_size)
    if not dtype.is_floating_point or reduce_op in ("max", "min"):
        return tolerance_for("exact", dtype)
    roundings = world_size - 1 + (1 if reduce_op == "avg" else 0)
    u = torch.finfo(dtype).eps / 2
    gamma = roundings * u / (1 - roundings * u) if roundings else 0.0
    if gamma > tol.rtol:
        return override(tol, f"a {reduce_op} over {world_size} ranks rounds up to {roundings} times in {dtype_name(dtype)}: "
                             f"relative error up to Higham's gamma_{roundings} = {gamma:.3g} on positive inputs", rtol=gamma)
    return tol


# --- inputs and exact references (every rank regenerates every rank's inputs) ----------------------------


def _generator(seed: int, *parts: object) -> torch.Generator:
    digest = hashlib.sha256("/".join(str(p) for p in (seed, *parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def inputs(check: Check, rank: int, shape: tuple[int, ...], world_size: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input for ``check`` on the host, already rounded to the check's dtype."""
    dtype = check.torch_dtype
    g = _generator(seed, check.name, rank)
    numel = math.prod(shape)
    if check.inputs == "int":
        k = int_levels(check, world_size)
        index = torch.arange(numel)
        return (1 + (index + rank) % k).to(dtype).view(shape)
    if not dtype.is_floating_point:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64).to(dtype)
    if check.reduce_op in ("sum", "avg", "product"):
        return (0.5 + torch.rand(shape, generator=g, dtype=torch.float64)).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


PROBE_NUMEL = 4096  # elements of the reduction probe (one chunk of a ring per rank: numel divides by 1, 2, 4, 8)


def probe_inputs(check: Check, rank: int, world_size: int, seed: int) -> torch.Tensor:
    """The reduction probe's values: random signs and magnitudes spread over 2^-8..2^8, so a sum's rounding depends on
    its order and on the width it accumulates in — the models below disagree on most elements."""
    g = _generator(seed, check.name, rank)
    mantissa = torch.randn(PROBE_NUMEL, generator=g, dtype=torch.float64)
    scale = torch.exp2(torch.randint(-8, 9, (PROBE_NUMEL,), generator=g).to(torch.float64))
    return (mantissa * scale).to(check.torch_dtype)


def _in_order(xs: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    """Σ in ``order``, every partial sum rounded to the inputs' dtype (a hop of a library that reduces in it)."""
    acc = xs[order[0]].clone()
    for r in order[1:]:
        acc = acc + xs[r]
    return acc


def _pairwise(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    level = list(xs)
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0]


def reduction_models(xs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an all_reduce sum of ``xs`` (one tensor a rank, in their dtype) gives under each model of a library's sum."""
    n, dtype = len(xs), xs[0].dtype
    models = {
        "wide_once": torch.stack([x.double() for x in xs]).sum(0).to(dtype),
        "rank_order": _in_order(xs, list(range(n))),
        "reverse_order": _in_order(xs, list(range(n - 1, -1, -1))),
        "pairwise": _pairwise(xs),
    }
    chunks = torch.arange(xs[0].numel()).chunk(n)
    for step in (1, -1):  # a ring: chunk c's sum starts at rank c + k and goes round in one direction
        for k in range(n):
            ring = torch.empty_like(xs[0])
            for c, chunk in enumerate(chunks):
                ring[chunk] = _in_order([x[chunk] for x in xs], [(c + k + step * j) % n for j in range(n)])
            models[f"ring{'+' if step > 0 else '-'}{k}"] = ring
    return models


MODEL_WORDS = {
    "wide_once": "accumulates wider than the dtype and rounds once (bitwise the float64 sum, rounded)",
    "rank_order": "rounds every partial sum to the dtype, adding in rank order",
    "reverse_order": "rounds every partial sum to the dtype, adding in reverse rank order",
    "pairwise": "rounds every partial sum to the dtype, adding as a pairwise tree",
}


ACCUMULATION_WORDS = {"dtype": "rounding every partial sum to the dtype", "wide": "in a wider accumulator, rounded once"}


def accumulation_kind(model: str) -> str:
    """The kind of accumulation a model of ``reduction_models`` is: "wide" (rounded once) or "dtype" (every partial sum)."""
    return "wide" if model == "wide_once" else "dtype"


def model_words(name: str) -> str:
    """What a model of ``reduction_models`` says about the library."""
    if name.startswith("ring"):
        way = "up" if name[4] == "+" else "down"
        return (f"rounds every partial sum to the dtype, in ring order (chunk c of n summed from rank c + {name[5:]}, "
                f"going {way} the ranks)")
    return MODEL_WORDS[name]


def classify(got: torch.Tensor, xs: Sequence[torch.Tensor]) -> tuple[list[str], dict[str, float]]:
    """Each model's share of elements bitwise equal to ``got``, and the models all of them match ([]: none does; several:
    the inputs cannot tell them apart, as with 2 ranks, where every model is one addition)."""
    shares = {name: float((bits_of(model) == bits_of(got)).double().mean()) for name, model in reduction_models(xs).items()}
    return [name for name, share in shares.items() if share == 1.0], shares


def describe(models: list[str], shares: dict[str, float]) -> str:
    """One line: which model the library's sum is, bitwise."""
    if len(models) == 1:
        return model_words(models[0])
    if len(models) == len(shares):
        return "every model gives the same bits on these inputs (one addition, or no rounding): not told apart"
    if models:
        return "bitwise " + " = ".join(models) + " (these inputs do not tell them apart)"
    best = sorted(shares.items(), key=lambda kv: -kv[1])[:2]
    return "matches none of the models bitwise (closest: " + ", ".join(f"{n} {s:.1%}" for n, s in best) + ")"


UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def summation_bound(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per element, how far any order of rounded additions may land from the exact sum: (n - 1)·u·Σ|x| + u·|Σx|
    (recursive summation, Higham), u the dtype's unit roundoff — the probe's inputs cancel, so an elementwise
    relative bound does not apply."""
    u = UNIT_ROUNDOFF[xs[0].dtype]
    stacked = torch.stack([x.double() for x in xs])
    return (len(xs) - 1) * u * stacked.abs().sum(0) + u * stacked.sum(0).abs()


def reduce_exact(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """The float64 (or int64) result of reducing ``tensors`` elementwise — the reference."""
    wide = torch.float64 if tensors[0].is_floating_point() else torch.int64
    stacked = torch.stack([t.to(wide) for t in tensors])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0).double() / len(tensors)
    if op == "max":
        return stacked.max(0).values
    if op == "min":
        return stacked.min(0).values
    if op == "product":
        return stacked.prod(0)
    raise ValueError(f"unknown reduce op {op!r}")


# --- verdicts on one rank --------------------------------------------------------------------------------

RankVerdict = dict[str, Any]  # {"status", "metrics", "tolerance", "failed_metric", "reason", "data"}


def make_verdict(status: str, metrics: dict[str, float] | None = None, tolerance: dict[str, Any] | None = None,
             failed_metric: str | None = None, reason: str = "", data: dict[str, Any] | None = None) -> RankVerdict:
    return {"status": status, "metrics": metrics or {}, "tolerance": tolerance or {}, "failed_metric": failed_metric,
            "reason": reason, "data": data or {}}


def bits_of(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> RankVerdict:
    """Exact comparison: ``expected`` is rounded to ``actual``'s dtype, then compared bit for bit."""
    actual = actual.detach().cpu()
    if tuple(actual.shape) != tuple(expected.shape):
        return make_verdict("fail", {"mismatches": float(max(actual.numel(), expected.numel()))}, {"mismatches": 0.0}, "shape",
                        f"{what}shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    want = expected.to(actual.dtype)
    wrong = bits_of(actual) != bits_of(want)
    count = int(wrong.sum())
    metrics = {"mismatches": float(count), "elements": float(actual.numel())}
    tolerance = {"mismatches": 0.0, "category": "exact"}
    if count == 0:
        return make_verdict("pass", metrics, tolerance)
    first = int(wrong.reshape(-1).nonzero()[0])
    got, exp = actual.reshape(-1)[first].item(), want.reshape(-1)[first].item()
    return make_verdict("fail", metrics, tolerance, "mismatches",
                    f"{what}{count} of {actual.numel()} elements differ bitwise from the exact result (first at {first}: got {got:g}, want {exp:g})")


def within(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str = "") -> RankVerdict:
    """Tolerance comparison against the float64 reference (``conformance.verdicts.tolerances.judge``)."""
    verdict = judge(actual.detach().cpu(), expected, tol, actual.dtype)
    bounds: dict[str, Any] = {**tol.to_dict(), "tol_ratio": 1.0}
    if verdict.passed:
        return make_verdict("pass", verdict.metrics, bounds)
    return make_verdict("fail", verdict.metrics, bounds, verdict.failed_metric, what + verdict.reason)


# --- merging the ranks' verdicts (the parent) ----------------------------------------------------------------

_SUMMED = frozenset({"mismatches", "elements", "nondeterministic_elements"})
_LOWEST = frozenset({"cosine", "bitwise_equal_across_sizes"})
_SAME = frozenset({"repeats", "sizes"})


def merge_ranks(verdicts: Sequence[RankVerdict | None]) -> RankVerdict:
    """One verdict from every rank's: the first error or failure decides; metrics are the worst over ranks."""
    seen = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if not seen:
        return make_verdict("error", reason="no rank compared a result")
    metrics: dict[str, float] = {}
    for _, v in seen:
        for key, value in v["metrics"].items():
            if key not in metrics:
                metrics[key] = value
            elif key in _SUMMED:
                metrics[key] += value
            elif key in _LOWEST or key.startswith("matches_"):  # a probe's bitwise shares: the worst rank's
                metrics[key] = min(metrics[key], value)
            elif key not in _SAME:
                metrics[key] = max(metrics[key], value)
    for status in ("error", "fail"):
        bad = [(r, v) for r, v in seen if v["status"] == status]
        if bad:
            rank, v = bad[0]
            others = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
            return {**v, "metrics": metrics, "reason": f"rank {rank}: {v['reason']}{others}"}
    return {**seen[0][1], "metrics": metrics}
