"""The split backward of the zero-bubble schedules: input gradients now, the linear layers' weight gradients later."""
from __future__ import annotations

import torch

from hal.parallel.weight_grad import WeightGradStore, collecting, split_linear, splittable


def _leaves(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.nn.Parameter, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=dtype, requires_grad=True)
    w1 = torch.nn.Parameter(torch.randn(6, 8, generator=g, dtype=dtype))
    w2 = torch.nn.Parameter(torch.randn(4, 6, generator=g, dtype=dtype))
    return x, w1, w2


def _two_layers(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return split_linear(torch.tanh(split_linear(x, w1)), w2).square().sum()


def test_deferred_weight_gradients_equal_the_plain_backward() -> None:
    x, w1, w2 = _leaves()
    _two_layers(x, w1, w2).backward()
    want = [t.grad.clone() for t in (x, w1, w2)]
    x, w1, w2 = _leaves()
    with splittable():
        loss = _two_layers(x, w1, w2)
    store = WeightGradStore()
    with collecting(store):
        loss.backward()
    assert len(store) == 2 and w1.grad is None and w2.grad is None  # I: only the input gradient
    torch.testing.assert_close(x.grad, want[0])
    store.run()  # W
    assert len(store) == 0
    torch.testing.assert_close(w1.grad, want[1])
    torch.testing.assert_close(w2.grad, want[2])


def test_a_split_linear_outside_a_collecting_store_computes_both_gradients_and_accumulates() -> None:
    x, w1, w2 = _leaves()
    with splittable():
        loss = _two_layers(x, w1, w2)
    loss.backward()  # no store: an ordinary backward
    first = w1.grad.clone()
    with splittable():
        loss = _two_layers(x, w1, w2)
    store = WeightGradStore()
    with collecting(store):
        loss.backward()
    store.run()
    torch.testing.assert_close(w1.grad, 2 * first)  # a deferred gradient adds to what .grad held


def test_under_autocast_the_weight_gradient_keeps_the_parameter_dtype() -> None:
    x, w1, w2 = _leaves(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = split_linear(x, w1)
        with splittable():
            split = split_linear(x, w1)
    assert split.dtype == plain.dtype == torch.bfloat16
    store = WeightGradStore()
    with collecting(store):
        split.float().sum().backward()
    store.run()
    assert w1.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    torch.testing.assert_close(w1.grad, x.detach().reshape(-1, 8).sum(0).expand(6, 8), rtol=2e-2, atol=2e-2)
