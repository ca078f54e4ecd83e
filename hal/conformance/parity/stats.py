"""The statistics parity needs, without SciPy: mean, sample standard deviation, and Welch's one-sided t-test.

Student's t survival function through the regularised incomplete beta function (continued fraction, modified
Lentz), as in Numerical Recipes §6.4: sf(t; ν) = ½·I_{ν/(ν+t²)}(ν/2, ½) for t ≥ 0. Checked against SciPy's values in
``tests/unit/test_parity_stats.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: Sequence[float]) -> float:
    """The sample standard deviation (n - 1); 0 for one value."""
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


@dataclass(frozen=True)
class Welch:
    """Welch's test of a candidate sample against a reference sample, one-sided each way."""

    t: float
    df: float
    p_greater: float  # P-value of "the candidate's mean is larger" (slower to converge, when the values are steps)
    p_less: float  # ... "is smaller" (faster: as suspect as slower)


def welch(candidate: Sequence[float], reference: Sequence[float]) -> Welch:
    """Welch's t and its two one-sided p-values. Both samples without spread: equal means give p = 1 both ways, a
    difference gives p = 0 on its side (no spread can explain it)."""
    m1, m2 = mean(candidate), mean(reference)
    v1 = std(candidate) ** 2 / len(candidate)
    v2 = std(reference) ** 2 / len(reference)
    if v1 + v2 == 0.0:
        if m1 == m2:
            return Welch(0.0, float("inf"), 1.0, 1.0)
        return Welch(math.copysign(math.inf, m1 - m2), float("inf"), 0.0 if m1 > m2 else 1.0, 0.0 if m1 < m2 else 1.0)
    t = (m1 - m2) / math.sqrt(v1 + v2)
    denom = (v1 ** 2 / (len(candidate) - 1) if len(candidate) > 1 and v1 else 0.0) + \
            (v2 ** 2 / (len(reference) - 1) if len(reference) > 1 and v2 else 0.0)
    df = (v1 + v2) ** 2 / denom if denom > 0 else float("inf")
    df = min(df, 1e6)
    return Welch(t, df, t_sf(t, df), t_sf(-t, df))
