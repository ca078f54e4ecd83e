"""hal's global parameter names ↔ Hugging Face's Llama / Mistral / Qwen2 tensor names, both ways.

One table serves loading (``parallel.hf_weights``) and export (``parallel.hf_export``), so the two
cannot disagree. A fused hal parameter is several Hugging Face tensors stacked along its ShardSpec's
dim, in its parts' order: ``attn.qkv`` = q_proj | k_proj | v_proj, ``mlp.gate_up`` = gate_proj | up_proj.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .layers import ParamMeta

_TOP: dict[str, tuple[str, ...]] = {
    "embed.weight": ("model.embed_tokens.weight",),
    "norm.weight": ("model.norm.weight",),
    "head.weight": ("lm_head.weight",),
}
_IN_LAYER: dict[str, tuple[str, ...]] = {
    "attn_norm.weight": ("input_layernorm.weight",),
    "mlp_norm.weight": ("post_attention_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.out.weight": ("self_attn.o_proj.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face tensors hal parameter ``name`` is made of, in its parts' order."""
    if name in _TOP:
        return _TOP[name]
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _IN_LAYER:
        return tuple(f"model.layers.{match.group(1)}.{part}" for part in _IN_LAYER[match.group(2)])
    raise ValueError(f"parameter {name!r} has no Hugging Face name")


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor inside a hal parameter: its name and shape, and where it sits (``dim``, ``start``)."""

    hf_name: str
    shape: tuple[int, ...]
    dim: int
    start: int


def pieces(name: str, meta: ParamMeta) -> list[Piece]:
    """Hal parameter ``name`` as Hugging Face tensors, each with its place in the full hal tensor."""
    names = hf_names(name)
    if len(names) == 1:
        return [Piece(names[0], tuple(meta.full_shape), meta.spec.dim if meta.spec is not None else 0, 0)]
    if meta.spec is None or len(meta.spec.parts) != len(names):
        raise ValueError(f"parameter {name!r} is fused from {len(names)} tensors but its ShardSpec has no matching parts")
    dim, out, start = meta.spec.dim, [], 0
    for hf_name, size in zip(names, meta.spec.parts):
        shape = list(meta.full_shape)
        shape[dim] = size
        out.append(Piece(hf_name, tuple(shape), dim, start))
        start += size
    return out


__all__ = ["Piece", "hf_names", "pieces"]
