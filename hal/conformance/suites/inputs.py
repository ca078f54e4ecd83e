"""Input generators for the ops suite: one per HAL op, each covering the same input classes.

A generator returns a ``Sample``: the *leaf* tensors (float leaves in float64, already rounded to
the dtype under test, so the float64 reference sees exactly the values the device sees — FlagGems'
upcast reference), a ``build`` function that turns leaves into the op's arguments (this is where
non-contiguous views are made, so they are made on whichever device the leaves live on and autograd
carries gradients back to the leaves), the reduction length K for the tolerance, and which leaves get
gradients with which tolerance category.

Input classes (``CLASSES``): ``normal`` shapes; ``odd`` sizes (7x13-like); ``single`` (1x1);
``noncontig`` (transposed / strided views); ``large`` and ``tiny`` magnitudes (scaled by 1e4 / 1e-4,
or the nearest power of ten that keeps the dtype out of overflow / subnormals — see ``large_scale``);
``nonfinite`` (NaN where propagation is defined, ±inf only where every correct implementation agrees);
``empty`` (zero-size). Some ops add their own variants (e.g. ``causal`` attention). Every generator is
seeded from (seed, op, class), so a case sees the same numbers on every run and every backend.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

CLASSES: tuple[str, ...] = ("normal", "odd", "single", "noncontig", "large", "tiny", "nonfinite", "empty")
NAN = float("nan")
INF = float("inf")

Leaves = dict[str, torch.Tensor]
Built = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class GradSpec:
    """How one leaf's gradient is judged: tolerance category, reduction length K, natural magnitude."""

    category: str
    k: int
    magnitude: float = 1.0  # typical size of this gradient given the input scale (atol is scaled by it)


@dataclass(frozen=True)
class OutputSpec:
    """How one output of a multi-output op is judged (a single-output op uses its Sample's k and magnitude)."""

    name: str
    category: str
    k: int = 1
    magnitude: float = 1.0


@dataclass(frozen=True)
class Sample:
    """One input of one op: leaves (float64 / int64 on CPU), how to build the call, and how to judge it."""

    leaves: Leaves
    build: Callable[[Leaves], Built]
    k: int = 1  # forward reduction length (tolerance atol scaling for reduction / matmul categories)
    grads: dict[str, GradSpec] = field(default_factory=dict)  # leaves differentiated in the backward case
    scale: float = 1.0  # what the float inputs were scaled by (large / tiny); 1 otherwise
    magnitude: float = 1.0  # typical size of the result given that scale (the table's atol assumes 1)
    note: str = ""  # what this sample is, for the case description
    # (float64 leaves, float64 cotangent) -> {leaf: max of the gradient's componentwise scale}; see GradScale
    grad_scale: GradScale | None = None
    outputs: tuple[OutputSpec, ...] = ()  # one per output of a multi-output op (add_rms_norm); () for one output
    fp32_out: bool = False  # the op's contract returns fp32 for fp16/bf16 inputs (a loss summed over many tokens)


GradScale = Callable[[Leaves, torch.Tensor], dict[str, float]]
"""For a backward that cancels (softmax's y * (g - sum(y * g)), attention's dS @ K), the largest
componentwise scale of each gradient: the same formula with every term replaced by its absolute value
(Higham's |A||B| for a product), so one rounding of each low-precision intermediate is bounded by
rtol x that scale whatever cancellation the seed happens to draw. The gradient itself can be orders
of magnitude smaller than the terms it is the difference of."""


