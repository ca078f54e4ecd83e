"""Fused linear + cross-entropy: the head matmul and the loss chunked over tokens.

Per chunk of C tokens: logits = h_c @ W^T (torch's matmul, in the inputs' dtype, as the reference
computes them), then one Triton program per row computes the loss in fp32 with an online softmax and
overwrites the row with its gradient (softmax - onehot) * scale; the gradients then follow by two
matmuls, dh_c = g_c @ W and dW += g_c^T @ h_c. Only a (C, V) block of logits ever exists, so peak
memory is C x V instead of N x V (and no fp32 copy of the logits). The gradients are computed in
the forward (the logits are needed for both) and scaled by the loss's gradient in the backward, as
Liger-Kernel does; dW accumulates in the weight's dtype, rounded once per chunk.

A row is walked twice (online softmax, then the gradient): loading a 32k row once into registers instead
ran 26 % slower on an H200 (116 against 92 µs at 2048 x 32000). The backward's scale by the
loss's gradient is a Triton kernel reading that fp32 scalar on the device (no host sync): torch's in-place
``mul_`` of a bf16 tensor by a 0-dim fp32 device tensor takes its slow non-vectorised path (270 against
an expected 65 µs for a 32k x 2k weight gradient on an H200).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, launcher, on_device

BLOCK_V = 4096  # vocabulary columns per loop step of a row program
MEAN, SUM = 0, 1


@triton.jit
def _ce_rows(L, stride_l, T, LOSS, N_VALID, n_cols, ignore_index, MEAN_REDUCTION: tl.constexpr, BLOCK: tl.constexpr):
    """Loss of one logits row, then the row overwritten with d(loss)/d(logits) (0 for an ignored token)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = L + row * stride_l
    target = tl.load(T + row)
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        for start in range(0, n_cols, BLOCK):
            tl.store(row_ptr + start + cols, tl.zeros((BLOCK,), dtype=tl.float32).to(L.dtype.element_ty),
                     mask=start + cols < n_cols)
        tl.store(LOSS + row, 0.0)
    else:
        # pass 1: running max m and sum d of exp(x - m) over the row (online softmax)
        m = -float("inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            x = tl.load(row_ptr + start + cols, mask=start + cols < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)
        x_target = tl.load(row_ptr + target).to(tl.float32)
        tl.store(LOSS + row, lse - x_target)
        scale = 1.0
        if MEAN_REDUCTION:
            scale = 1.0 / tl.load(N_VALID).to(tl.float32)
        # pass 2: the gradient (softmax - onehot) * scale, in place
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(row_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)
            tl.store(row_ptr + start + cols, (g * scale).to(L.dtype.element_ty), mask=mask)


@triton.jit
def _scale_in_place(X, S, n, BLOCK: tl.constexpr):
    """X *= S[0] (an fp32 scalar on the device), computed in fp32 and rounded once to X's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    s = tl.load(S).to(tl.float32)
    tl.store(X + offsets, (tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32) * s).to(X.dtype.element_ty),
             mask=mask)


SCALE_BLOCK = 4096
TOKENS_BLOCK = 1024  # tokens a step of the one-program count and total below


@triton.jit
def _count_valid(T, OUT, n, ignore_index, BLOCK: tl.constexpr):
    """OUT = how many targets are not ``ignore_index`` (int32 count, stored as fp32): one program."""
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        t = tl.load(T + offsets, mask=offsets < n, other=ignore_index)
        count += tl.where(t != ignore_index, 1, 0).to(tl.int32)
    tl.store(OUT, tl.sum(count, axis=0).to(tl.float32))


@triton.jit
def _total_loss(LOSS, N_VALID, OUT, n, MEAN_REDUCTION: tl.constexpr, BLOCK: tl.constexpr):
    """OUT = the per-token losses summed in fp32 (over n_valid for the mean; 0/0 is NaN, as torch's): one program."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(LOSS + offsets, mask=offsets < n, other=0.0)
    total = tl.sum(acc, axis=0)
    if MEAN_REDUCTION:
        total = total / tl.load(N_VALID)
    tl.store(OUT, total)


def scale_in_place(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous) times the 0-dim ``scale``, in place; a non-contiguous ``x`` takes torch's ``mul_``."""
    if not x.is_contiguous() or x.numel() == 0:
        return x.mul_(scale)
    check_device(_scale_in_place, x.device)
    with on_device(x.device):
        launcher(_scale_in_place)[(triton.cdiv(x.numel(), SCALE_BLOCK),)](x, scale.to(torch.float32).reshape(1), x.numel(),
                                                                           BLOCK=SCALE_BLOCK, num_warps=8)
    return x


LOGITS_BUDGET = 768 * 2**20  # bytes of one chunk's logits (bf16 at vocab 128k: 3072 tokens)
MIN_CHUNK, MAX_CHUNK = 256, 8192  # tokens: fewer starve the matmuls; more gain nothing
ALIGN = 128  # chunk sizes are multiples of this (matmul tiles)


def default_chunk(tokens: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk: the fewest chunks whose logits fit LOGITS_BUDGET, split evenly (multiples of 128).

    Each chunk after the first re-reads and re-writes the weight gradient (V x H) in its accumulating
    matmul, so every extra chunk costs a pass over it; one chunk's logits cost memory. On an H100 at 8k
    tokens, hidden 4096, vocab 128k, bf16, fwd+bwd: 2048-token chunks ran at 0.95x torch.compile of the
    unfused head and loss with 18 % of its peak memory; 4096-token chunks at 1.02x with 25.5 %. Even
    chunks under this budget (3 x ~2.7k tokens) keep the peak under a quarter. At 2k tokens and vocab 32k
    this is one chunk: still no fp32 copy of the logits and no separate gradient buffer for them.
    """
    fit = min(MAX_CHUNK, max(MIN_CHUNK, LOGITS_BUDGET // max(1, vocab * element_size)))
    count = -(-tokens // fit)
    even = -(-tokens // max(1, count))
    chunk = min(fit, -(-even // ALIGN) * ALIGN) if even > ALIGN else even
    return max(1, min(tokens, chunk))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                         reduction: int, chunk_size: int, grad_hidden: bool, grad_weight: bool,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss in fp32, d loss/d hidden, d loss/d weight) for hidden (N, H), weight (V, H), target (N,).

    A gradient not asked for comes back empty. ``chunk_size`` <= 0 picks ``default_chunk``.
    """
    check_device(_ce_rows, hidden.device)
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = chunk_size if chunk_size > 0 else default_chunk(n, vocab, hidden.element_size())
    target = target.contiguous()
    per_token = torch.empty((n,), dtype=torch.float32, device=hidden.device)
    # the count and the total are one small kernel each (torch's compare, sum, cast and divide were five
    # launches, 10 of 450 µs of the forward at 2048 tokens on an H200); both stay on the device: no host sync
    n_valid = torch.empty((), dtype=torch.float32, device=hidden.device)
    loss = torch.empty((), dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    # The first chunk writes dW, the others accumulate: no pass to zero a (V, H) buffer first.
    dw = (torch.empty_like(weight) if n else torch.zeros_like(weight)) if grad_weight else weight.new_empty(0)
    block = min(BLOCK_V, triton.next_power_of_2(max(vocab, 1)))
    with on_device(hidden.device):
        launcher(_count_valid)[(1,)](target, n_valid, n, ignore_index, BLOCK=TOKENS_BLOCK, num_warps=4)
        for start in range(0, n, chunk):
            h_c = hidden[start:start + chunk]
            logits = h_c @ weight.t()  # (C, V) in the inputs' dtype, fp32 accumulation in the matmul
            launcher(_ce_rows)[(h_c.shape[0],)](logits, logits.stride(0), target[start:start + chunk], per_token[start:start + chunk],
                                      n_valid, vocab, ignore_index, MEAN_REDUCTION=reduction == MEAN, BLOCK=block,
                                      num_warps=8 if block >= 2048 else 4)
            if grad_hidden:
                torch.mm(logits, weight, out=dh[start:start + chunk])
            if grad_weight and start == 0:
                torch.mm(logits.t(), h_c, out=dw)
            elif grad_weight:
                dw.addmm_(logits.t(), h_c)
        launcher(_total_loss)[(1,)](per_token, n_valid, loss, n, MEAN_REDUCTION=reduction == MEAN, BLOCK=TOKENS_BLOCK,
                                    num_warps=4)
    return loss, dh, dw
