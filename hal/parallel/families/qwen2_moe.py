"""Qwen2-MoE: Qwen2's decoder (the q, k, v bias) with MoE feed-forwards: softmax top-k routing, a gated shared
expert in every MoE layer, a sparse step (``decoder_sparse_step``) and leading dense layers (``mlp_only_layers``)."""
from __future__ import annotations

from typing import Any, Mapping

from hal.config import limits
from hal.config.schema import Flag, NonNegativeInt, Nullable, PositiveInt
from hal.errors import ConfigError
from hal.parallel.families.qwen2 import Qwen2
from hal.parallel.families.spec import MOE_ROUTER_FIELDS, ModelShape, MoENames, Need, Refuse, count, list_of


class Qwen2Moe(Qwen2):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    moe_names = MoENames(router="mlp.gate.weight", expert="mlp.experts.{e}.{part}.weight", gate="gate_proj",
                         up="up_proj", down="down_proj", shared="mlp.shared_expert.{part}.weight",
                         shared_gate="mlp.shared_expert_gate.weight")
    config_fields = {**Qwen2.config_fields, **MOE_ROUTER_FIELDS, "num_experts": PositiveInt(limits.EXPERTS),
                     "moe_intermediate_size": PositiveInt(limits.FFN_WIDTH),
                     "shared_expert_intermediate_size": NonNegativeInt(limits.FFN_WIDTH),
                     "decoder_sparse_step": PositiveInt(limits.LAYERS), "norm_topk_prob": Nullable(Flag()),
                     "mlp_only_layers": Nullable(list_of(NonNegativeInt(limits.LAYERS), "layer numbers"))}

    def config_keys(self, hf: Mapping[str, Any], need: Need, refuse: Refuse, where: str) -> dict[str, Any]:
        if hf.get("router_jitter_noise"):
            refuse("router_jitter_noise", "the router adds no noise")
        dense_only = hf.get("mlp_only_layers") or []
        if list(dense_only) != list(range(len(dense_only))):
            refuse("mlp_only_layers", "dense layers can only be the first ones (model.moe_first_dense)")
        shared = hf.get("shared_expert_intermediate_size") or 0
        if not shared:
            refuse("shared_expert_intermediate_size", "a Qwen2-MoE layer's shared expert is always there")
        name = self.model_type
        return {**super().config_keys(hf, need, refuse, where),
                "moe_num_experts": count(hf, "num_experts", need, name, where),
                "moe_top_k": count(hf, "num_experts_per_tok", need, name, where),
                "moe_ffn_hidden_size": count(hf, "moe_intermediate_size", need, name, where),
                "moe_shared_ffn_size": shared, "moe_shared_gate": True,
                "moe_normalize_top_k": bool(hf.get("norm_topk_prob", False)),
                "moe_every": count(hf, "decoder_sparse_step", need, name, where, default=1),
                "moe_first_dense": len(dense_only), "moe_aux_loss_weight": hf.get("router_aux_loss_coef", 0.001)}

    def export_keys(self, model: ModelShape, where: str) -> dict[str, Any]:
        self.check_export_scoring(model, where)
        if not model.moe_shared_ffn_size or not model.moe_shared_gate:
            raise ConfigError(f"{where}: Qwen2-MoE layers have a gated shared expert; this model has none")
        return {**super().export_keys(model, where),
                "num_experts": model.moe_num_experts, "num_experts_per_tok": model.moe_top_k,
                "moe_intermediate_size": model.moe_ffn_hidden_size or model.ffn_hidden_size,
                "shared_expert_intermediate_size": model.moe_shared_ffn_size,
                "norm_topk_prob": model.moe_normalize_top_k, "decoder_sparse_step": model.moe_every,
                "mlp_only_layers": list(range(model.moe_first_dense)),
                "router_aux_loss_coef": model.moe_aux_loss_weight, "output_router_logits": False}
