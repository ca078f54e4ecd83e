"""The linear of the decoder layers: plain, split for the zero-bubble schedules, or fp8 on fp8-mixed stages.

A stage in ``precision: fp8-mixed`` runs its decoder layers' linear layers with fp8 forward matmuls
(``hal.precision.fp8.scaled_linear``: per-tensor scaled e4m3, ``torch._scaled_mm``) and everything else under
bf16 autocast; the LM head stays in bf16 (its logits feed the loss directly). The engine turns fp8
on around a stage's forward (``fp8_matmuls``); a layer whose shape ``_scaled_mm`` cannot take (a
dimension not a multiple of 16) runs in bf16 and the downgrade is recorded, never silent.

Why hal's own ``scaled_mm`` path and not torchao's float8 training: torchao is not a dependency and is
absent from the GPU machines this was measured on; the recipe here is the simple one (dynamic
per-tensor scales, fp8 forward only) and swaps for torchao's ``convert_to_float8_training`` where it
is installed and a finer recipe (rowwise scales, fp8 backward) is wanted.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from hal.downgrades import Downgrade, record_downgrade
from hal.parallel.models.weight_grad import split_linear

_FP8: torch.dtype | None = None  # the fp8 format of this stage's forward matmuls (set by ``fp8_matmuls``)
_MULTIPLE = 16


@contextlib.contextmanager
def fp8_matmuls(dtype: torch.dtype | None) -> Iterator[None]:
    """Inside, the decoder layers' linears run fp8 forward matmuls of ``dtype`` (None: off)."""
    global _FP8
    before, _FP8 = _FP8, dtype
    try:
        yield
    finally:
        _FP8 = before


def fp8_setting() -> torch.dtype | None:
    """The fp8 format the decoder layers' forward matmuls now run in, None for none (what a recompute must use again)."""
    return _FP8


def layer_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a decoder layer: fp8 inside ``fp8_matmuls``, else ``split_linear``.

    Under fp8 the bias is added after the scaled matmul, in its output dtype (``_scaled_mm`` takes none here).
    """
    if _FP8 is None:
        return split_linear(x, weight, bias)
    if x.shape[-1] % _MULTIPLE or weight.shape[0] % _MULTIPLE:
        record_downgrade(Downgrade("op", f"fp8 linear {tuple(weight.shape)}", "fp8 matmul", "bf16 matmul",
                                   f"torch._scaled_mm needs both dimensions divisible by {_MULTIPLE}"))
        return split_linear(x, weight, bias)
    from hal.precision.fp8 import scaled_linear

    kind = x.device.type
    out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.bfloat16
    out = scaled_linear(x, weight, fp8_dtype=_FP8, out_dtype=out_dtype)
    return out if bias is None else out + bias.to(out.dtype)


__all__ = ["fp8_matmuls", "fp8_setting", "layer_linear"]
