"""GPT-NeoX's blocks. Parameter names: ``attn_norm.{weight,bias}``, ``attn.qkv.{weight,bias}`` (laid out per head as
[q, k, v], as transformers' ``query_key_value``, so a column split over tp gives each rank whole heads),
``attn.out.{weight,bias}``, ``mlp_norm.{weight,bias}``, ``mlp.up.{weight,bias}``, ``mlp.down.{weight,bias}``."""
from __future__ import annotations

import torch
from torch import nn

from hal import ops
from hal.parallel.families.gpt_neox import rotary_dims
from hal.parallel.families.rotary import add_rope_buffers, cached_rope
from hal.parallel.families.spec import ModelShape, Parts


class NeoXAttention(nn.Module):
    """Multi-head attention with biases; rotary embeddings on the first ``rotary_dims`` channels of each head."""

    def __init__(self, config: ModelShape, parts: Parts) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads, self.head_dim, self.theta = config.num_heads // parts.tp, config.head_dim, config.rope_theta
        self.rotated = rotary_dims(config)
        self.qkv = parts.column(h, 3 * h, bias=True)
        self.out = parts.row(h, h, bias=True)
        add_rope_buffers(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, S, heads/tp × [q, k, v] × head_dim) with the full sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, self.heads, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        cos, sin = cached_rope(self, s, self.rotated, self.theta, q)
        r = self.rotated
        q = torch.cat([ops.rotary_embedding(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([ops.rotary_embedding(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        o = ops.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class NeoXMLP(nn.Module):
    """up (column-parallel, bias), the activation, down (row-parallel, bias)."""

    def __init__(self, config: ModelShape, parts: Parts) -> None:
        super().__init__()
        self.up = parts.column(config.hidden_size, config.ffn_hidden_size, bias=True)
        self.down = parts.row(config.ffn_hidden_size, config.hidden_size, bias=True)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(activate(self.up(x), self.activation))


def activate(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``model.activation`` on ``x`` through hal's ops (gelu_tanh: GELU's tanh form)."""
    if kind == "gelu":
        return ops.gelu(x)
    if kind == "gelu_tanh":
        return ops.gelu(x, approximate="tanh")
    if kind == "silu":
        return ops.silu(x)
    if kind == "relu":
        return torch.relu(x)
    raise ValueError(f"activation {kind!r} is not one model.activation allows")


class NeoXLayer(nn.Module):
    """Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)); else x' = x + attn(ln1(x)), then x' + mlp(ln2(x'))."""

    def __init__(self, config: ModelShape, parts: Parts) -> None:
        super().__init__()
        self.attn_norm = parts.layer_norm(config.hidden_size, config.norm_eps)
        self.attn = NeoXAttention(config, parts)
        self.mlp_norm = parts.layer_norm(config.hidden_size, config.norm_eps)
        self.mlp = NeoXMLP(config, parts)
        self.parallel = config.parallel_residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attn(self.attn_norm(x))
        if self.parallel:
            return self.mlp(self.mlp_norm(x)) + attn + x
        x = attn + x
        return self.mlp(self.mlp_norm(x)) + x


__all__ = ["NeoXAttention", "NeoXLayer", "NeoXMLP", "activate"]
