"""The Llama decoder's blocks: grouped-query attention with rotary embeddings (an optional q, k, v bias), the SwiGLU
MLP or the MoE feed-forward, RMSNorm before each, one residual step after the other. Parameter names (the init's
seeds and the checkpoint's keys): ``attn_norm.weight``, ``attn.qkv.weight`` (``.bias``), ``attn.out.weight``,
``mlp_norm.weight``, ``mlp.gate_up.weight``, ``mlp.down.weight``."""
from __future__ import annotations

import torch
from torch import nn

from hal import ops
from hal.parallel.families.rotary import add_rope_buffers, cached_rope
from hal.parallel.families.spec import ROPE_SCALING_KEYS, ModelShape, Parts


class Attention(nn.Module):
    """Grouped-query attention: fused QKV column-parallel over heads, output row-parallel.

    Each TP rank owns num_heads/tp query heads and num_kv_heads/tp kv heads, so attention itself
    needs no communication; under SP the QKV projection gathers the full sequence first.
    """

    def __init__(self, config: ModelShape, parts: Parts) -> None:
        super().__init__()
        tp, hd = parts.tp, config.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta = config.num_heads // tp, config.num_kv_heads // tp, hd, config.rope_theta
        scaling = config.rope_scaling
        self.rope_scaling = None if scaling is None else tuple(float(scaling[k]) for k in ROPE_SCALING_KEYS)
        q, kv = config.num_heads * hd, config.num_kv_heads * hd
        self.qkv = parts.column(config.hidden_size, q + 2 * kv, parts=(q, kv, kv), bias=config.qkv_bias)
        self.out = parts.row(q, config.hidden_size)
        add_rope_buffers(self)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, heads, S, head_dim) from the fused projection."""
        qkv = self.qkv(x)  # (B, S, (h + 2 kv) * hd) with the full sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        b, _, s, _ = q.shape
        cos, sin = cached_rope(self, s, self.head_dim, self.theta, q, self.rope_scaling)
        q, k = ops.rotary_embedding(q, cos, sin), ops.rotary_embedding(k, cos, sin)
        o = ops.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: fused gate|up column-parallel (each rank holds [gate_t, up_t]), down row-parallel."""

    def __init__(self, config: ModelShape, parts: Parts) -> None:
        super().__init__()
        f = config.ffn_hidden_size
        self.gate_up = parts.column(config.hidden_size, 2 * f, parts=(f, f))
        self.down = parts.row(f, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops.swiglu(self.gate_up(x)))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); the residual stream is seq-sharded under SP.
    The feed-forward is the MoE block in the layers the config makes MoE layers (``ModelConfig.is_moe_layer``)."""

    def __init__(self, config: ModelShape, parts: Parts, index: int, attention: type[Attention] = Attention) -> None:
        super().__init__()
        self.attn_norm = parts.rms_norm(config.hidden_size, config.norm_eps)
        self.attn = attention(config, parts)
        self.mlp_norm = parts.rms_norm(config.hidden_size, config.norm_eps)
        self.mlp: nn.Module = parts.moe(index) if config.is_moe_layer(index) else MLP(config, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed, x = self.mlp_norm.add_forward(self.attn(self.attn_norm(x)), x)  # x + attn(...), normalised
        return x + self.mlp(normed)


__all__ = ["Attention", "DecoderLayer", "MLP"]
