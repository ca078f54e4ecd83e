"""hal's global parameter names ↔ a family's Hugging Face tensor names (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3,
GPT-NeoX), both ways.

The names are the family's (``parallel.families``); this module lays them over hal's parameters. One table
serves loading (``parallel.models.hf_weights``) and export (``parallel.state.hf_export``), so the two
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

from hal.parallel.families.spec import Family
from hal.parallel.models.layers import ParamMeta

_MOE_PARAM = re.compile(r"layers\.(\d+)\.mlp\.(router\.gate\.weight|experts\.gate_up|experts\.down|shared\.gate_up\.weight|"
                        r"shared\.down\.weight|shared\.gate\.weight)")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def hf_names(name: str, family: Family) -> tuple[str, ...]:
    """The Hugging Face tensors hal parameter ``name`` is made of, in its parts' order (``family``'s tables)."""
    if name in family.top_names:
        return family.top_names[name]
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in family.layer_names:
        prefix = family.layer_prefix.format(i=match.group(1))
        return tuple(prefix + part for part in family.layer_names[match.group(2)])
    raise ValueError(f"parameter {name!r} has no Hugging Face name")


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor inside a hal parameter: its name and shape, and where it sits (``dim``, ``start``)."""

    hf_name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    index: int | None = None  # a stacked parameter's slice it fills (an expert), before ``dim``/``start`` apply


def _moe_pieces(layer: str, part: str, meta: ParamMeta, family: Family) -> list[Piece]:
    """An MoE layer's parameter as its family's tensors (replicated parameters: no TP split)."""
    names = family.moe_names
    if names is None:
        raise ValueError(f"an MoE parameter (layers.{layer}.mlp.{part}) has no {family} name; {family} has no MoE block")
    prefix, shape = family.layer_prefix.format(i=layer), tuple(meta.full_shape)
    if part == "router.gate.weight":
        return [Piece(prefix + names.router, shape, 0, 0)]
    # Pieces lie along the FFN width (what TP splits): gate|up's rows, down's columns.
    if part.startswith("experts."):
        experts, rows = shape[0], shape[1]
        if part == "experts.gate_up":
            size = rows // 2
            return [Piece(prefix + names.expert.format(e=e, part=part_name), (size, shape[2]), 0, k * size, index=e)
                    for e in range(experts) for k, part_name in enumerate((names.gate, names.up))]
        return [Piece(prefix + names.expert.format(e=e, part=names.down), (rows, shape[2]), 1, 0, index=e)
                for e in range(experts)]
    if names.shared is None or names.shared_gate is None:
        raise ValueError(f"{family} has no shared expert, so layers.{layer}.mlp.{part} has no Hugging Face name")
    if part == "shared.gate.weight":
        return [Piece(prefix + names.shared_gate, shape, 0, 0)]
    if part == "shared.down.weight":
        return [Piece(prefix + names.shared.format(part="down_proj"), shape, 1, 0)]
    size = shape[0] // 2
    return [Piece(prefix + names.shared.format(part=kind), (size, shape[1]), 0, k * size)
            for k, kind in enumerate(("gate_proj", "up_proj"))]


def pieces(name: str, meta: ParamMeta, family: Family) -> list[Piece]:
    """Hal parameter ``name`` as Hugging Face tensors, each with its place in the full hal tensor, in ``family``'s
    names (``families.registry.family_of`` the model)."""
    moe = _MOE_PARAM.fullmatch(name)
    if moe:
        return _moe_pieces(moe.group(1), moe.group(2), meta, family)
    names = hf_names(name, family)
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
