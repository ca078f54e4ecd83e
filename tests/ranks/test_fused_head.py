"""The fused LM head + cross-entropy (parallel.models.fused_head): chunked, vocab-parallel, equal to the plain head."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hal.parallel.models.fused_head import VocabParallelLinearCrossEntropy, chunk_tokens

from ..dist_harness import ok_values, run_world

TOKENS, HIDDEN, VOCAB = 13, 6, 10


def _inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    target[[2, 7]] = -100  # ignored tokens, one of them inside every chunking below
    return hidden, weight, target


def _reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), target, reduction="sum")
    (loss * 0.37).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 4, 5, TOKENS])
def test_chunks_and_ignored_tokens_match_the_plain_head(chunk: int) -> None:
    hidden, weight, target = _inputs()
    want_loss, want_dh, want_dw = _reference(hidden, weight, target)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = VocabParallelLinearCrossEntropy.apply(h, w, target, None, -100, chunk)
    (loss * 0.37).backward()
    assert loss.dtype == torch.float32  # the sum is kept in fp32 whatever the inputs
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, want_dh, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-6, atol=1e-7)


def test_every_token_ignored_gives_zero_loss_and_zero_gradients() -> None:
    hidden, weight, _ = _inputs(torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = VocabParallelLinearCrossEntropy.apply(h, w, torch.full((TOKENS,), -100), None, -100, 4)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not h.grad.any() and not w.grad.any()


def test_the_backward_runs_once() -> None:
    hidden, weight, target = _inputs(torch.float32)
    loss = VocabParallelLinearCrossEntropy.apply(hidden.requires_grad_(), weight.requires_grad_(), target, None, -100, 4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


def test_chunks_fit_the_logits_budget() -> None:
    assert chunk_tokens(100, 64) == 100  # small: one chunk
    assert chunk_tokens(1 << 20, 128 * 1024) == 512  # 256 MiB of fp32 logits at a 128k vocab slice
    assert chunk_tokens(1 << 20, 1 << 30) == 256  # never fewer tokens than MIN_CHUNK


def test_autocast_runs_the_head_in_its_dtype_and_keeps_the_loss_in_fp32() -> None:
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.fused_head import fused_head_cross_entropy
    from hal.parallel.models.stage import build_stage

    config = ModelConfig(vocab_size=VOCAB, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=16, max_seq_len=4)
    stage = build_stage(config, range(1), first=True, last=True, tp_comm=None, sp=False, seed=0, fused_head=True)
    plain = build_stage(config, range(1), first=True, last=True, tp_comm=None, sp=False, seed=0)
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss_fn = fused_head_cross_entropy(stage, token_count=y.numel())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(stage(x), y)
        want = F.cross_entropy(plain(x).float().reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    assert loss.dtype == torch.float32 and stage.head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=2e-2)


# --- tensor parallel: two ranks, each with half the vocabulary ---------------------------------------------
def tp_body(rank: int, world: int, chunk: int) -> dict[str, Any]:
    from hal.collectives import world_communicator

    comm = world_communicator()
    hidden, weight, target = _inputs()
    rows = VOCAB // world
    h = hidden.clone().requires_grad_()
    w = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    loss = VocabParallelLinearCrossEntropy.apply(h, w, target, comm, -100, chunk)
    (loss * 0.37).backward()
    return {"loss": float(loss), "dh": h.grad.tolist(), "dw": w.grad.tolist()}


@pytest.mark.parametrize("chunk", [4, TOKENS])
def test_vocab_parallel_over_two_ranks_equals_the_full_head(chunk: int) -> None:
    values = ok_values(run_world("tests.ranks.test_fused_head", "tp_body", 2, deadline_s=120, chunk=chunk), 2)
    want_loss, want_dh, want_dw = _reference(*_inputs())
    for rank, got in values.items():
        assert got["loss"] == pytest.approx(float(want_loss), rel=1e-6)  # the same loss on every TP rank
        torch.testing.assert_close(torch.tensor(got["dw"], dtype=torch.float64), want_dw[rank * 5:(rank + 1) * 5], rtol=1e-6, atol=1e-7)
    # Each rank's input gradient is its vocabulary slice's part; the TP all-reduce (parallel_input) sums them.
    summed = sum(torch.tensor(v["dh"], dtype=torch.float64) for v in values.values())
    torch.testing.assert_close(summed, want_dh, rtol=1e-6, atol=1e-7)
