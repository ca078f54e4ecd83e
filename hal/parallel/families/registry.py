"""The one table of model families: config.json's model_type finds a family, a model's shape finds the family it
is named and exported as, and ``model.family`` the family whose blocks build it. A new family is its module (or
folder) plus one entry here."""
from __future__ import annotations

from hal.parallel.families.gpt_neox import GPTNeoX
from hal.parallel.families.llama import Llama
from hal.parallel.families.mistral import Mistral
from hal.parallel.families.mixtral import Mixtral
from hal.parallel.families.qwen2 import Qwen2
from hal.parallel.families.qwen2_moe import Qwen2Moe
from hal.parallel.families.qwen3 import Qwen3
from hal.parallel.families.spec import Family, ModelShape

_FAMILIES: dict[str, Family] = {f.model_type: f for f in (Llama(), Mistral(), Qwen2(), Mixtral(), Qwen2Moe(), Qwen3(),
                                                           GPTNeoX())}


def family_names() -> tuple[str, ...]:
    """Every registered family's model_type, in registration order (the order messages list them)."""
    return tuple(_FAMILIES)


def decoder_names() -> tuple[str, ...]:
    """The families with blocks of their own: what ``model.family`` may name."""
    return tuple(name for name, family in _FAMILIES.items() if family.decoder == name)


def get_family(model_type: str) -> Family:
    """The family config.json's ``model_type`` names; KeyError when none is registered (callers say it in one line)."""
    return _FAMILIES[model_type]


def family_of(model: ModelShape) -> Family:
    """The family a model of these keys is named and exported as: the first registered exported family built by its
    ``model.family`` of its shape (a q, k, v bias or not, MoE or not), so Mistral-shaped models are Llama's."""
    for family in _FAMILIES.values():
        if family.exported and family.decoder == model.family and family.represents(model):
            return family
    raise ValueError(f"no registered family represents a model of family {model.family} with qkv_bias "
                     f"{model.qkv_bias} and {model.moe_num_experts} experts")


__all__ = ["decoder_names", "family_names", "family_of", "get_family"]
