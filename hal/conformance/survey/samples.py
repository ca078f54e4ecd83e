"""OpInfo sample inputs moved to the device or widened to float64, outputs flattened, gradients taken.

A sample is drawn once on the device (seeded, by OpInfo's own sample function, so an argument the op wants on the
host stays there) and copied to the host: widened exactly (float → float64, complex → complex128) for the golden
reference, and as it is for the CPU kernel in the same dtype, so all three compute from the same numbers.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

WIDE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
        torch.float64: torch.float64, torch.complex32: torch.complex128, torch.complex64: torch.complex128,
        torch.complex128: torch.complex128}


def _leaf(t: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    moved = moved.detach()
    if t.requires_grad and (moved.is_floating_point() or moved.is_complex()):
        moved.requires_grad_(True)
    return moved


def to_device(sample: Any, device: torch.device) -> Any:
    """The sample with every tensor copied to ``device`` (leaves that required grad still do)."""
    return sample.transform(lambda t: _leaf(t, t.to(device)) if isinstance(t, torch.Tensor) else t)


def widened(sample: Any) -> Any:
    """The sample with floating tensors and dtype arguments widened to float64 / complex128 (exact)."""
    def widen(t: Any) -> Any:
        if isinstance(t, torch.dtype):
            return WIDE.get(t, t)
        return _leaf(t, t.to(WIDE[t.dtype])) if t.dtype in WIDE else _leaf(t, t.clone())
    return sample.transform(widen)


def copied(sample: Any) -> Any:
    """The sample with every tensor copied (an op that writes into its input must not touch the other runs')."""
    return sample.transform(lambda t: _leaf(t, t.clone()) if isinstance(t, torch.Tensor) else t)


def grad_leaves(sample: Any) -> list[torch.Tensor]:
    """The sample's tensors that require grad, in a fixed order (input, args, kwargs)."""
    found: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                found.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
    walk(sample.input)
    walk(sample.args)
    walk(sample.kwargs)
    return found


def tensor_bytes(sample: Any) -> int:
    """The bytes of the sample's tensors (what a host fallback copies off the device)."""
    total = 0

    def count(t: Any) -> Any:
        nonlocal total
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        return t
    sample.transform(count)
    return total


def flatten(value: Any, name: str = "out") -> list[tuple[str, Any]]:
    """(name, tensor or plain value) for every leaf of an op's result: tuples, lists and return types walked."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, torch.Size):
        return [(name, tuple(value))]
    if isinstance(value, (list, tuple)):
        out: list[tuple[str, Any]] = []
        for i, v in enumerate(value):
            out.extend(flatten(v, f"{name}[{i}]"))
        return out
    return [(name, value)]


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.resolve_conj().resolve_neg()


def to_host(flat: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Every tensor of a flattened result copied to the host, dense, with conjugate and negative views resolved."""
    return [(n, _host(v) if isinstance(v, torch.Tensor) else v) for n, v in flat]


def differentiable(flat: list[tuple[str, Any]]) -> list[torch.Tensor]:
    return [v for _, v in flat if isinstance(v, torch.Tensor) and v.grad_fn is not None
            and (v.is_floating_point() or v.is_complex())]


def cotangents(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Seeded random output gradients on the host, in each output's dtype (then copied like the inputs)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) if not o.is_complex()
            else torch.randn(o.shape, generator=gen, dtype=torch.complex128).to(o.dtype) for o in outputs]


def gradients(outputs: list[torch.Tensor], leaves: list[torch.Tensor], cots: list[torch.Tensor],
              move: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[str, Any]]:
    """d(Σ cot·out)/d(leaf) for every leaf (an unused leaf: zeros of its shape, as the reference's)."""
    if not outputs or not leaves:
        return []
    grads = torch.autograd.grad(outputs, leaves, [move(c) for c in cots], allow_unused=True)
    return [(f"grad[{i}]", g if g is not None else torch.zeros_like(leaf)) for i, (g, leaf) in enumerate(zip(grads, leaves))]
