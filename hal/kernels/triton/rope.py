"""Rotary embedding without materialising rotate_half: each program rotates a tile of positions.

Semantics are hal.ops._rotary_embedding's, y = x * cos + rotate_half(x) * sin over the two halves
of the last dim, i.e. y1 = x1 c1 - x2 s1 and y2 = x2 c2 + x1 s2, in fp32 with one rounding. x is
(B, H, S, D) with any strides (q and k come straight from a QKV projection as transposed views);
cos/sin are broadcast to x's shape by stride (0 where broadcast), so (S, D) tables cost one read
per tile. The backward is the transposed rotation: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, launcher, on_device

# Tile: BLOCK_S positions x HEADS heads per program (head-independent cos/sin read once for them); on an
# H100 every setting tried (8-64 positions, 1-8 heads) ran within 5 % of the copy bandwidth. On an H200 (bf16,
# 16 heads of 128, 28 tiles swept in three runs) 32 x 2 stayed best at 2048 positions, while at 8192 positions
# 16 x 4 ran 2-4 % faster (forward 19.3-19.5 -> 18.8-19.0 us): LONG_BLOCK_S x LONG_HEADS from LONG_SEQ positions.
BLOCK_S = 32
HEADS = 2
LONG_SEQ = 4096  # between the two lengths measured
LONG_BLOCK_S = 16
LONG_HEADS = 4
NUM_WARPS = 4


@triton.jit
def _rope(X, COS, SIN, Y, n_heads, seq, half,
          sxb, sxh, sxs, sxd, scb, sch, scs, scd, ssb, ssh, sss, ssd, syb, syh, sys, syd,
          BACKWARD: tl.constexpr, TABLE_PER_HEAD: tl.constexpr, HEADS: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    groups = tl.cdiv(n_heads, HEADS)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // groups
    h0 = (pid % groups) * HEADS
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask = (s < seq)[:, None] & (d < half)[None, :]
    s64 = s.to(tl.int64)[:, None]
    d1 = d.to(tl.int64)[None, :]
    d2 = d1 + half
    # tables shared by the heads (the model's (S, D) cos/sin) are read once for all HEADS heads
    c_row = COS + b * scb + h0 * sch + s64 * scs
    n_row = SIN + b * ssb + h0 * ssh + s64 * sss
    c1 = tl.load(c_row + d1 * scd, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + d2 * scd, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(n_row + d1 * ssd, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(n_row + d2 * ssd, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(HEADS):
        h = h0 + i
        m = mask & ((s * 0 + h) < n_heads)[:, None]  # a vector mask: the interpreter rejects a scalar one here
        if TABLE_PER_HEAD:
            c_row = COS + b * scb + h * sch + s64 * scs
            n_row = SIN + b * ssb + h * ssh + s64 * sss
            c1 = tl.load(c_row + d1 * scd, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(c_row + d2 * scd, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(n_row + d1 * ssd, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(n_row + d2 * ssd, mask=m, other=0.0).to(tl.float32)
        x_row = X + b * sxb + h * sxh + s64 * sxs
        x1 = tl.load(x_row + d1 * sxd, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + d2 * sxd, mask=m, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        y_row = Y + b * syb + h * syh + s64 * sys
        tl.store(y_row + d1 * syd, y1.to(Y.dtype.element_ty), mask=m)
        tl.store(y_row + d2 * syd, y2.to(Y.dtype.element_ty), mask=m)


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """``t`` with leading size-1 dims up to 4-D (a view)."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, backward: bool = False) -> torch.Tensor:
    """The rotation of x (or, with ``backward``, its transpose applied to a gradient), contiguous, in ``out_dtype``.

    x has at most 4 dims and an even last dim; cos/sin broadcast to x's shape (the caller checks).
    """
    check_device(_rope, x.device)
    x4 = as_4d(x)
    c4, s4 = cos.expand(x.shape), sin.expand(x.shape)
    c4, s4 = as_4d(c4), as_4d(s4)
    y = torch.empty(x4.shape, dtype=out_dtype, device=x.device)
    batch, heads, seq, dim = x4.shape
    if y.numel():
        block_d = triton.next_power_of_2(dim // 2)
        block_s, group = (LONG_BLOCK_S, LONG_HEADS) if seq >= LONG_SEQ else (BLOCK_S, HEADS)
        group = min(group, heads)
        grid = (batch * triton.cdiv(heads, group), triton.cdiv(seq, block_s))
        per_head = c4.stride(1) != 0 or s4.stride(1) != 0
        with on_device(x.device):
            launcher(_rope)[grid](x4, c4, s4, y, heads, seq, dim // 2, *x4.stride(), *c4.stride(), *s4.stride(), *y.stride(),
                        BACKWARD=backward, TABLE_PER_HEAD=per_head, HEADS=group, BLOCK_S=block_s, BLOCK_D=block_d,
                        num_warps=NUM_WARPS)
    return y.view(x.shape)
