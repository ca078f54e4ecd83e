"""hal's global parameter names ↔ Hugging Face's Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE tensor names, both ways.

One table serves loading (``parallel.models.hf_weights``) and export (``parallel.state.hf_export``), so the two
cannot disagree. A fused hal parameter is several Hugging Face tensors stacked along its ShardSpec's
dim, in its parts' order: ``attn.qkv`` = q_proj | k_proj | v_proj, ``mlp.gate_up`` = gate_proj | up_proj.
An MoE layer's stacked experts hold one Hugging Face tensor per expert (``Piece.index``): expert e's
``experts.gate_up[e]`` = its gate | up projection, ``experts.down[e]`` = its down projection, named as the
family names them (Mixtral: ``block_sparse_moe.experts.e.w1 | w3``, ``w2``; Qwen2-MoE:
``mlp.experts.e.gate_proj | up_proj``, ``down_proj``, plus its shared expert and that expert's gate).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from hal.parallel.models.layers import ParamMeta
from hal.parallel.config.model import ModelConfig

# Where an MoE layer's parts live in each family's checkpoint (inside ``model.layers.<i>.``).
_MOE: dict[str, dict[str, str]] = {
    "mixtral": {"router": "block_sparse_moe.gate.weight", "expert": "block_sparse_moe.experts.{e}.{part}.weight",
                "gate": "w1", "up": "w3", "down": "w2"},
    "qwen2_moe": {"router": "mlp.gate.weight", "expert": "mlp.experts.{e}.{part}.weight",
                  "gate": "gate_proj", "up": "up_proj", "down": "down_proj", "shared": "mlp.shared_expert.{part}.weight",
                  "shared_gate": "mlp.shared_expert_gate.weight"},
}
_MOE_PARAM = re.compile(r"layers\.(\d+)\.mlp\.(router\.gate\.weight|experts\.gate_up|experts\.down|shared\.gate_up\.weight|"
                        r"shared\.down\.weight|shared\.gate\.weight)")


def hf_family(model: ModelConfig) -> str:
    """The Hugging Face family this model is named as: an MoE model is Qwen2-MoE when its q, k, v have a bias
    (Qwen2 attention), else Mixtral; a dense one Qwen2 or Llama (Mistral's names are Llama's)."""
    if model.moe_num_experts:
        return "qwen2_moe" if model.qkv_bias else "mixtral"
    return "qwen2" if model.qkv_bias else "llama"

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
    index: int | None = None  # a stacked parameter's slice it fills (an expert), before ``dim``/``start`` apply


def _moe_pieces(layer: str, part: str, meta: ParamMeta, family: str) -> list[Piece]:
    """An MoE layer's parameter as its family's tensors (replicated parameters: no TP split)."""
    if family not in _MOE:
        raise ValueError(f"an MoE parameter (layers.{layer}.mlp.{part}) has no {family} name; MoE families: {', '.join(_MOE)}")
    names, prefix, shape = _MOE[family], f"model.layers.{layer}.", tuple(meta.full_shape)
    if part == "router.gate.weight":
        return [Piece(prefix + names["router"], shape, 0, 0)]
    # Pieces lie along the FFN width (what TP splits): gate|up's rows, down's columns.
    if part.startswith("experts."):
        experts, rows = shape[0], shape[1]
        if part == "experts.gate_up":
            size = rows // 2
            return [Piece(prefix + names["expert"].format(e=e, part=names[kind]), (size, shape[2]), 0, k * size, index=e)
                    for e in range(experts) for k, kind in enumerate(("gate", "up"))]
        return [Piece(prefix + names["expert"].format(e=e, part=names["down"]), (rows, shape[2]), 1, 0, index=e)
                for e in range(experts)]
    if "shared" not in names:
        raise ValueError(f"{family} has no shared expert, so layers.{layer}.mlp.{part} has no Hugging Face name")
    if part == "shared.gate.weight":
        return [Piece(prefix + names["shared_gate"], shape, 0, 0)]
    if part == "shared.down.weight":
        return [Piece(prefix + names["shared"].format(part="down_proj"), shape, 1, 0)]
    size = shape[0] // 2
    return [Piece(prefix + names["shared"].format(part=kind), (size, shape[1]), 0, k * size)
            for k, kind in enumerate(("gate_proj", "up_proj"))]


def pieces(name: str, meta: ParamMeta, family: str = "llama") -> list[Piece]:
    """Hal parameter ``name`` as Hugging Face tensors, each with its place in the full hal tensor.
    ``family``: ``hf_family`` of the model (it names an MoE layer's parts)."""
    moe = _MOE_PARAM.fullmatch(name)
    if moe:
        return _moe_pieces(moe.group(1), moe.group(2), meta, family)
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


__all__ = ["Piece", "hf_family", "hf_names", "pieces"]
