"""The one table of model families: config.json's model_type finds a family, a model's shape finds the family it
is named and exported as. A new family is its module plus one entry here."""
from __future__ import annotations

from hal.parallel.families.llama import Llama
from hal.parallel.families.mistral import Mistral
from hal.parallel.families.mixtral import Mixtral
from hal.parallel.families.qwen2 import Qwen2
from hal.parallel.families.qwen2_moe import Qwen2Moe
from hal.parallel.families.spec import Family, ModelShape

_FAMILIES: dict[str, Family] = {f.model_type: f for f in (Llama(), Mistral(), Qwen2(), Mixtral(), Qwen2Moe())}


def family_names() -> tuple[str, ...]:
    """Every registered family's model_type, in registration order (the order messages list them)."""
    return tuple(_FAMILIES)


def get_family(model_type: str) -> Family:
    """The family config.json's ``model_type`` names; KeyError when none is registered (callers say it in one line)."""
    return _FAMILIES[model_type]


def family_of(model: ModelShape) -> Family:
    """The family a model of these keys is named and exported as: the first registered exported family of its
    shape (a q, k, v bias or not, MoE or not), so Mistral-shaped models are Llama's."""
    for family in _FAMILIES.values():
        if family.exported and family.represents(model):
            return family
    raise ValueError(f"no registered family represents a model with qkv_bias {model.qkv_bias} and "
                     f"{model.moe_num_experts} experts")


__all__ = ["family_names", "family_of", "get_family"]
