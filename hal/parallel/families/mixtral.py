"""Mixtral: Llama's decoder with every feed-forward an MoE block (softmax top-k over every expert, weights
renormalised, experts ``intermediate_size`` wide, no shared expert)."""
from __future__ import annotations

from typing import Any, Mapping

from hal.config import limits
from hal.config.schema import PositiveInt
from hal.errors import ConfigError
from hal.parallel.families.llama import Llama
from hal.parallel.families.spec import DECODER_FIELDS, MOE_ROUTER_FIELDS, ModelShape, MoENames, Need, Refuse, count


class Mixtral(Llama):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    moe_names = MoENames(router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{e}.{part}.weight",
                         gate="w1", up="w3", down="w2")
    config_fields = {**DECODER_FIELDS, **MOE_ROUTER_FIELDS, "num_local_experts": PositiveInt(limits.EXPERTS)}

    def config_keys(self, hf: Mapping[str, Any], need: Need, refuse: Refuse, where: str) -> dict[str, Any]:
        if hf.get("router_jitter_noise"):
            refuse("router_jitter_noise", "the router adds no noise")
        return {**super().config_keys(hf, need, refuse, where),
                "moe_num_experts": count(hf, "num_local_experts", need, self.model_type, where),
                "moe_top_k": count(hf, "num_experts_per_tok", need, self.model_type, where),
                "moe_ffn_hidden_size": need("intermediate_size"),
                "moe_aux_loss_weight": hf.get("router_aux_loss_coef", 0.02), "moe_normalize_top_k": True}

    def export_keys(self, model: ModelShape, where: str) -> dict[str, Any]:
        self.check_export_scoring(model, where)
        if model.moe_shared_ffn_size or model.moe_every != 1 or model.moe_first_dense or not model.moe_normalize_top_k:
            raise ConfigError(f"{where}: Mixtral has every layer MoE, no shared expert and renormalised top-k weights; "
                              "this model differs (export needs a config Mixtral's config.json can state)")
        if model.moe_ffn_hidden_size and model.moe_ffn_hidden_size != model.ffn_hidden_size:
            raise ConfigError(f"{where}: Mixtral's experts are intermediate_size wide; set moe_ffn_hidden_size to "
                              "ffn_hidden_size (or 0)")
        return {**super().export_keys(model, where),
                "num_local_experts": model.moe_num_experts, "num_experts_per_tok": model.moe_top_k,
                "router_aux_loss_coef": model.moe_aux_loss_weight, "router_jitter_noise": 0.0,
                "output_router_logits": False, "sliding_window": None}
