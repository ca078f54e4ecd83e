"""Qwen3's blocks: Llama's decoder layer with an attention whose q and k heads are each RMS-normalised (``q_norm``,
``k_norm``, one head wide, shared by every head) before the rotary embedding."""
from __future__ import annotations

import torch

from hal.parallel.families.llama.blocks import Attention
from hal.parallel.families.spec import ModelShape, Parts


class Qwen3Attention(Attention):
    """Grouped-query attention, q and k normalised per head. Each TP rank normalises only its heads, so the norms'
    weight gradients are summed over tp (``Parts.head_norm``)."""

    def __init__(self, config: ModelShape, parts: Parts) -> None:
        super().__init__(config, parts)
        self.q_norm = parts.head_norm(config.head_dim, config.norm_eps)
        self.k_norm = parts.head_norm(config.head_dim, config.norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


__all__ = ["Qwen3Attention"]
