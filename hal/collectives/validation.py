"""Cross-rank checks before a collective: every rank learns what every other rank passed.

Each rank packs its call (op, sequence number, dtype, shape, device, reduce op, root) into a
small int64 vector and all-gathers it over the host (gloo) group, with the call's timeout. All
ranks then run the same pure check on the same data, so a mismatch raises the *same* error on
every rank instead of a hang or a wrong answer — and a rank that never arrives turns into a
timeout error on the ranks that did. An ``all_to_all`` where some rank passed split sizes adds a
second small all-gather of every rank's split lists (``agree_splits``), so bad splits on one rank
are the same named error on all of them. Turn it off (``validate=False``) on hot paths once a job
is known to be right; it costs one small host all-gather per call.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .errors import CollectiveError, CollectivePeerLost, CollectiveTimeout
from .failures import starting, wait_all

__all__ = [
    "CallSignature", "CollectiveError", "CollectivePeerLost", "CollectiveTimeout", "all_gather_single", "agree_splits",
    "check", "exchange", "exchange_split_rows", "reduce_scatter_single", "split_row",
]

# torch ≥ 2.13 names the single-tensor forms *_single; older releases only have the long names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

MAX_DIMS = 8
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "npu", "mlu", "xpu", "meta", "other")
OPS: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
    "barrier", "send", "recv",
)  # fmt: skip
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product")
SPLITS_IN, SPLITS_OUT = 1, 2  # CallSignature.splits: which all_to_all split lists a rank passed

# Which part of the shape must agree across ranks: all of it, or all but dim 0 (uneven splits).
_SAME_SHAPE = {"all_reduce", "reduce_scatter", "broadcast", "reduce", "gather", "scatter"}
_TRAILING_SHAPE = {"all_gather", "all_to_all"}


@dataclass(frozen=True)
class CallSignature:
    """What one rank passed to a collective, as every rank will see it."""

    op: str
    seq: int
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    device_type: str
    device_ok: bool
    reduce_op: str | None = None
    root: int = -1
    splits: int = 0  # all_to_all: SPLITS_IN | SPLITS_OUT for the split lists this rank passed

    def encode(self) -> torch.Tensor:
        if len(self.shape) > MAX_DIMS:
            raise CollectiveError(f"{self.op}: tensors with more than {MAX_DIMS} dims are not supported; reshape first")
        dims = list(self.shape) + [-1] * (MAX_DIMS - len(self.shape))
        dtype_code = -1 if self.dtype is None else _code(_DTYPES, self.dtype)
        device_code = _code(_DEVICE_TYPES, self.device_type if self.device_type in _DEVICE_TYPES else "other")
        values = [
            OPS.index(self.op), self.seq, dtype_code, len(self.shape), *dims, device_code, int(self.device_ok),
            -1 if self.reduce_op is None else REDUCE_OPS.index(self.reduce_op), self.root, self.splits,
        ]
        return torch.tensor(values, dtype=torch.int64)

    @staticmethod
    def decode(row: Sequence[int]) -> CallSignature:
        ndim = row[3]
        dims = tuple(int(d) for d in row[4 : 4 + ndim])
        rest = row[4 + MAX_DIMS :]
        return CallSignature(
            op=OPS[row[0]], seq=int(row[1]), dtype=None if row[2] < 0 else _DTYPES[row[2]], shape=dims,
            device_type=_DEVICE_TYPES[rest[0]], device_ok=bool(rest[1]),
            reduce_op=None if rest[2] < 0 else REDUCE_OPS[rest[2]], root=int(rest[3]), splits=int(rest[4]),
        )


def _code(table: tuple, value: object) -> int:
    try:
        return table.index(value)
    except ValueError:
        raise CollectiveError(f"{value} is not supported by hal collectives; use one of {', '.join(map(str, table))}") from None


def _fmt(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).replace("torch.", "")


def _ranks_where(signatures: Sequence[CallSignature], ranks: Sequence[int], pred: Callable[[CallSignature], bool]) -> str:
    return ", ".join(f"rank {r}" for r, s in zip(ranks, signatures) if pred(s))


def check(signatures: Sequence[CallSignature], ranks: Sequence[int], expected_device: str) -> None:
    """Raise the one error every rank agrees on, or return when the call is consistent."""
    first = signatures[0]
    op = first.op
    if any(s.op != op for s in signatures):
        calls = "; ".join(f"rank {r}: {s.op}" for r, s in zip(ranks, signatures))
        raise CollectiveError(f"ranks called different collectives ({calls}); every rank must make the same calls in the same order")
    if any(s.seq != first.seq for s in signatures):
        calls = "; ".join(f"rank {r}: call #{s.seq}" for r, s in zip(ranks, signatures))
        raise CollectiveError(f"{op}: ranks are at different calls ({calls}); a rank skipped or repeated a collective")
    bad = _ranks_where(signatures, ranks, lambda s: not s.device_ok)
    if bad:
        where = "; ".join(f"rank {r}: {s.device_type}" for r, s in zip(ranks, signatures) if not s.device_ok)
        raise CollectiveError(f"{op}: {bad} passed a tensor on the wrong device ({where}); each rank must pass tensors on its own "
                              "device (backend.device()) — move them with .to(device)")
    if any(s.dtype != first.dtype for s in signatures):
        seen = "; ".join(f"rank {r}: {_fmt(s.dtype)}" for r, s in zip(ranks, signatures))
        raise CollectiveError(f"{op}: dtype mismatch across ranks ({seen}); cast every rank's tensor to one dtype")
    shapes = "; ".join(f"rank {r}: {tuple(s.shape)}" for r, s in zip(ranks, signatures))
    if op in _SAME_SHAPE and any(s.shape != first.shape for s in signatures):
        raise CollectiveError(f"{op}: shape mismatch across ranks ({shapes}); every rank must pass the same shape")
    if op in _TRAILING_SHAPE and any(s.shape[1:] != first.shape[1:] or len(s.shape) != len(first.shape) for s in signatures):
        raise CollectiveError(f"{op}: shapes differ beyond dim 0 ({shapes}); only dim 0 may differ between ranks")
    if any(s.reduce_op != first.reduce_op for s in signatures):
        seen = "; ".join(f"rank {r}: {s.reduce_op}" for r, s in zip(ranks, signatures))
        raise CollectiveError(f"{op}: reduce op mismatch ({seen}); pass the same op on every rank")
    if any(s.root != first.root for s in signatures):
        seen = "; ".join(f"rank {r}: {s.root}" for r, s in zip(ranks, signatures))
        raise CollectiveError(f"{op}: root rank mismatch ({seen}); pass the same src/dst on every rank")
    if op == "reduce_scatter" and first.shape and first.shape[0] % len(ranks):
        raise CollectiveError(f"reduce_scatter: dim 0 ({first.shape[0]}) is not divisible by the group size {len(ranks)}; pad it")


def exchange(
    mine: CallSignature,
    group: dist.ProcessGroup | None,
    ranks: Sequence[int],
    timeout: datetime.timedelta,
    rank: int = -1,
) -> list[CallSignature]:
    """All-gather every rank's signature over the host group, bounded by ``timeout`` (``rank``: this rank, for messages)."""
    encoded = mine.encode()
    out = torch.empty(len(ranks) * encoded.numel(), dtype=torch.int64)
    _gather(out, encoded, group, ranks, timeout, f"{mine.op} (call #{mine.seq})", rank)
    rows = out.view(len(ranks), -1).tolist()
    return [CallSignature.decode(row) for row in rows]


