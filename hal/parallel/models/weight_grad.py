"""A backward split in two: input gradients now, weight gradients later (the zero-bubble schedules).

Zero-bubble pipeline schedules (arXiv 2401.10241) run a micro-batch's backward as two actions: ``I``
computes the gradient of the stage's input (what the previous stage waits for) and ``W`` the weight
gradients, which nobody waits for and which the schedule moves into the pipeline's bubbles. The
weight gradients of a transformer are those of its linear layers (``dW = dYᵀ X``): the linear layers
run through ``split_linear`` while ``splittable()`` is on, and their backward, when a
``WeightGradStore`` is collecting (``collecting(store)``), keeps (X, dY) in the store instead of
multiplying; ``store.run()`` (the ``W`` action) does the multiplications later — a linear's bias
gradient (Qwen2's qkv bias) goes with its weight's. Every other parameter (norms, the embedding) gets
its gradient in ``I``, as usual. Outside ``collecting`` the split
linear's backward computes both gradients at once, so a plain ``loss.backward()`` still works.

The switch and the store are process-wide, not thread-local: a CUDA backward runs in autograd's
device thread, and a pipeline rank runs one backward at a time.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from hal import ops
from hal.parallel.models.graph_breaks import eager_when_compiled

_SPLIT = False  # forwards build split linears (set by ``splittable``)
_STORE: WeightGradStore | None = None  # the store a running backward defers into (set by ``collecting``)


class WeightGradStore:
    """The deferred weight-gradient products of one micro-batch's backward, run by its ``W`` action."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []

    def defer(self, work: Callable[[], None]) -> None:
        self._pending.append(work)

    def run(self) -> None:
        """Compute and accumulate every deferred weight gradient, in the order they were deferred."""
        pending, self._pending = self._pending, []
        for work in pending:
            work()

    def __len__(self) -> int:
        return len(self._pending)


@contextlib.contextmanager
def splittable(on: bool = True) -> Iterator[None]:
    """Forwards inside build linears whose weight gradient can be deferred (``split_linear``)."""
    global _SPLIT
    before, _SPLIT = _SPLIT, on
    try:
        yield
    finally:
        _SPLIT = before


def split_setting() -> bool:
    """Whether forwards now build splittable linears (what a recompute must build again: ``decoder._Replayed``)."""
    return _SPLIT


@contextlib.contextmanager
def collecting(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """A backward run inside defers the split linears' weight gradients into ``store``."""
    global _STORE
    before, _STORE = _STORE, store
    try:
        yield store
    finally:
        _STORE = before


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear(x, weight, bias)``; under ``splittable()`` its weight (and bias) gradient can be deferred."""
    if _SPLIT and torch.is_grad_enabled() and weight.requires_grad:
        return _apply_split_linear(x, weight, bias)
    return ops.linear(x, weight, bias)


@eager_when_compiled
def _apply_split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Inside a compiled layer the split linear runs eagerly between the layer's graphs (a graph break a linear):
    traced, its backward would be baked into the layer's backward graph with whatever store was collecting at
    trace time, and the weight gradient could never be deferred. The graphs around it keep the layer's fusions."""
    return _SplitLinear.apply(x, weight, bias)


class _SplitLinear(torch.autograd.Function):
    """y = x Wᵀ + b whose backward returns dX and either returns dW, db or leaves them to the collecting store.

    The bias gradient (the sum of dY over tokens) is a parameter gradient like dW, so it goes with the
    weight half: nobody downstream waits for it, and ``W`` adds both to their ``.grad`` together.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = ops.linear(x, weight, bias)  # the registry's implementation; autocast casts its inputs as for any linear
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)  # the parameter objects themselves: a deferred gradient is added to their .grad
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        # In the forward's compute dtype (the output's, after autocast), as autograd's own linear backward.
        grad_x = (grad @ weight.to(grad.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        want_w, want_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return grad_x, None, None
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(grad.dtype)
        param_w, param_b = ctx.params

        def grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            dw = (grad_2d.t() @ x_2d).to(param_w.dtype) if want_w else None
            db = grad_2d.sum(dim=0).to(param_b.dtype) if want_b else None
            return dw, db

        store = _STORE
        if store is None:
            return (grad_x, *grads())

        def weight_grad() -> None:
            for param, g in zip((param_w, param_b), grads()):
                if g is None:
                    continue
                if param.grad is None:
                    param.grad = g
                else:
                    param.grad.add_(g)

        store.defer(weight_grad)
        return grad_x, None, None


__all__ = ["WeightGradStore", "collecting", "split_linear", "split_setting", "splittable"]
