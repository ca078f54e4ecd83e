"""What a model family is: its blocks, its parameter and FLOP arithmetic, and its Hugging Face mapping.

A family provides one decoder layer (``decoder_layer``: norm, attention, feed-forward and their residual wiring)
and the final norm, built from the parallel parts a stage hands it (``Parts``: the ``models`` room makes them for
one rank, so a family never imports that room); the arithmetic the memory bound, MFU and the planner count with
(``layer_parameters``, ``norm_parameters``, ``attention_flops``); what its config.json means in ``model:`` keys
(``model_keys``, ``config_keys``, ``windowed_layers``), its tensor names (``top_names``, ``layer_names``,
``moe_names``) and the config.json export writes for it (``export_config``, ``export_keys``). ``model.family``
names the family whose blocks build a model (``decoder``): Llama's decoder (GQA, SwiGLU, RMSNorm, rotary) builds
Llama, Mistral, Qwen2, Mixtral and Qwen2-MoE, whose keys choose a q, k, v bias or an MoE block. Whatever a family
cannot represent is refused in one line naming the key (``check_model``, ``refuse``).

Block modules (torch) sit in a family's own ``blocks`` module, imported only when a stage is built, so reading a
config never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol, Sequence

from hal.config import limits
from hal.config.schema import Custom, Flag, Limit, NonNegativeInt, Nullable, Number, PositiveInt, Rule
from hal.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

Need = Callable[[str], Any]  # a config.json key the family always has (one line naming it when absent)
Refuse = Callable[[str, str], None]  # (key, why): one line saying the decoder cannot represent that key's value


class ModelShape(Protocol):
    """The model keys a family reads when it builds, counts, names or exports a model (``config.model.ModelConfig``)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    ffn_hidden_size: int
    max_seq_len: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float
    rope_scaling: dict[str, float] | None
    qkv_bias: bool
    activation: str
    rotary_fraction: float
    parallel_residual: bool
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

    @property
    def head_dim(self) -> int: ...

    def is_moe_layer(self, index: int) -> bool: ...


class Parts(Protocol):
    """The parallel parts a family builds its blocks from, made by the stage for one rank (``models.parts``): each
    starts from hal's seeded init and shards over the stage's tensor-parallel group as its kind must."""

    tp: int  # the tensor-parallel degree: this rank holds num_heads / tp heads, ffn / tp of the MLP
    out_std: float  # the init std of a residual branch's last linear (scaled by depth)

    def column(self, in_features: int, out_features: int, *, parts: Sequence[int] | None = None,
               bias: bool = False) -> nn.Module:
        """A column-parallel linear (output rows split over tp; ``parts`` split one by one)."""
        ...

    def row(self, in_features: int, out_features: int, *, bias: bool = False) -> nn.Module:
        """A row-parallel linear (input columns split over tp, output summed), ``out_std`` init."""
        ...

    def rms_norm(self, size: int, eps: float) -> nn.Module:
        """RMSNorm of the residual stream (seq-sharded under sp); ``add_forward`` fuses the residual add."""
        ...

    def layer_norm(self, size: int, eps: float) -> nn.Module:
        """LayerNorm with a bias, of the residual stream (seq-sharded under sp)."""
        ...

    def head_norm(self, size: int, eps: float) -> nn.Module:
        """RMSNorm over each head of this rank's heads (its weight's gradient summed over tp)."""
        ...

    def moe(self, index: int) -> nn.Module:
        """Layer ``index``'s MoE feed-forward (its experts over the stage's ep group)."""
        ...


