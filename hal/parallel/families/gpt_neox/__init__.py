"""GPT-NeoX (the Pythia models): blocks of its own — LayerNorm with a bias, attention and MLP side by side on the
residual (``use_parallel_residual``; one after the other when false), rotary embeddings on the first
``partial_rotary_factor`` (legacy ``rotary_pct``) of each head, a GELU MLP, a bias on every linear, no grouped-query
attention, an untied head (``embed_out``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from hal.config import limits
from hal.config.schema import Flag, Nullable, Number, PositiveInt, Rule
from hal.errors import ConfigError
from hal.parallel.families.spec import MAPPING, TEXT, Family, ModelShape, Need, Parts, Refuse

if TYPE_CHECKING:
    from torch import nn

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "relu": "relu", "silu": "silu"}  # config.json's hidden_act -> model.activation (the same function)
EXPORTED_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}


NEOX_FIELDS: dict[str, Rule] = {
    "vocab_size": PositiveInt(limits.VOCAB), "hidden_size": PositiveInt(limits.WIDTH),
    "num_hidden_layers": PositiveInt(limits.LAYERS), "num_attention_heads": PositiveInt(limits.HEADS),
    "intermediate_size": PositiveInt(limits.FFN_WIDTH), "max_position_embeddings": PositiveInt(limits.SEQUENCE),
    "hidden_act": TEXT, "layer_norm_eps": Number(positive=True, maximum=1.0),
    "rotary_pct": Number(positive=True, maximum=1.0), "rotary_emb_base": Number(positive=True),
    "rope_parameters": Nullable(MAPPING), "rope_scaling": Nullable(MAPPING),
    "tie_word_embeddings": Flag(), "use_parallel_residual": Flag(), "attention_bias": Flag(),
}


class GPTNeoX(Family):
    model_type = "gpt_neox"
    architecture = "GPTNeoXForCausalLM"
    decoder = "gpt_neox"
    config_fields = NEOX_FIELDS
    layer_prefix = "gpt_neox.layers.{i}."
    top_names = {
        "embed.weight": ("gpt_neox.embed_in.weight",),
        "norm.weight": ("gpt_neox.final_layer_norm.weight",),
        "norm.bias": ("gpt_neox.final_layer_norm.bias",),
        "head.weight": ("embed_out.weight",),
    }
    layer_names = {
        **{f"{ours}.{kind}": (f"{theirs}.{kind}",) for kind in ("weight", "bias") for ours, theirs in (
            ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
            ("attn.qkv", "attention.query_key_value"), ("attn.out", "attention.dense"),
            ("mlp.up", "mlp.dense_h_to_4h"), ("mlp.down", "mlp.dense_4h_to_h"))},
    }

    def represents(self, model: ModelShape) -> bool:
        """Every model of its blocks (what they cannot represent, ``check_model`` refused)."""
        return True

    # --- the blocks -------------------------------------------------------------------------------------------
    def check_model(self, model: ModelShape, origin: str) -> None:
        said = f"{origin}: model.family gpt_neox"
        if model.num_kv_heads != model.num_heads:
            raise ConfigError(f"{said} has no grouped-query attention; set model.num_kv_heads to num_heads "
                              f"({model.num_heads})")
        if model.head_size:
            raise ConfigError(f"{said} has heads of hidden_size / num_heads; drop model.head_size")
        if model.qkv_bias:
            raise ConfigError(f"{said}: every linear of its layers has a bias; drop model.qkv_bias")
        if model.moe_num_experts:
            raise ConfigError(f"{said} is dense; set model.moe_num_experts 0")
        if model.rope_scaling is not None:
            raise ConfigError(f"{said} has no rotary scaling; drop model.rope_scaling")
        rotated = rotary_dims(model)
        if rotated < 2 or rotated % 2:
            raise ConfigError(f"{said}: rotary_fraction {model.rotary_fraction} of a {model.head_dim}-wide head rotates "
                              f"{rotated} channels, which must be even and at least 2; change model.rotary_fraction")

    def decoder_layer(self, model: ModelShape, parts: Parts, index: int) -> nn.Module:
        from hal.parallel.families.gpt_neox.blocks import NeoXLayer

        return NeoXLayer(model, parts)

    def final_norm(self, model: ModelShape, parts: Parts) -> nn.Module:
        return parts.layer_norm(model.hidden_size, model.norm_eps)

    # --- arithmetic -------------------------------------------------------------------------------------------
    def layer_parameters(self, model: ModelShape, index: int, *, active: bool = False) -> int:
        """Two LayerNorms (weight and bias), the fused q, k, v and the output projection, the MLP's two linears, every
        linear with its bias."""
        h, f = model.hidden_size, model.ffn_hidden_size
        return 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)

    def norm_parameters(self, model: ModelShape) -> int:
        return 2 * model.hidden_size

    # --- config.json -> model keys ----------------------------------------------------------------------------
    def model_keys(self, hf: Mapping[str, Any], need: Need, refuse: Refuse, where: str) -> dict[str, Any]:
        heads = need("num_attention_heads")
        act = hf.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            refuse("hidden_act", f"the MLP's activation is one of {', '.join(ACTIVATIONS)}")
        if not hf.get("attention_bias", True):
            refuse("attention_bias", "the attention's linears always carry a bias here")
        params = hf.get("rope_parameters") or {}
        if params.get("rope_type", params.get("type", "default")) != "default":
            refuse("rope_parameters", "rotary scaling is not represented")
        if hf.get("rope_scaling"):
            refuse("rope_scaling", "rotary scaling is not represented")
        theta = params.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
        fraction = params.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
        return {
            "vocab_size": need("vocab_size"), "hidden_size": need("hidden_size"), "num_layers": need("num_hidden_layers"),
            "num_heads": heads, "num_kv_heads": heads, "ffn_hidden_size": need("intermediate_size"),
            "max_seq_len": need("max_position_embeddings"), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_theta": theta, "norm_eps": hf.get("layer_norm_eps", 1e-5), "qkv_bias": False,
            "activation": ACTIVATIONS[act], "rotary_fraction": fraction,
            "parallel_residual": bool(hf.get("use_parallel_residual", True)),
        }

    # --- model keys -> config.json ----------------------------------------------------------------------------
    def export_config(self, model: ModelShape, dtype: str, where: str) -> dict[str, Any]:
        """transformers 5's ``rope_parameters`` and, for older versions, the legacy rotary keys beside them."""
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": model.vocab_size, "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
            "hidden_act": EXPORTED_ACTIVATION[model.activation], "max_position_embeddings": model.max_seq_len,
            "layer_norm_eps": model.norm_eps, "use_parallel_residual": model.parallel_residual,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta,
                                "partial_rotary_factor": model.rotary_fraction},
            "rotary_pct": model.rotary_fraction, "rotary_emb_base": model.rope_theta,
            "tie_word_embeddings": model.tie_embeddings, "attention_bias": True, "attention_dropout": 0.0,
            "hidden_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype,
        }


def rotary_dims(model: ModelShape) -> int:
    """The channels of each head the rotary embedding turns (transformers': int(head_dim × fraction))."""
    return int(model.head_dim * model.rotary_fraction)


__all__ = ["GPTNeoX", "rotary_dims"]
