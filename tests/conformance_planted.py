"""A tiny planted conformance suite for the runner, report and CLI tests (``--suite tests.conformance_planted``).

Its cases compute for real on the context's backend and are judged with the real tolerance table; a
known error is planted where a case must fail, so the tests do not depend on the real suites.
``ctx.options["planted_ratio"]`` sets the matmul case's error in units of its bound (default 3: fails; its
tol_ratio comes out a little below the ratio).
"""
from __future__ import annotations

import torch

from hal.conformance.cases import Case, Context, Outcome, skip, unsupported
from hal.conformance.verdicts.tolerances import judge, tolerance_for

EXPECTED = {"pass": 5, "fail": 1, "error": 1, "skip": 1, "unsupported": 1}  # what cases() yields on cpu


def _judged(actual: torch.Tensor, expected: torch.Tensor, category: str, dtype: torch.dtype, k: int = 1) -> Outcome:
    tol = tolerance_for(category, dtype, k)
    j = judge(actual, expected, tol, dtype)
    return Outcome("pass" if j.passed else "fail", j.metrics, tol.to_dict(), j.failed_metric, j.reason)  # type: ignore[arg-type]


def _softmax(dtype: torch.dtype):
    def run(ctx: Context) -> Outcome:
        x = torch.randn(8, 33).to(dtype)
        actual = torch.softmax(x.to(ctx.device), dim=-1)
        return _judged(actual, torch.softmax(x.double(), dim=-1), "normalization", dtype)
    return run


def _matmul_planted(ctx: Context) -> Outcome:
    """A matmul whose result is off by ``planted_ratio`` x the table's atol (default 3: fails), whatever the table says."""
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    tol = tolerance_for("matmul", torch.float32, 32)
    actual = (a.to(ctx.device) @ b.to(ctx.device)) + float(ctx.options.get("planted_ratio", 3.0)) * tol.atol
    return _judged(actual, a.double() @ b.double(), "matmul", torch.float32, k=32)


def _raises(ctx: Context) -> Outcome:
    raise RuntimeError("planted failure inside the case\nsecond line that the summary must not show")


def _seed_probe(ctx: Context) -> Outcome:
    """Passes; reports the first random number it draws, so tests can see every case starts from the seed."""
    return Outcome("pass", metrics={"first_draw": float(torch.rand(1))})


def _loss_curve(ctx: Context) -> Outcome:
    """Five SGD steps of a linear fit on the backend against the same steps in float64."""
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    curves = {}
    for name, dtype, device in (("loss", torch.float32, ctx.device), ("reference_loss", torch.float64, torch.device("cpu"))):
        w = torch.zeros(4, 1, dtype=dtype, device=device, requires_grad=True)
        losses = []
        for _ in range(5):
            loss = ((x.to(device, dtype) @ w - y.to(device, dtype)) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                w -= 0.1 * w.grad
                w.grad = None
            losses.append(loss.item())
        curves[name] = losses
    diff = max(abs(a - b) for a, b in zip(curves["loss"], curves["reference_loss"]))
    status = "pass" if diff <= 1e-4 else "fail"
    return Outcome(status, metrics={"max_abs": diff}, tolerance={"max_abs": 1e-4},
                   failed_metric=None if status == "pass" else "max_abs", reason="" if status == "pass" else "loss drifted",
                   data={"steps": [1, 2, 3, 4, 5], **curves})


def _busbw(ctx: Context) -> Outcome:
    sizes = [2**i for i in range(3, 21, 3)]
    return Outcome("pass", metrics={"busbw_gbs": 1.5}, data={"op": "all_reduce", "dtype": "float32", "sizes_bytes": sizes,
                                                             "busbw_gbs": [s / 2**20 for s in sizes]})


def cases(ctx: Context) -> list[Case]:
    return [
        Case("ops", "softmax/reference/float32/odd_shape/forward", _softmax(torch.float32), "softmax in fp32"),
        Case("ops", "softmax/reference/bfloat16/odd_shape/forward", _softmax(torch.bfloat16), "softmax in bf16"),
        Case("ops", "matmul/reference/float32/planted_error/forward", _matmul_planted, "a planted matmul error"),
        Case("ops", "gelu/reference/float32/raises/forward", _raises, "a case that raises"),
        Case("ops", "rms_norm/reference/float16/skipped/forward", lambda ctx: skip("planted skip"), "skipped"),
        Case("ops", "linear/reference/float8_e4m3fn/unsupported/forward",
             lambda ctx: unsupported("planted: no fp8 here"), "unsupported"),
        Case("ops", "seed/probe", _seed_probe, "first random draw"),
        Case("training", "linear_fit/float32/loss_curve", _loss_curve, "a loss curve against fp64",
             tags=("float32",)),
        Case("collectives", "all_reduce/float32/busbw", _busbw, "a planted bandwidth table"),
    ]