def _text(origin: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{origin}: key '{key}' must be a string, got {type(value).__name__} {value!r}")
    return value


def _mapping(origin: str, key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{origin}: key '{key}' must be a JSON object, got {type(value).__name__} {value!r}")
    return value


TEXT = Custom(_text)  # a config.json string
MAPPING = Custom(_mapping)  # a config.json object


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


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")  # Llama 3's
TOKENS = Limit(2**40, "tokens a position or window counts")
# Every config.json key the common decoder reads, with what it may hold: checked, all of them, before any of them
# is used in arithmetic (a size of 0, a string, 10^12 layers is one line naming the file and the key).
DECODER_FIELDS: dict[str, Rule] = {
    "vocab_size": PositiveInt(limits.VOCAB), "hidden_size": PositiveInt(limits.WIDTH),
    "num_hidden_layers": PositiveInt(limits.LAYERS), "num_attention_heads": PositiveInt(limits.HEADS),
    "num_key_value_heads": Nullable(PositiveInt(limits.HEADS)), "intermediate_size": PositiveInt(limits.FFN_WIDTH),
    "max_position_embeddings": PositiveInt(limits.SEQUENCE), "head_dim": Nullable(PositiveInt(limits.WIDTH)),
    "hidden_act": TEXT, "rms_norm_eps": Number(positive=True, maximum=1.0),
    "rope_theta": Number(positive=True), "rope_scaling": Nullable(MAPPING),
    "rope_parameters": Nullable(MAPPING), "tie_word_embeddings": Flag(),
    "attention_bias": Nullable(Flag()), "mlp_bias": Nullable(Flag()),
    "sliding_window": Nullable(NonNegativeInt(TOKENS)), "layer_types": Nullable(list_of(TEXT, "strings")),
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
    """A Llama-shaped Hugging Face family; subclasses change what differs (a family with blocks of its own, its
    ``decoder``, overrides ``decoder_layer`` and what its blocks change)."""

    model_type: ClassVar[str]  # config.json's model_type
    architecture: ClassVar[str]  # config.json's architectures entry on export
    decoder: ClassVar[str] = "llama"  # model.family: the family whose blocks build this one's layers
    qkv_bias: ClassVar[bool] = False  # the q, k, v projections carry a bias (Qwen2's attention)
    moe_names: ClassVar[MoENames | None] = None  # an MoE family: where its experts' tensors are
    exported: ClassVar[bool] = True  # False: a model of this shape is exported as an earlier family of the same names
    config_fields: ClassVar[Mapping[str, Rule]] = DECODER_FIELDS  # what each config.json key it reads may hold
    layer_prefix: ClassVar[str] = "model.layers.{i}."  # where layer i's tensors sit in the checkpoint
    top_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "embed.weight": ("model.embed_tokens.weight",),
        "norm.weight": ("model.norm.weight",),
        "head.weight": ("lm_head.weight",),
    }
    layer_names: ClassVar[dict[str, tuple[str, ...]]] = {  # inside layer_prefix; several: stacked in this order
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

    # --- the blocks (a family with its own ``decoder`` only) ---------------------------------------------------
    def check_model(self, model: ModelShape, origin: str) -> None:
        """Refuse, in one line naming the key, what this family's blocks cannot represent (the Llama decoder's
        rules: SwiGLU, full rotary, a head of hidden_size / num_heads, one residual step after another)."""
        said = f"{origin}: model.family {model.family}"
        self.check_head_size(model, said)
        if model.activation != "silu":
            raise ConfigError(f"{said} has a SwiGLU MLP; model.activation must be silu, not {model.activation!r}")
        if model.rotary_fraction != 1.0:
            raise ConfigError(f"{said} rotates the whole head; model.rotary_fraction must be 1.0 "
                              "(partial rotary is family gpt_neox's)")
        if model.parallel_residual:
            raise ConfigError(f"{said} adds attention and MLP one after the other; set model.parallel_residual false "
                              "(the parallel residual is family gpt_neox's)")

    def check_head_size(self, model: ModelShape, said: str) -> None:
        """The Llama decoder's head is hidden_size / num_heads wide."""
        if model.head_size:
            raise ConfigError(f"{said} has heads of hidden_size / num_heads; drop model.head_size (or use family qwen3)")

    def decoder_layer(self, model: ModelShape, parts: Parts, index: int) -> nn.Module:
        """Decoder layer ``index`` built from ``parts`` (its parameter names are the checkpoint's and the init's)."""
        raise NotImplementedError(f"family {self} builds no blocks; its model.family is {self.decoder}")

    def final_norm(self, model: ModelShape, parts: Parts) -> nn.Module:
        """The norm after the last layer (``norm.*``)."""
        return parts.rms_norm(model.hidden_size, model.norm_eps)

    # --- arithmetic: the memory bound, MFU and the planner count with these --------------------------------------
    def layer_parameters(self, model: ModelShape, index: int, *, active: bool = False) -> int:
        """Layer ``index``'s parameters: q/o projections, k/v at the kv width (and their bias), the feed-forward and
        two norms; in an MoE layer the router, every expert (``active``: the top-k a token runs through) and the
        shared expert."""
        hidden, q_width, kv_width = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        bias = q_width + 2 * kv_width if model.qkv_bias else 0
        attention = 2 * hidden * q_width + 2 * hidden * kv_width + 2 * hidden + bias
        if not model.is_moe_layer(index):
            return attention + 3 * hidden * model.ffn_hidden_size
        experts = model.moe_top_k if active else model.moe_num_experts
        expert = 3 * hidden * (model.moe_ffn_hidden_size or model.ffn_hidden_size)
        shared = 3 * hidden * model.moe_shared_ffn_size + (hidden if model.moe_shared_gate else 0)
        return attention + model.moe_num_experts * hidden + experts * expert + shared

    def norm_parameters(self, model: ModelShape) -> int:
        """The final norm's parameters."""
        return model.hidden_size

    def attention_flops(self, model: ModelShape, seq: int) -> float:
        """Training FLOPs a token spends in attention's score and value products, over every layer (forward and
        backward: 3 x 2 products x 2 FLOPs a multiply-add x heads x head_dim x seq)."""
        return 12.0 * model.num_layers * model.num_heads * model.head_dim * seq

    # --- config.json -> model keys ---------------------------------------------------------------------------
    def windowed_layers(self, hf: Mapping[str, Any], layers: int) -> list[int]:
        """The layers whose attention is windowed, as transformers decides it for this family."""
        types = hf.get("layer_types")
        if isinstance(types, list):
            return [i for i, kind in enumerate(types) if kind != "full_attention"]
        return [] if hf.get("sliding_window") is None else list(range(layers))

    def model_keys(self, hf: Mapping[str, Any], need: Need, refuse: Refuse, where: str) -> dict[str, Any]:
        """Every model key this family's config.json gives: the Llama decoder's common ones, then ``config_keys``."""
        hidden, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
        if hf.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "the MLP is SwiGLU (silu)")
        for name in ("attention_bias", "mlp_bias"):
            if hf.get(name):
                refuse(name, "only the q, k, v projections can have a bias (Qwen2's), not the output projection or the MLP")
        self.check_head_dim(hf, refuse, hidden // heads)
        window, context = hf.get("sliding_window"), need("max_position_embeddings")
        windowed = self.windowed_layers(hf, layers)
        if windowed and (window is None or window < context):
            name = "layer_types" if isinstance(hf.get("layer_types"), list) and window is None else "sliding_window"
            refuse(name, f"layers {windowed[0]}..{windowed[-1]} would attend through a window shorter than the context; "
                         "attention is full causal")
        theta, scaling = rope_keys(hf)
        keys: dict[str, Any] = {
            "vocab_size": need("vocab_size"), "hidden_size": hidden, "num_layers": layers,
            "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "ffn_hidden_size": need("intermediate_size"), "max_seq_len": context,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_theta": theta, "norm_eps": hf.get("rms_norm_eps", 1e-6),
        }
        if scaling is not None:
            keys["rope_scaling"] = scaling
        keys.update(self.config_keys(hf, need, refuse, where))
        return keys

    def check_head_dim(self, hf: Mapping[str, Any], refuse: Refuse, derived: int) -> None:
        """The Llama decoder's head is hidden_size / num_attention_heads: another ``head_dim`` is refused."""
        head_dim = hf.get("head_dim")
        if head_dim is not None and head_dim != derived:
            refuse("head_dim", f"the head size is hidden_size / num_attention_heads = {derived}")

    def config_keys(self, hf: Mapping[str, Any], need: Need, refuse: Refuse, where: str) -> dict[str, Any]:
        """The model keys only this family's config.json gives (beyond the decoder's common ones)."""
        return {"qkv_bias": self.qkv_bias}

    # --- model keys -> config.json ---------------------------------------------------------------------------
    def export_config(self, model: ModelShape, dtype: str, where: str) -> dict[str, Any]:
        """The whole config.json for ``model`` (``dtype``: transformers' torch_dtype name): the Llama decoder's
        common keys, then ``export_keys``."""
        scaling = None if model.rope_scaling is None else {"rope_type": "llama3", **model.rope_scaling}
        if scaling is not None:
            scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
        config: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": model.vocab_size, "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
            "num_key_value_heads": model.num_kv_heads, "hidden_act": "silu", "max_position_embeddings": model.max_seq_len,
            "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta, "rope_scaling": scaling,
            "tie_word_embeddings": model.tie_embeddings, "attention_dropout": 0.0, "initializer_range": 0.02,
            "use_cache": True, "torch_dtype": dtype,
        }
        config.update(self.export_keys(model, where))
        return config

    def export_keys(self, model: ModelShape, where: str) -> dict[str, Any]:
        """The config.json keys only this family writes (beyond the decoder's common ones)."""
        return {"head_dim": model.head_dim, "attention_bias": False, "mlp_bias": False}

    def check_export_scoring(self, model: ModelShape, where: str) -> None:
        """An MoE family routes with softmax over every expert; another router cannot be said in its config.json."""
        if model.moe_scoring != "softmax":
            raise ConfigError(f"{where}: the model's router scores with {model.moe_scoring}; {self.model_type} routes "
                              "with softmax")


def rope_keys(hf: Mapping[str, Any]) -> tuple[Any, Any]:
    """(theta, scaling or None) from transformers 5's ``rope_parameters`` or the legacy keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling: Any = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
    if isinstance(scaling, Mapping) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None  # plain rotary embeddings, said explicitly
    return theta, scaling


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


__all__ = ["DECODER_FIELDS", "Family", "MAPPING", "MOE_ROUTER_FIELDS", "MoENames", "ModelShape", "Need", "Parts", "Refuse",
           "ROPE_SCALING_KEYS", "TEXT", "TOKENS", "check_config_fields", "count", "list_of", "rope_keys"]
