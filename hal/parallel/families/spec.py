"""What a model family is: the Hugging Face names and keys that make a Llama-shaped decoder one family or another.

Every family here is the same decoder (GQA, SwiGLU, RMSNorm, rotary embeddings); a family differs in the keys of
its config.json (``config_keys``, ``windowed_layers``), the layers those keys choose (``qkv_bias``, an MoE block
named by ``moe_names``), its tensor names (``top_names``, ``layer_names``, ``moe_names``) and the config.json
export writes for it (``export_keys``). A family whose keys cannot say something refuses it in one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Protocol

from hal.config import limits
from hal.config.schema import Custom, Flag, Limit, NonNegativeInt, Nullable, Number, PositiveInt, Rule
from hal.errors import ConfigError

Need = Callable[[str], Any]  # a config.json key the family always has (one line naming it when absent)
Refuse = Callable[[str, str], None]  # (key, why): one line saying the decoder cannot represent that key's value


class ModelShape(Protocol):
    """The model keys a family reads when it names or exports a model (``config.model.ModelConfig`` has them)."""

    num_layers: int
    head_dim: int
    ffn_hidden_size: int
    qkv_bias: bool
    moe_num_experts: int
    moe_top_k: int
    moe_ffn_hidden_size: int
    moe_shared_ffn_size: int
    moe_shared_gate: bool
    moe_scoring: str
    moe_normalize_top_k: bool
    moe_every: int
    moe_first_dense: int
    moe_aux_loss_weight: float


def _text(origin: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{origin}: key '{key}' must be a string, got {type(value).__name__} {value!r}")
    return value


def _mapping(origin: str, key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{origin}: key '{key}' must be a JSON object, got {type(value).__name__} {value!r}")
    return value


def list_of(item: Rule, noun: str) -> Custom:
    """A list of at most ``limits.LAYERS`` items (one per layer at most), each passing ``item``."""
    def check(origin: str, key: str, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise ConfigError(f"{origin}: key '{key}' must be a list of {noun}, got {type(value).__name__} {value!r}")
        if len(value) > limits.LAYERS.maximum:
            raise ConfigError(f"{origin}: key '{key}' has {len(value)} entries, above the limit "
                              f"{limits.LAYERS.maximum} ({limits.LAYERS.why})")
        return [item.check(origin, f"{key}[{i}]", v, "") for i, v in enumerate(value)]

    return Custom(check)


TOKENS = Limit(2**40, "tokens a position or window counts")
# Every config.json key the common decoder reads, with what it may hold: checked, all of them, before any of them
# is used in arithmetic (a size of 0, a string, 10^12 layers is one line naming the file and the key).
DECODER_FIELDS: dict[str, Rule] = {
    "vocab_size": PositiveInt(limits.VOCAB), "hidden_size": PositiveInt(limits.WIDTH),
    "num_hidden_layers": PositiveInt(limits.LAYERS), "num_attention_heads": PositiveInt(limits.HEADS),
    "num_key_value_heads": Nullable(PositiveInt(limits.HEADS)), "intermediate_size": PositiveInt(limits.FFN_WIDTH),
    "max_position_embeddings": PositiveInt(limits.SEQUENCE), "head_dim": Nullable(PositiveInt(limits.WIDTH)),
    "hidden_act": Custom(_text), "rms_norm_eps": Number(positive=True, maximum=1.0),
    "rope_theta": Number(positive=True), "rope_scaling": Nullable(Custom(_mapping)),
    "rope_parameters": Nullable(Custom(_mapping)), "tie_word_embeddings": Flag(),
    "attention_bias": Nullable(Flag()), "mlp_bias": Nullable(Flag()),
    "sliding_window": Nullable(NonNegativeInt(TOKENS)), "layer_types": Nullable(list_of(Custom(_text), "strings")),
}
MOE_ROUTER_FIELDS: dict[str, Rule] = {
    "num_experts_per_tok": PositiveInt(limits.EXPERTS), "router_aux_loss_coef": Number(positive=False, maximum=1e3),
    "router_jitter_noise": Nullable(Number(positive=False)),
}


@dataclass(frozen=True)
class MoENames:
    """Where an MoE layer's parts live in the family's checkpoint (inside ``model.layers.<i>.``)."""

    router: str
    expert: str  # formatted with {e} (the expert) and {part} (one of gate, up, down below)
    gate: str
    up: str
    down: str
    shared: str | None = None  # formatted with {part} (gate_proj, up_proj, down_proj)
    shared_gate: str | None = None


class Family:
    """A Llama-shaped Hugging Face family; subclasses change what differs."""

    model_type: ClassVar[str]  # config.json's model_type
    architecture: ClassVar[str]  # config.json's architectures entry on export
    qkv_bias: ClassVar[bool] = False  # the q, k, v projections carry a bias (Qwen2's attention)
    moe_names: ClassVar[MoENames | None] = None  # an MoE family: where its experts' tensors are
    exported: ClassVar[bool] = True  # False: a model of this shape is exported as an earlier family of the same names
    config_fields: ClassVar[Mapping[str, Rule]] = DECODER_FIELDS  # what each config.json key it reads may hold
    top_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "embed.weight": ("model.embed_tokens.weight",),
        "norm.weight": ("model.norm.weight",),
        "head.weight": ("lm_head.weight",),
    }
    layer_names: ClassVar[dict[str, tuple[str, ...]]] = {  # inside model.layers.<i>.; several: stacked in this order
        "attn_norm.weight": ("input_layernorm.weight",),
        "mlp_norm.weight": ("post_attention_layernorm.weight",),
        "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "attn.out.weight": ("self_attn.o_proj.weight",),
        "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.down.weight": ("mlp.down_proj.weight",),
    }

    def __str__(self) -> str:
        return self.model_type

    def __eq__(self, other: object) -> bool:  # no parameters: every instance of a class is the same family
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    @property
    def moe(self) -> bool:
        return self.moe_names is not None

    def represents(self, model: ModelShape) -> bool:
        """Whether a model of these keys is this family's shape (the attention bias, an MoE block or none)."""
        return self.qkv_bias == model.qkv_bias and self.moe == bool(model.moe_num_experts)

    # --- config.json -> model keys ---------------------------------------------------------------------------
    def windowed_layers(self, hf: Mapping[str, Any], layers: int) -> list[int]:
        """The layers whose attention is windowed, as transformers decides it for this family."""
        types = hf.get("layer_types")
        if isinstance(types, list):
            return [i for i, kind in enumerate(types) if kind != "full_attention"]
        return [] if hf.get("sliding_window") is None else list(range(layers))

    def config_keys(self, hf: Mapping[str, Any], need: Need, refuse: Refuse, where: str) -> dict[str, Any]:
        """The model keys only this family's config.json gives (beyond the decoder's common ones)."""
        return {"qkv_bias": self.qkv_bias}

    # --- model keys -> config.json ---------------------------------------------------------------------------
    def export_keys(self, model: ModelShape, where: str) -> dict[str, Any]:
        """The config.json keys only this family writes (beyond the decoder's common ones)."""
        return {"head_dim": model.head_dim, "attention_bias": False, "mlp_bias": False}

    def check_export_scoring(self, model: ModelShape, where: str) -> None:
        """An MoE family routes with softmax over every expert; another router cannot be said in its config.json."""
        if model.moe_scoring != "softmax":
            raise ConfigError(f"{where}: the model's router scores with {model.moe_scoring}; {self.model_type} routes "
                              "with softmax")


def count(hf: Mapping[str, Any], name: str, need: Need, family: str, where: str, default: int | None = None) -> int:
    """A config.json count that must be a whole number >= 1 (0 would turn into a dense model or a default)."""
    value = need(name) if default is None else hf.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name} = {value!r} in config.json is not a whole number >= 1, which a "
                          f"{family} model needs; fix config.json")
    return value


def check_config_fields(hf: Mapping[str, Any], family: Family, origin: str) -> None:
    """Every key ``family`` reads that config.json sets: of its type and within its range, before any arithmetic.
    ``null`` stands for "absent" only where transformers reads it so (the ``Nullable`` rules)."""
    for name, rule in family.config_fields.items():
        if name in hf:
            try:
                rule.check(origin, name, hf[name], "")
            except ConfigError as exc:
                said = str(exc).removesuffix("; e.g. ").removesuffix("; e.g.")
                raise ConfigError(f"{said}; fix config.json (a {family.model_type} model needs it so)") from None


__all__ = ["DECODER_FIELDS", "Family", "MOE_ROUTER_FIELDS", "MoENames", "ModelShape", "Need", "Refuse",
           "check_config_fields", "count", "list_of"]
