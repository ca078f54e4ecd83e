"""Which (op, dtype) pairs a survey runs, and the digest that pins them so two surveys can be compared.

The ops are PyTorch's own OpInfo database (``torch.testing._internal.common_methods_invocations.op_db``), the one
vendors run through ``instantiate_device_type_tests``; importing it needs ``expecttest``. The dtypes are the
survey's (floating, integer, bool) minus those the backend declares absent; an op is surveyed in a dtype where its
OpInfo lists that dtype for the CPU (the reference must run there).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from hal.errors import HalError

from .judge import TABLE_VERSION
from .pair import Settings

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                                  "float64": torch.float64, "int64": torch.int64, "bool": torch.bool}
CAPABILITY_KEY = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def load_op_db() -> list[Any]:
    """torch's ``op_db``, or a HalError naming the missing test dependency and its install line."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ModuleNotFoundError as exc:
        raise HalError(f"the operator survey needs PyTorch's OpInfo database, which imports {exc.name!r}: "
                       "pip install 'hetero-hal[survey]'") from None
    return list(op_db)


def op_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def family(op: Any) -> str:
    """The op's family for the tables: its namespace (linalg, fft, special, nn.functional, ...), else its kind."""
    name = op.name
    for prefix in ("nn.functional", "linalg", "fft", "special", "signal", "sparse", "masked", "_refs", "_foreach"):
        if name.startswith(prefix):
            return prefix
    kind = type(op).__name__
    by_kind = {"UnaryUfuncInfo": "elementwise (unary)", "BinaryUfuncInfo": "elementwise (binary)",
               "ReductionOpInfo": "reduction", "ShapeFuncInfo": "shape & view", "ForeachFuncInfo": "_foreach"}
    if kind in by_kind:
        return by_kind[kind]
    base = name.split(".")[0]
    return next((fam for fam, pattern in _BY_NAME if re.search(pattern, base)), "other")


# plain OpInfos (most of op_db) by what their names say they do: the first pattern that matches
_BY_NAME: tuple[tuple[str, str], ...] = (
    ("factory & random", r"^(new_|empty|zeros|ones|full|arange|linspace|logspace|eye|rand|normal|bernoulli|"
                         r"multinomial|uniform|cauchy|exponential|geometric|log_normal|tril_indices|triu_indices)"),
    ("conversion", r"^(to|double|float|half|int|long|bool|byte|char|short|bfloat16|cfloat|cdouble|chalf|type_as|"
                   r"view_as_real|view_as_complex|item|tolist|contiguous|clone|to_sparse)$"),
    ("matmul", r"^(mm|bmm|matmul|addmm|addmv|addbmm|addr|baddbmm|mv|dot|vdot|inner|outer|ger|tensordot|einsum|kron|"
               r"chain_matmul|cholesky|triangular_solve|lu|qr|svd|pinverse|inverse|det|logdet|geqrf|ormqr|"
               r"cholesky_solve|cholesky_inverse|lu_solve|lu_unpack|matrix_exp|symeig|trace|__rmatmul__)"),
    ("sorting & search", r"^(sort|argsort|msort|topk|kthvalue|unique|unique_consecutive|searchsorted|bucketize|"
                         r"histc|histogram|histogramdd|bincount|nonzero|argwhere|isin|mode|median|nanmedian)"),
    ("indexing", r"(index|gather|scatter|take|put|select|masked_|where|diag|tril|triu|nonzero_static)"),
    ("shape & view", r"^(cat|concat|stack|hstack|vstack|dstack|column_stack|row_stack|split|tensor_split|hsplit|"
                     r"vsplit|dsplit|chunk|unsafe_chunk|view|reshape|flatten|unflatten|permute|transpose|swap|"
                     r"moveaxis|movedim|expand|squeeze|unsqueeze|flip|fliplr|flipud|roll|rot90|narrow|t$|mT|mH|T|H|"
                     r"unfold|as_strided|broadcast|atleast|block_diag|repeat|tile|resize|ravel|combinations|"
                     r"cartesian_prod|meshgrid|sum_to_size|alias|adjoint|conj|resolve|positive|split_with_sizes)"),
    ("scan", r"^(cum|logcumsumexp)"),
    ("reduction", r"^(sum|prod|mean|var|std|norm|amax|amin|aminmax|max|min|argmax|argmin|all|any|count_nonzero|"
                  r"logsumexp|nansum|nanmean|dist|renorm|cov|corrcoef|trapz|trapezoid|cumulative_trapezoid)"),
)


@dataclass(frozen=True)
class Pair:
    op_index: int
    name: str
    family: str
    dtype: str


@dataclass(frozen=True)
class Cohort:
    pairs: tuple[Pair, ...]
    dtypes: tuple[str, ...]
    settings: Settings
    absent: dict[str, str]  # dtype -> why the backend does not compute in it
    digest: str

    def ops(self) -> list[str]:
        return sorted({p.name for p in self.pairs})


def _selected(names: list[str], patterns: Sequence[str]) -> list[bool]:
    import fnmatch

    if not patterns:
        return [True] * len(names)
    return [any(fnmatch.fnmatchcase(n, p) if any(c in p for c in "*?[") else p in n for p in patterns) for n in names]


def build(op_db: list[Any], dtypes: Sequence[str], settings: Settings, absent: dict[str, str],
          patterns: Sequence[str] = ()) -> Cohort:
    """The pairs of ``op_db`` in ``dtypes`` (minus ``absent``) whose names match ``patterns`` (all when empty)."""
    names = [op_name(op) for op in op_db]
    keep = _selected(names, patterns)
    pairs = []
    for i, (op, name) in enumerate(zip(op_db, names)):
        if not keep[i]:
            continue
        cpu = op.supported_dtypes("cpu")
        for d in dtypes:
            if DTYPES[d] in cpu:
                pairs.append(Pair(i, name, family(op), d))
    if patterns and not pairs:
        raise HalError(f"-k {','.join(patterns)} matches no op of op_db; `hal conformance survey --list` prints them")
    pinned = {"torch": torch.__version__.split("+")[0], "table": TABLE_VERSION, "settings": settings.__dict__,
              "pairs": [[p.name, p.dtype] for p in pairs]}
    digest = hashlib.sha256(json.dumps(pinned, sort_keys=True).encode()).hexdigest()[:16]
    return Cohort(tuple(pairs), tuple(dtypes), settings, dict(absent), digest)
