"""Qwen3: Qwen2's config keys (its sliding window off unless switched on) without the q, k, v bias, with blocks of
its own: RMSNorm on each head of q and k before the rotary embedding, and a head size of its own (``head_dim``,
independent of hidden_size / num_heads)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from hal.errors import ConfigError
from hal.parallel.families.qwen2 import Qwen2
from hal.parallel.families.spec import ModelShape, Need, Parts, Refuse

if TYPE_CHECKING:
    from torch import nn


class Qwen3(Qwen2):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    decoder = "qwen3"
    qkv_bias = False
    layer_names = {**Qwen2.layer_names, "attn.q_norm.weight": ("self_attn.q_norm.weight",),
                   "attn.k_norm.weight": ("self_attn.k_norm.weight",)}

    def check_model(self, model: ModelShape, origin: str) -> None:
        said = f"{origin}: model.family qwen3"
        if model.qkv_bias:
            raise ConfigError(f"{said}: a Qwen3 attention bias biases the output projection too; set model.qkv_bias false")
        if model.moe_num_experts:
            raise ConfigError(f"{said} is dense (Qwen3-MoE is another family); set model.moe_num_experts 0")
        super().check_model(model, origin)

    def check_head_size(self, model: ModelShape, said: str) -> None:
        """Any head size: Qwen3's is its own."""

    def decoder_layer(self, model: ModelShape, parts: Parts, index: int) -> nn.Module:
        from hal.parallel.families.llama.blocks import DecoderLayer
        from hal.parallel.families.qwen3.blocks import Qwen3Attention

        return DecoderLayer(model, parts, index, attention=Qwen3Attention)

    def layer_parameters(self, model: ModelShape, index: int, *, active: bool = False) -> int:
        """Llama's layer and the q and k norms' weights (one head wide each)."""
        return super().layer_parameters(model, index, active=active) + 2 * model.head_dim

    def check_head_dim(self, hf: Mapping[str, Any], refuse: Refuse, derived: int) -> None:
        """Any head size: Qwen3's is its own."""

    def config_keys(self, hf: Mapping[str, Any], need: Need, refuse: Refuse, where: str) -> dict[str, Any]:
        """``head_size`` where config.json's head_dim is not hidden_size / num_attention_heads."""
        derived = need("hidden_size") // need("num_attention_heads")
        head_dim = hf.get("head_dim") or derived
        return {**super().config_keys(hf, need, refuse, where), "head_size": 0 if head_dim == derived else head_dim}

    def export_keys(self, model: ModelShape, where: str) -> dict[str, Any]:
        return {**super().export_keys(model, where), "head_dim": model.head_dim, "attention_bias": False}

