"""Rotary position embeddings' tables, shared by the families' attention blocks (torch; imported with a block).

Each attention module keeps the tables of the last (positions, dtype, device) it saw eagerly in two non-persistent
buffers, ``rope_cos`` and ``rope_sin``: a compiled layer reads them instead of tracing ``rope_tables`` (host
float64 math, and an lru_cache Dynamo ignores) in every call.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn


@functools.lru_cache(maxsize=16)
def rope_tables(seq: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
                scaling: tuple[float, float, float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq, head_dim) for positions 0..seq-1, in the rotate-half layout.

    ``scaling``: Llama 3's (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    wavelengths longer than original/low are divided by ``factor``, those shorter than original/high
    kept, and the band between blended smoothly (as the reference implementation does).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, *scaling)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def _llama3_scaled(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: float) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength) - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    middle = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(middle, blended, out)


def compiling() -> bool:
    """Whether Dynamo is tracing this call (``torch.compiler.is_compiling``; older torch: ``torch._dynamo``'s)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling
    return bool(check())


def add_rope_buffers(module: nn.Module) -> None:
    """The two cached tables on ``module`` (not saved: ``persistent=False``)."""
    module.register_buffer("rope_cos", None, persistent=False)
    module.register_buffer("rope_sin", None, persistent=False)


def cached_rope(module: nn.Module, seq: int, dim: int, theta: float, like: torch.Tensor,
                scaling: tuple[float, float, float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for ``seq`` positions over ``dim`` rotated channels, in ``like``'s dtype and device: ``module``'s
    cached tables when they fit, else new ones, kept on an eager call (hal's compiled stages run one eagerly first)."""
    cos, sin = module.rope_cos, module.rope_sin
    if cos is not None and sin is not None and cos.shape[0] == seq and cos.dtype == like.dtype and cos.device == like.device:
        return cos, sin
    cos, sin = rope_tables(seq, dim, theta, like.device, like.dtype, scaling)
    if not compiling():
        module.rope_cos, module.rope_sin = cos, sin
    return cos, sin


__all__ = ["add_rope_buffers", "cached_rope", "compiling", "rope_tables"]