def _gather(out: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup | None, ranks: Sequence[int],
            timeout: datetime.timedelta, what: str, rank: int) -> None:
    peers = [r for r in ranks if r != rank]
    with starting([group], timeout, what, peers, late="not every rank arrived"):
        work = all_gather_single(out, mine, group=group, async_op=True)
    wait_all([work], timeout, what, peers, late="not every rank arrived")


# --- all_to_all split sizes: every rank checks every rank's ---------------------------------------
def split_row(size: int, input_splits: Sequence[int] | None, output_splits: Sequence[int] | None) -> torch.Tensor:
    """This rank's split lists as one fixed-length row: for each, its length (-1: not passed) and its first ``size`` sizes."""
    row: list[int] = []
    for splits in (input_splits, output_splits):
        values = [] if splits is None else [int(v) for v in splits]
        row += [-1 if splits is None else len(values), *values[:size], *[0] * (size - min(size, len(values)))]
    return torch.tensor(row, dtype=torch.int64)


def exchange_split_rows(mine: torch.Tensor, group: dist.ProcessGroup | None, ranks: Sequence[int],
                        timeout: datetime.timedelta, what: str, rank: int = -1) -> list[list[int]]:
    """Every rank's ``split_row``, in rank order (a second small all-gather, only when some rank passed splits)."""
    out = torch.empty(len(ranks) * mine.numel(), dtype=torch.int64)
    _gather(out, mine, group, ranks, timeout, what, rank)
    return out.view(len(ranks), -1).tolist()


