"""Known faults planted in the candidate, each of which the parity verdict must catch (``--plant``, and the tests):
what a bring-up team runs first to see the check has teeth on their own setup.

- ``lr+5%``: the learning rate 1.05 × the reference's — a config slip no single step shows.
- ``half-grad``: one layer's weight gradient (layers.1's MLP down projection) halved — a broken backward kernel.
- ``data-order``: the data order drawn from another seed — a loader that shuffles differently.
- ``bf16-accumulate``: every linear layer's matmul summed in bfloat16, 16 products at a time — a kernel that
  accumulates in the input dtype instead of fp32 (runs in bf16-mixed).

The model has no dropout, so "dropout seeded differently" has nothing to act on here; ``data-order`` is its kin.
"""
from __future__ import annotations

from typing import Callable

import torch

from .runs import DATA_SEED, Candidate

_WEIGHT = "layers.1.mlp.down.weight"


def _halve_one_layer(model: torch.nn.Module) -> None:
    weight = dict(model.named_parameters()).get(_WEIGHT)
    if weight is None:
        raise ValueError(f"the model has no {_WEIGHT} (it needs 2 or more layers)")
    weight.register_hook(lambda g: g * 0.5)


def _bf16_accumulating_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ with the running sum kept in bfloat16, 16 products of the inner dimension at a time."""
    x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    total = None
    for start in range(0, x16.shape[-1], 16):
        part = (x16[..., start:start + 16].float() @ w16[:, start:start + 16].float().t()).to(torch.bfloat16)
        total = part if total is None else (total + part)  # bf16 + bf16: rounded to bf16 at every chunk
    assert total is not None
    return total if bias is None else total + bias.to(total.dtype)


_LINEARS = ("Linear", "ColumnParallelLinear", "RowParallelLinear")  # the model's, at tp 1: y = x Wᵀ (+ b)


def _accumulate_in_bf16(model: torch.nn.Module) -> None:
    for module in model.modules():
        if type(module).__name__ in _LINEARS:
            module.forward = (lambda m: (lambda x: _bf16_accumulating_linear(x, m.weight, m.bias)))(module)  # type: ignore[method-assign]


FAULTS: dict[str, tuple[str, Callable[[], Candidate]]] = {
    "lr+5%": ("learning rate 1.05 x the reference's", lambda: Candidate(lr_scale=1.05, fault="lr+5%")),
    "half-grad": (f"{_WEIGHT}'s gradient halved", lambda: Candidate(tamper=_halve_one_layer, fault="half-grad")),
    "data-order": ("the data order drawn from another seed", lambda: Candidate(data_seed=DATA_SEED + 1, fault="data-order")),
    "bf16-accumulate": ("every linear layer's matmul accumulated in bfloat16",
                        lambda: Candidate(tamper=_accumulate_in_bf16, fault="bf16-accumulate")),
}
