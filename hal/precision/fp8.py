"""fp8 matmuls for ``precision: fp8-mixed``: per-tensor scaled e4m3 forward, bf16 backward.

The forward quantises activations and weights to fp8 with one scale each (amax / fp8 max) and
multiplies with ``torch._scaled_mm`` (Hopper tensor cores on CUDA). The backward uses the
high-precision tensors in the output's dtype (bf16 under fp8-mixed, as autocast would run them), the
common recipe when fp8 is used for forward matmuls only; gradients come back in the inputs' dtypes.
"""
from __future__ import annotations

from typing import Any

import torch

from hal.errors import UnsupportedError

_MULTIPLE = 16  # _scaled_mm needs both matrix dimensions divisible by 16


def _quantize(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = amax / torch.finfo(fp8_dtype).max
    return (t.detach().float() / scale).to(fp8_dtype), scale


class _ScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8_dtype: torch.dtype,  # type: ignore[override]
                out_dtype: torch.dtype) -> torch.Tensor:
        xq, sx = _quantize(x2, fp8_dtype)
        wq, sw = _quantize(weight, fp8_dtype)
        out = torch._scaled_mm(
            xq, wq.t(), scale_a=sx, scale_b=sw,
            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype,
        )
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype)
        grad_w = grad.t() @ x2.to(grad.dtype)
        grad_b = grad.sum(0) if ctx.has_bias else None
        return grad_x.to(x2.dtype), grad_w.to(weight.dtype), grad_b, None, None


def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fp8_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``F.linear`` with an fp8 (e4m3 by default) forward matmul; shapes must be multiples of 16."""
    if not hasattr(torch, "_scaled_mm"):
        raise UnsupportedError(f"fp8 matmul needs torch._scaled_mm; torch {torch.__version__} lacks it; upgrade PyTorch")
    fp8_dtype = fp8_dtype or torch.float8_e4m3fn
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features)
    if in_features % _MULTIPLE or weight.shape[0] % _MULTIPLE:
        raise UnsupportedError(
            f"fp8 matmul needs in/out features divisible by {_MULTIPLE}, got {in_features}/{weight.shape[0]}; pad the layer"
        )
    out = _ScaledLinear.apply(x2, weight, bias, fp8_dtype, out_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