def _splits_of(row: Sequence[int], which: int, size: int) -> list[int] | None:
    """The input (0) or output (1) split list a rank passed, from its row; None if it passed none."""
    start = which * (size + 1)
    count = row[start]
    if count < 0:
        return None
    return list(row[start + 1 : start + 1 + min(count, size)])


def _shown(splits: list[int], count: int) -> str:
    return str(splits) if count == len(splits) else f"[{', '.join(map(str, splits))}, ...] ({count} sizes)"


def agree_splits(signatures: Sequence[CallSignature], rows: Sequence[Sequence[int]] | None, ranks: Sequence[int]) -> list[list[int]]:
    """The send matrix of an all_to_all (row i: what rank i sends to each rank), checked on every rank alike.

    ``rows`` are every rank's ``split_row`` (None when no rank passed splits: each sends equal
    slices). Every rank runs this on the same data, so a bad split list on one rank raises the
    same error, naming that rank, on all of them — before any data moves.
    """
    size = len(ranks)
    sends: list[list[int]] = []
    for i, (r, sig) in enumerate(zip(ranks, signatures)):
        if not sig.shape:
            raise CollectiveError(f"all_to_all: rank {r} passed a 0-d tensor; pass a tensor with a dim 0 to split")
        dim0 = sig.shape[0]
        given = None if rows is None else _splits_of(rows[i], 0, size)
        if given is None:
            if dim0 % size:
                raise CollectiveError(f"all_to_all: rank {r}'s dim 0 ({dim0}) is not divisible by the group size {size}; "
                                      f"pass input_splits on rank {r}")
            sends.append([dim0 // size] * size)
            continue
        count = rows[i][0]  # type: ignore[index]
        if count != size or min(given) < 0 or sum(given) != dim0:
            raise CollectiveError(
                f"all_to_all: rank {r}'s input_splits {_shown(given, count)} must be {size} non-negative sizes summing to "
                f"its dim 0 ({dim0}); fix input_splits on rank {r}"
            )
        sends.append(given)
    for j, r in enumerate(ranks):
        expected = _splits_of(rows[j], 1, size) if rows is not None else None
        if expected is None:
            continue
        count = rows[j][size + 1]  # type: ignore[index]
        column = [sends[i][j] for i in range(size)]
        if count != size or expected != column:
            raise CollectiveError(
                f"all_to_all: rank {r}'s output_splits {_shown(expected, count)} disagree with what the ranks send it "
                f"{column}; fix output_splits on rank {r} or leave them out to have them computed"
            )
    return sends