def _finite_max(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def large_scale(dtype: torch.dtype, power: int = 1) -> float:
    """1e4, or the largest power of ten whose ``power``-th power stays 64x below the dtype's max."""
    limit = (torch.finfo(dtype).max / 64.0) ** (1.0 / power)
    return min(1e4, 10.0 ** math.floor(math.log10(limit)))


def tiny_scale(dtype: torch.dtype, power: int = 1) -> float:
    """1e-4, or the smallest power of ten whose ``power``-th power stays 100x above the smallest normal."""
    floor = (torch.finfo(dtype).tiny * 100.0) ** (1.0 / power)
    return max(1e-4, 10.0 ** math.ceil(math.log10(floor)))


def seed_for(seed: int, op: str, input_class: str) -> int:
    """A stable per-(op, class) seed: independent of case order and of the dtype."""
    return (seed * 1_000_003 + zlib.crc32(f"{op}/{input_class}".encode())) % (2**63)


class _Rng:
    """Seeded float64 draws rounded to the dtype under test."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def round(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype).to(torch.float64)

    def normal(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return self.round(torch.randn(*shape, generator=self.gen, dtype=torch.float64) * scale)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        u = torch.rand(*shape, generator=self.gen, dtype=torch.float64)
        return self.round(low + (high - low) * u)

    def ints(self, *shape: int, high: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen, dtype=torch.int64)


def _magnitude(input_class: str, dtype: torch.dtype, power: int) -> float:
    if input_class == "large":
        return large_scale(dtype, power)
    if input_class == "tiny":
        return tiny_scale(dtype, power)
    return 1.0


def _poison(t: torch.Tensor, nan_at: list[tuple[int, ...]], inf_at: list[tuple[tuple[int, ...], float]] = ()) -> torch.Tensor:
    t = t.clone()
    for idx in nan_at:
        t[idx] = NAN
    for idx, value in inf_at:
        t[idx] = value
    return t


def _rows_cols(input_class: str, normal: tuple[int, int]) -> tuple[int, int]:
    return {"odd": (7, 13), "single": (1, 1), "empty": (0, normal[1])}.get(input_class, normal)


# --- generators -----------------------------------------------------------------------------------------
# Each takes (input_class, dtype, rng) and returns a Sample.


def _linear(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    m, kin = _rows_cols(cls, (16, 64))
    n = {"odd": 5, "single": 1}.get(cls, 48)
    s = _magnitude(cls, dtype, 2)
    if cls == "noncontig":  # x: every other column of a wider matrix; weight: a transposed (in, out) matrix
        leaves = {"x": r.normal(m, 2 * kin), "weight": r.normal(kin, n), "bias": r.normal(n)}
        build = lambda t: ((t["x"][:, ::2], t["weight"].t(), t["bias"]), {})
    else:
        leaves = {"x": r.normal(m, kin, scale=s), "weight": r.normal(n, kin, scale=s), "bias": r.normal(n, scale=s * s)}
        if cls == "nonfinite":  # NaN poisons its row; an inf gives ±inf along its row (sign of the weight)
            leaves["x"] = _poison(leaves["x"], [(2, 3)], [((5, 7), INF), ((9, 1), -INF)])
        build = lambda t: ((t["x"], t["weight"], t["bias"]), {})
    grads = {"x": GradSpec("matmul", n, s), "weight": GradSpec("matmul", m, s), "bias": GradSpec("reduction", m)}
    return Sample(leaves, build, k=kin, grads=grads, scale=s, magnitude=s * s,
                  note=f"x ({m}, {kin}) @ weight ({n}, {kin}).T + bias")


def _matmul(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    m, kin = _rows_cols(cls, (16, 64))
    n = {"odd": 5, "single": 1}.get(cls, 32)
    s = _magnitude(cls, dtype, 2)
    if cls == "noncontig":  # a: a transposed matrix; b: every other row of a taller one
        leaves = {"a": r.normal(kin, m), "b": r.normal(2 * kin, n)}
        build = lambda t: ((t["a"].t(), t["b"][::2]), {})
    elif cls == "normal":  # batched with broadcasting: (2, m, k) @ (k, n)
        leaves = {"a": r.normal(2, m, kin), "b": r.normal(kin, n)}
        build = lambda t: ((t["a"], t["b"]), {})
    else:
        leaves = {"a": r.normal(m, kin, scale=s), "b": r.normal(kin, n, scale=s)}
        if cls == "nonfinite":
            leaves["a"] = _poison(leaves["a"], [(2, 3)], [((5, 7), INF), ((9, 1), -INF)])
        build = lambda t: ((t["a"], t["b"]), {})
    grads = {"a": GradSpec("matmul", n, s), "b": GradSpec("matmul", (2 if cls == "normal" else 1) * m, s)}
    return Sample(leaves, build, k=kin, grads=grads, scale=s, magnitude=s * s, note=f"({m}, {kin}) @ ({kin}, {n})")


Built = tuple[Leaves, Callable[[torch.Tensor], torch.Tensor], int, int, float]  # what an input builder returns


def _norm_input(cls: str, dtype: torch.dtype, r: _Rng, normal: tuple[int, int]) -> Built:
    """x for the row-normalising ops: (leaves, view, rows, cols, scale); noncontig is a transposed matrix."""
    m, d = _rows_cols(cls, normal)
    s = _magnitude(cls, dtype, 1)
    if cls == "noncontig":
        return {"x": r.normal(d, m)}, lambda x: x.t(), m, d, s
    x = r.normal(m, d, scale=s)
    if cls == "nonfinite":
        x = _poison(x, [(2, 3), (5, 0)])
    return {"x": x}, lambda x: x, m, d, s


def _normalized_magnitudes(rows: torch.Tensor, eps: float, centered: bool) -> tuple[float, float]:
    """The scales of x̂ = (x - centre) / sqrt(s + eps) and of dx̂/dx over the finite rows actually drawn, s the
    row's variance (layer_norm) or mean square (rms_norm): max |x| / sqrt(s + eps) (one rounding of x, or of
    x - centre, is amplified by 1/sqrt(s + eps), so that — not |x̂| — is the scale of x̂'s error) and
    max 1/sqrt(s + eps). Read from the data, not the input class: a one-column layer_norm row has s = 0,
    x̂ = 0 exactly, and rounding noise amplified by 1/sqrt(eps) in x̂ and both gradients, whatever the seed."""
    rows = rows.detach().to(torch.float64)
    rows = rows[torch.isfinite(rows).all(dim=-1)] if rows.numel() else rows
    if rows.numel() == 0:
        return 1.0, 1.0
    centre = rows.mean(dim=-1, keepdim=True) if centered else torch.zeros_like(rows[..., :1])
    stat = (rows - centre).pow(2).mean(dim=-1)
    root = (stat + eps).sqrt()
    y = float((rows.abs().amax(dim=-1) / root).max())
    return max(y, 1.0), max(float((1.0 / root).max()), 1.0)


def _rms_norm(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    leaves, view, m, d, s = _norm_input(cls, dtype, r, (16, 64))
    leaves["weight"] = r.uniform(d, low=0.5, high=1.5)
    eps = 1e-6
    build = lambda t: ((view(t["x"]), t["weight"], eps), {})
    y, dx = _normalized_magnitudes(view(leaves["x"]), eps, centered=False)
    grads = {"x": GradSpec("normalization", d, dx), "weight": GradSpec("reduction", m, y)}
    note = f"x ({m}, {d}), eps {eps:g}" + (" (tiny rows: eps dominates mean(x²))" if cls == "tiny" else "")
    return Sample(leaves, build, k=d, grads=grads, scale=s, magnitude=y, note=note)


def _add_rms_norm(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    leaves, view, m, d, s = _norm_input(cls, dtype, r, (16, 64))
    leaves["residual"] = _norm_input(cls, dtype, r, (16, 64))[0]["x"]
    leaves["weight"] = r.uniform(d, low=0.5, high=1.5)
    eps = 1e-6
    build = lambda t: ((view(t["x"]), view(t["residual"]), t["weight"], eps), {})
    y, dx = _normalized_magnitudes(view(leaves["x"]) + view(leaves["residual"]), eps, centered=False)
    # both inputs get h's gradient: the residual's cotangent plus rms_norm's backward (dx >= 1 covers both)
    grads = {"x": GradSpec("normalization", d, dx), "residual": GradSpec("normalization", d, dx),
             "weight": GradSpec("reduction", m, y)}
    outputs = (OutputSpec("normed", "normalization", d, y), OutputSpec("residual", "elementwise", 1, 2 * s))
    return Sample(leaves, build, k=d, grads=grads, scale=s, magnitude=y, outputs=outputs,
                  note=f"x, residual ({m}, {d}), eps {eps:g} -> (rms_norm(x + residual), x + residual)")


def _layer_norm(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    leaves, view, m, d, s = _norm_input(cls, dtype, r, (16, 64))
    leaves["weight"] = r.uniform(d, low=0.5, high=1.5)
    leaves["bias"] = r.normal(d)
    eps = 1e-5
    build = lambda t: ((view(t["x"]), t["weight"], t["bias"], eps), {})
    y, dx = _normalized_magnitudes(view(leaves["x"]), eps, centered=True)
    grads = {"x": GradSpec("normalization", d, dx), "weight": GradSpec("reduction", m, y), "bias": GradSpec("reduction", m)}
    # the result is xhat * weight + bias with an O(1) bias: magnitude 1 whatever the scale
    return Sample(leaves, build, k=d, grads=grads, scale=s, note=f"x ({m}, {d}), eps {eps:g}")


def _softmax(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    leaves, view, m, d, s = _norm_input(cls, dtype, r, (16, 64))
    note = f"x ({m}, {d}), dim -1"
    if cls == "nonfinite":  # -inf is masking (probability 0), well defined; NaN poisons its row
        leaves["x"] = _poison(leaves["x"], [], [((7, 1), -INF), ((7, 9), -INF), ((11, 0), -INF)])
        note += "; NaN rows and -inf (masked) entries"
    build = lambda t: ((view(t["x"]),), {"dim": -1})

    def grad_scale(ref: Leaves, cotangent: torch.Tensor) -> dict[str, float]:
        y = torch.softmax(view(ref["x"]), dim=-1)
        delta = (y * cotangent).sum(dim=-1, keepdim=True)
        return {"x": _finite_max(y * (cotangent.abs() + delta.abs()))}

    return Sample(leaves, build, k=d, grads={"x": GradSpec("normalization", d)}, scale=s, note=note, grad_scale=grad_scale)


def _pointwise(cls: str, dtype: torch.dtype, r: _Rng, halves: bool, power: int) -> Built:
    """x for the elementwise ops: (leaves, view, rows, cols, scale); ``halves`` doubles the odd widths."""
    m, d = _rows_cols(cls, (16, 128 if halves else 64))
    if cls in ("odd", "single") and halves:
        d *= 2  # swiglu splits the last dim in two: odd / single halves
    s = _magnitude(cls, dtype, power)
    if cls == "noncontig":  # every other column of a wider matrix
        return {"x": r.normal(m, 2 * d)}, lambda x: x[:, ::2], m, d, s
    x = r.normal(m, d, scale=s)
    if cls == "nonfinite":
        x = _poison(x, [(2, 3), (5, 0)])
    return {"x": x}, lambda x: x, m, d, s


def _gelu(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    leaves, view, m, d, s = _pointwise(cls, dtype, r, False, 1)
    approximate = "tanh" if cls == "tanh" else "none"
    build = lambda t: ((view(t["x"]),), {"approximate": approximate})
    return Sample(leaves, build, grads={"x": GradSpec("elementwise", 1)}, scale=s, magnitude=s,
                  note=f"x ({m}, {d}), approximate={approximate!r}")


def _silu(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    leaves, view, m, d, s = _pointwise(cls, dtype, r, False, 1)
    build = lambda t: ((view(t["x"]),), {})
    return Sample(leaves, build, grads={"x": GradSpec("elementwise", 1)}, scale=s, magnitude=s, note=f"x ({m}, {d})")


def _swiglu(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    leaves, view, m, d, s = _pointwise(cls, dtype, r, True, 2)
    build = lambda t: ((view(t["x"]),), {"dim": -1})
    return Sample(leaves, build, grads={"x": GradSpec("elementwise", 1, s)}, scale=s, magnitude=s * s,
                  note=f"x ({m}, {d}) -> silu(x[:, :{d // 2}]) * x[:, {d // 2}:]")


def _rope_tables(seq: int, dim: int, r: _Rng) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    theta = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    theta = torch.cat([theta, theta], dim=-1)
    return r.round(theta.cos()), r.round(theta.sin())


def _rotary_embedding(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    b, h, seq, d = {"odd": (1, 3, 7, 6), "single": (1, 1, 1, 2), "empty": (2, 4, 0, 16)}.get(cls, (2, 4, 8, 16))
    s = _magnitude(cls, dtype, 1)
    cos, sin = _rope_tables(seq, d, r)
    if cls == "noncontig":  # (batch, seq, heads, dim) transposed to (batch, heads, seq, dim), as after a QKV projection
        leaves = {"x": r.normal(b, seq, h, d), "cos": cos, "sin": sin}
        build = lambda t: ((t["x"].transpose(1, 2), t["cos"], t["sin"]), {})
    else:
        x = r.normal(b, h, seq, d, scale=s)
        if cls == "nonfinite":
            x = _poison(x, [(0, 1, 2, 3), (1, 0, 5, 12)])
        leaves = {"x": x, "cos": cos, "sin": sin}
        build = lambda t: ((t["x"], t["cos"], t["sin"]), {})
    grads = {"x": GradSpec("elementwise", 2), "cos": GradSpec("reduction", b * h, s), "sin": GradSpec("reduction", b * h, s)}
    return Sample(leaves, build, k=2, grads=grads, scale=s, magnitude=s, note=f"x ({b}, {h}, {seq}, {d}), cos/sin ({seq}, {d})")


def _sdpa(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    b, hq, hkv, lq, lk, d = {
        "odd": (1, 3, 3, 7, 5, 6), "single": (1, 1, 1, 1, 1, 2), "empty": (2, 4, 4, 0, 8, 16),
        "gqa": (2, 4, 2, 8, 8, 16), "causal": (2, 4, 4, 8, 8, 16),
    }.get(cls, (2, 4, 4, 8, 8, 16))
    # large: scores of ~100 (a saturated softmax; 1e8 would only test the exponent range) and large values
    s_qk = {"large": min(10.0, large_scale(dtype, 2)), "tiny": tiny_scale(dtype, 1)}.get(cls, 1.0)
    s_v = {"large": large_scale(dtype, 2), "tiny": tiny_scale(dtype, 1)}.get(cls, 1.0)
    kwargs: dict[str, Any] = {"is_causal": cls == "causal"}
    note = f"q ({b}, {hq}, {lq}, {d}), k/v ({b}, {hkv}, {lk}, {d})" + (", causal" if cls == "causal" else "")
    if s_qk != 1.0:
        note += f"; q, k scaled by {s_qk:g}, v by {s_v:g}"
    if cls == "noncontig":  # (batch, seq, heads, dim) transposed to (batch, heads, seq, dim), as after a QKV projection
        leaves = {n: r.normal(b, lk, hq, d) for n in ("q", "k", "v")}
        build = lambda t: ((t["q"].transpose(1, 2), t["k"].transpose(1, 2), t["v"].transpose(1, 2)), dict(kwargs))
    else:
        leaves = {"q": r.normal(b, hq, lq, d, scale=s_qk), "k": r.normal(b, hkv, lk, d, scale=s_qk),
                  "v": r.normal(b, hkv, lk, d, scale=s_v)}
        if cls == "nonfinite":  # NaN in one query row poisons that row; -inf in the mask hides keys
            leaves["q"] = _poison(leaves["q"], [(0, 1, 2, 3)])
            mask = torch.zeros(lq, lk, dtype=torch.float64)
            mask[:, 5] = -INF
            mask[3, :4] = -INF
            leaves["attn_mask"] = mask
            note += "; NaN in q, additive mask with -inf"
            build = lambda t: ((t["q"], t["k"], t["v"]), {**kwargs, "attn_mask": t["attn_mask"]})
        else:
            build = lambda t: ((t["q"], t["k"], t["v"]), dict(kwargs))
    k = max(d, lk)
    grads = {"q": GradSpec("matmul", max(k, lq), s_qk * s_v), "k": GradSpec("matmul", max(k, lq), s_qk * s_v),
             "v": GradSpec("matmul", max(k, lq))}
    return Sample(leaves, build, k=k, grads=grads, scale=max(s_qk, s_v) if cls == "large" else s_v, magnitude=s_v, note=note,
                  grad_scale=lambda ref, cotangent: _sdpa_grad_scale(build, ref, cotangent))


def _sdpa_grad_scale(build: Callable[[Leaves], Built], ref: Leaves, d_out: torch.Tensor) -> dict[str, float]:
    """Attention's backward with every term in absolute value: dV = P^T dO, dS = P * (dO V^T - delta),
    dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d); grouped kv heads summed over their query heads."""
    (q, k, v), kwargs = build(ref)
    groups = q.shape[-3] // k.shape[-3]
    k_rep, v_rep = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    factor = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k_rep.transpose(-1, -2) * factor
    if kwargs.get("is_causal"):
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -INF)
    if kwargs.get("attn_mask") is not None:
        scores = scores + kwargs["attn_mask"]
    p = torch.softmax(scores, dim=-1)
    delta = (p * (d_out @ v_rep.transpose(-1, -2))).sum(dim=-1, keepdim=True)
    ds = p * (d_out.abs() @ v_rep.abs().transpose(-1, -2) + delta.abs())

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-3, (k.shape[-3], groups)).sum(dim=-3)

    return {"q": _finite_max(ds @ k_rep.abs() * factor),
            "k": _finite_max(per_kv_head(ds.transpose(-1, -2) @ q.abs() * factor)),
            "v": _finite_max(per_kv_head(p.transpose(-1, -2) @ d_out.abs()))}


def _cross_entropy(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    n, c = _rows_cols(cls, (16, 32))
    s = _magnitude(cls, dtype, 1)
    reduction = {"nonfinite": "none", "empty": "sum"}.get(cls, "mean")
    target = r.ints(n, high=c)
    if cls == "ignore_index":
        target[::3] = -100
    if cls == "noncontig":
        leaves = {"logits": r.normal(c, n), "target": target}
        view: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.t()
    else:
        logits = r.normal(n, c, scale=s)
        if cls == "nonfinite":
            logits = _poison(logits, [(2, 3), (5, 0)])
        leaves, view = {"logits": logits, "target": target}, (lambda x: x)
    build = lambda t: ((view(t["logits"]), t["target"]), {"reduction": reduction})
    return Sample(leaves, build, k=c, grads={"logits": GradSpec("reduction", c)}, scale=s, magnitude=max(1.0, s),
                  note=f"logits ({n}, {c}), reduction {reduction!r}" + (", every third target ignored" if cls == "ignore_index" else ""))


def _linear_cross_entropy(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    n, h = _rows_cols(cls, (16, 32))
    vocab = {"odd": 11, "single": 1}.get(cls, 48)
    s = _magnitude(cls, dtype, 2)  # logits scale as s²: hidden and weight are both scaled by s
    w_scale = s / math.sqrt(h)  # logits of O(s²) whatever the hidden size
    reduction = "sum" if cls == "empty" else "mean"
    target = r.ints(n, high=vocab)
    if cls == "ignore_index":
        target[::3] = -100
    if cls == "noncontig":  # hidden: a transposed (H, N) matrix; weight: a transposed (H, V) one
        leaves = {"hidden": r.normal(h, n), "weight": r.normal(h, vocab, scale=1 / math.sqrt(h)), "target": target}
        build = lambda t: ((t["hidden"].t(), t["weight"].t(), t["target"]), {"reduction": reduction})
    else:
        leaves = {"hidden": r.normal(n, h, scale=s), "weight": r.normal(vocab, h, scale=w_scale), "target": target}
        if cls == "nonfinite":  # NaN poisons its token's loss, hence the mean, every weight gradient and its row's
            leaves["hidden"] = _poison(leaves["hidden"], [(2, 3)])
        build = lambda t: ((t["hidden"], t["weight"], t["target"]), {"reduction": reduction})
    grads = {"hidden": GradSpec("matmul", vocab, w_scale), "weight": GradSpec("matmul", max(n, 1), s)}
    return Sample(leaves, build, k=h, grads=grads, scale=s, magnitude=max(1.0, s * s), fp32_out=True,
                  note=f"hidden ({n}, {h}) @ weight ({vocab}, {h}).T -> cross-entropy, reduction {reduction!r}"
                       + (", every third target ignored" if cls == "ignore_index" else ""),
                  grad_scale=lambda ref, cotangent: _linear_ce_grad_scale(build, ref, cotangent))


def _linear_ce_grad_scale(build: Callable[[Leaves], Built], ref: Leaves, d_loss: torch.Tensor) -> dict[str, float]:
    """The head's backward with every term in absolute value. The logits are an intermediate in the input
    dtype: one rounding of each (x -> x(1 + d), |d| <= rtol) moves softmax's p by up to
    p (|x| + sum_k p_k |x_k|) times rtol, so the logits' gradient G = (p - onehot) * scale is bounded by
    |G| + that; then d hidden = G W and d weight = G^T hidden as |G| |W| and |G|^T |hidden|."""
    (hidden, weight, target), kwargs = build(ref)
    logits = hidden @ weight.t()
    if logits.numel() == 0:
        return {}
    keep = target != -100
    p = torch.softmax(logits, dim=-1)
    onehot = torch.zeros_like(p).scatter_(1, target.clamp(min=0)[:, None], 1.0)
    scale = keep.to(p.dtype) / (1.0 if kwargs.get("reduction") == "sum" else max(int(keep.sum()), 1))
    moved = p * (logits.abs() + (p * logits.abs()).sum(dim=-1, keepdim=True))
    g = ((p - onehot).abs() + moved) * scale[:, None] * float(d_loss.abs())
    return {"hidden": _finite_max(g @ weight.abs()), "weight": _finite_max(g.t() @ hidden.abs())}


def _embedding(cls: str, dtype: torch.dtype, r: _Rng) -> Sample:
    vocab, d = {"odd": (13, 5), "single": (1, 1)}.get(cls, (50, 32))
    ids_shape = {"odd": (7,), "single": (1,), "empty": (0,)}.get(cls, (4, 8))
    s = _magnitude(cls, dtype, 1)
    ids = r.ints(*ids_shape, high=vocab)
    if cls == "noncontig":  # a transposed weight, every other id of a wider index matrix
        leaves = {"ids": r.ints(4, 16, high=vocab), "weight": r.normal(d, vocab)}
        build = lambda t: ((t["ids"][:, ::2], t["weight"].t()), {})
    else:
        weight = r.normal(vocab, d, scale=s)
        if cls == "nonfinite":  # data movement: NaN and ±inf rows are copied as they are
            ids = torch.tensor([[1, 2, 3, 1], [7, 2, 0, 9]])
            weight = _poison(weight, [(1, 0)], [((2, 3), INF), ((3, 4), -INF)])
        leaves = {"ids": ids, "weight": weight}
        build = lambda t: ((t["ids"], t["weight"]), {})
    count = max(1, int(leaves["ids"].numel()))
    return Sample(leaves, build, k=1, grads={"weight": GradSpec("reduction", count)}, scale=s, magnitude=s,
                  note=f"ids {tuple(ids_shape)} into weight ({vocab}, {d})")


Generator = Callable[[str, torch.dtype, _Rng], Sample]

GENERATORS: dict[str, tuple[Generator, tuple[str, ...]]] = {
    "linear": (_linear, CLASSES),
    "matmul": (_matmul, CLASSES),
    "rms_norm": (_rms_norm, CLASSES),
    "add_rms_norm": (_add_rms_norm, CLASSES),
    "layer_norm": (_layer_norm, CLASSES),
    "softmax": (_softmax, CLASSES),
    "gelu": (_gelu, CLASSES + ("tanh",)),
    "silu": (_silu, CLASSES),
    "swiglu": (_swiglu, CLASSES),
    "rotary_embedding": (_rotary_embedding, CLASSES),
    "scaled_dot_product_attention": (_sdpa, CLASSES + ("gqa", "causal")),
    "cross_entropy": (_cross_entropy, CLASSES + ("ignore_index",)),
    "linear_cross_entropy": (_linear_cross_entropy, CLASSES + ("ignore_index",)),
    "embedding": (_embedding, CLASSES),
}


def has_generator(op: str) -> bool:
    return op in GENERATORS


def classes(op: str) -> tuple[str, ...]:
    """The input classes ``op`` is tested with (KeyError when there is no generator)."""
    return GENERATORS[op][1]


def sample(op: str, input_class: str, dtype: torch.dtype, seed: int) -> Sample:
    """The seeded sample of ``op`` for ``input_class`` in ``dtype``."""
    generator, known = GENERATORS[op]
    if input_class not in known:
        raise ValueError(f"op {op!r} has no input class {input_class!r}; it has {', '.join(known)}")
    return generator(input_class, dtype, _Rng(seed_for(seed, op, input_class), dtype))
