"""The shape of the model the engine trains, in its family's blocks (``model.family``): every size a plan is
checked against."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Mapping

from hal.config import limits
from hal.config.schema import (
    Choice,
    Custom,
    Flag,
    NonNegativeInt,
    Number,
    PositiveInt,
    key,
    parse_section,
    reject_unknown,
    section_specs,
)
from hal.errors import ConfigError
from hal.parallel.families.registry import decoder_names, get_family
from hal.parallel.families.spec import ROPE_SCALING_KEYS

# An auxiliary loss weight beyond this swamps the language-model loss (papers use 0.001-0.1) and, far beyond it,
# overflows fp32 into a NaN loss: a mistake to refuse, not a choice to train.
MAX_LOSS_WEIGHT = 1000.0


def _rope_scaling(origin: str, key: str, value: Any) -> dict[str, float] | None:
    """Llama 3's rotary scaling ({factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}) or null."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - {"type", "rope_type", *ROPE_SCALING_KEYS}:
        raise ConfigError(f"{origin}: key '{key}' must be null or a mapping of {', '.join(ROPE_SCALING_KEYS)} (llama3 scaling)")
    kind = value.get("rope_type", value.get("type", "llama3"))
    if kind != "llama3":
        raise ConfigError(f"{origin}: key '{key}': rope scaling {kind!r} is not represented; hal's decoder has llama3 "
                          "scaling only — use a model without it or with rope_type llama3")
    out = {}
    for name in ROPE_SCALING_KEYS:
        number = value.get(name)
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
            raise ConfigError(f"{origin}: key '{key}.{name}' must be a positive number, got {number!r}")
        out[name] = float(number)
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ConfigError(f"{origin}: key '{key}': high_freq_factor must be above low_freq_factor")
    return out


Scoring = Literal["softmax", "sigmoid"]
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")  # the MLP's activation (silu: SwiGLU's gate in Llama's blocks)
# Keys added with the families whose blocks differ from Llama's: written only when not at their default, so the
# job files, checkpoints and profile digests of every model without them stay exactly as before.
FAMILY_KEYS = ("family", "head_size", "activation", "rotary_fraction", "parallel_residual")


@dataclass(frozen=True)
class MoEConfig:
    """The MoE block's shape and routing (the family configs map Mixtral's and Qwen2-MoE's names onto it)."""

    num_experts: int
    top_k: int
    expert_ffn_size: int
    scoring: Scoring = "softmax"
    normalize_top_k: bool = True
    shared_ffn_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output × sigmoid(gate(x))
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"moe: num_experts {self.num_experts} must be at least 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe: top_k {self.top_k} must be between 1 and num_experts ({self.num_experts}); lower top_k")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"moe: scoring {self.scoring!r} must be softmax or sigmoid")
        if self.expert_ffn_size < 1 or self.shared_ffn_size < 0:
            raise ValueError("moe: expert_ffn_size must be at least 1 and shared_ffn_size at least 0")
        if self.shared_gate and not self.shared_ffn_size:
            raise ValueError("moe: shared_gate needs a shared expert (shared_ffn_size > 0)")


@dataclass(frozen=True)
class ModelConfig:
    """The ``model:`` section, declared once: each field's rule is what the config file is checked against."""

    vocab_size: int = key(PositiveInt(limits.VOCAB), 256)  # byte-level tokens by default
    hidden_size: int = key(PositiveInt(limits.WIDTH), 64)
    num_layers: int = key(PositiveInt(limits.LAYERS), 4)
    num_heads: int = key(PositiveInt(limits.HEADS), 4)
    num_kv_heads: int = key(PositiveInt(limits.HEADS), 2)  # grouped-query attention when fewer than num_heads
    ffn_hidden_size: int = key(PositiveInt(limits.FFN_WIDTH), 128)  # SwiGLU inner width
    max_seq_len: int = key(PositiveInt(limits.SEQUENCE), 64)
    tie_embeddings: bool = key(Flag(), False)
    rope_theta: float = key(Number(positive=True), 10000.0)
    norm_eps: float = key(Number(positive=True), 1e-6)
    rope_scaling: dict[str, float] | None = key(Custom(_rope_scaling), None)  # Llama 3's long-context scaling
    qkv_bias: bool = key(Flag(), False)  # a bias on the q, k, v projections (Qwen2); no other linear has one
    # Mixture of experts (``parallel.models.moe``): 0 experts is a dense model. Layer i is an MoE layer when
    # i >= moe_first_dense and (i + 1) % moe_every == 0 (Qwen2-MoE's decoder_sparse_step; DeepSeek's
    # first dense layers); the others keep the dense SwiGLU MLP of ffn_hidden_size.
    moe_num_experts: int = key(NonNegativeInt(limits.EXPERTS), 0)
    moe_top_k: int = key(PositiveInt(limits.EXPERTS), 2)
    moe_ffn_hidden_size: int = key(NonNegativeInt(limits.FFN_WIDTH), 0)  # each expert's SwiGLU width; 0: ffn_hidden_size
    moe_shared_ffn_size: int = key(NonNegativeInt(limits.FFN_WIDTH), 0)  # a shared expert every token passes (0: none)
    moe_shared_gate: bool = key(Flag(), False)  # Qwen2-MoE: the shared expert's output × sigmoid(gate(x))
    moe_scoring: str = key(Choice(("softmax", "sigmoid")), "softmax")
    moe_normalize_top_k: bool = key(Flag(), True)  # renormalise the top-k weights to sum to 1
    moe_aux_loss_weight: float = key(Number(positive=False, maximum=MAX_LOSS_WEIGHT), 0.01)  # load-balancing loss (Switch / Mixtral)
    moe_z_loss_weight: float = key(Number(positive=False, maximum=MAX_LOSS_WEIGHT), 0.0)  # router z-loss (ST-MoE)
    moe_every: int = key(PositiveInt(limits.LAYERS), 1)
    moe_first_dense: int = key(NonNegativeInt(limits.LAYERS), 0)
    # The family whose blocks build the model (``parallel.families``: llama builds Llama, Mistral, Qwen2, Mixtral and
    # Qwen2-MoE) and the keys only some families' blocks read; each family refuses what its blocks cannot represent.
    family: str = key(Choice(decoder_names), "llama")
    head_size: int = key(NonNegativeInt(limits.WIDTH), 0)  # each head's width; 0: hidden_size / num_heads (qwen3 sets it)
    activation: str = key(Choice(ACTIVATIONS), "silu")  # gpt_neox's MLP: gelu (exact), gelu_tanh, relu or silu
    rotary_fraction: float = key(Number(positive=True, maximum=1.0), 1.0)  # gpt_neox: the rotated share of a head
    parallel_residual: bool = key(Flag(), False)  # gpt_neox: x + attn(ln1(x)) + mlp(ln2(x))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.moe_num_experts > 0 and any(self.is_moe_layer(i) for i in range(self.num_layers))

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (global) has the MoE block instead of the dense MLP."""
        return (self.moe_num_experts > 0 and index >= self.moe_first_dense
                and (index + 1) % self.moe_every == 0)

    def moe_layers(self, layers: range | None = None) -> list[int]:
        """The MoE layers among ``layers`` (default: all)."""
        return [i for i in (layers if layers is not None else range(self.num_layers)) if self.is_moe_layer(i)]

    def moe_config(self) -> Any:
        """The MoE block's ``MoEConfig`` (None for a dense model)."""
        if not self.moe_num_experts:
            return None
        return MoEConfig(num_experts=self.moe_num_experts, top_k=self.moe_top_k,
                         expert_ffn_size=self.moe_ffn_hidden_size or self.ffn_hidden_size, scoring=self.moe_scoring,  # type: ignore[arg-type]
                         normalize_top_k=self.moe_normalize_top_k, shared_ffn_size=self.moe_shared_ffn_size,
                         shared_gate=self.moe_shared_gate, aux_loss_weight=self.moe_aux_loss_weight,
                         z_loss_weight=self.moe_z_loss_weight)

    def to_dict(self) -> dict[str, Any]:
        """Every key, but ``FAMILY_KEYS`` only where they differ from their defaults (see there why)."""
        defaults = {f.name: f.default for f in fields(self) if f.name in FAMILY_KEYS}
        return {k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]}

    @staticmethod
    def from_mapping(raw: Mapping[str, Any], origin: str = "config") -> ModelConfig:
        """Build from the ``model:`` section; one ConfigError line per problem.

        ``hf: DIR`` reads a Hugging Face ``config.json`` from DIR (``parallel.config.hf_config``); the section's
        other keys override what it gives (e.g. a shorter ``max_seq_len`` for training). ``weights: true``
        (with ``hf``) is not a shape: ``weights_source`` reads it, and it is dropped here.
        """
        if isinstance(raw, Mapping) and ("hf" in raw or "weights" in raw):
            from hal.parallel.config.hf_config import model_keys_from_hf

            reject_unknown(origin, "model", raw, [*section_specs(ModelConfig), "hf", "weights"])  # a typo next to hf: its own line
            weights_source(raw, origin)  # the key's own checks
            given = {k: v for k, v in raw.items() if k not in ("hf", "weights")}
            raw = {**model_keys_from_hf(raw["hf"], f"{origin}: model.hf"), **given}
        config: ModelConfig = parse_section(origin, "model", raw, ModelConfig)
        config.check(origin)
        return config

    def check(self, origin: str = "config") -> None:
        """The sizes agree with one another (heads divide hidden, kv heads divide heads, an even head size), and the
        family's blocks represent the keys (``Family.check_model``)."""
        if not self.head_size and self.hidden_size % self.num_heads:
            raise ConfigError(f"{origin}: model.hidden_size {self.hidden_size} is not divisible by model.num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{origin}: model.num_heads {self.num_heads} is not divisible by model.num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{origin}: head size {self.head_dim} must be even for rotary embeddings; change hidden_size or num_heads")
        if self.moe_num_experts:
            if self.moe_top_k > self.moe_num_experts:
                raise ConfigError(f"{origin}: model.moe_top_k {self.moe_top_k} is above model.moe_num_experts "
                                  f"{self.moe_num_experts}; a token can choose at most every expert — lower moe_top_k")
            if self.moe_shared_gate and not self.moe_shared_ffn_size:
                raise ConfigError(f"{origin}: model.moe_shared_gate needs a shared expert; set model.moe_shared_ffn_size")
            if not self.is_moe:
                raise ConfigError(f"{origin}: model.moe_num_experts {self.moe_num_experts} but no layer is an MoE layer "
                                  f"(moe_first_dense {self.moe_first_dense}, moe_every {self.moe_every}, "
                                  f"{self.num_layers} layers); lower moe_first_dense or moe_every")
        elif self.moe_shared_ffn_size or self.moe_shared_gate:
            raise ConfigError(f"{origin}: model.moe_shared_ffn_size / moe_shared_gate need model.moe_num_experts > 0")
        get_family(self.family).check_model(self, origin)


def weights_source(raw: Any, origin: str = "config") -> str | None:
    """The directory whose safetensors initialise the model (``model: {hf: DIR, weights: true}``), else None."""
    if not isinstance(raw, Mapping) or "weights" not in raw:
        return None
    flag = raw["weights"]
    if not isinstance(flag, bool):
        raise ConfigError(f"{origin}: key 'model.weights' must be true or false, got {flag!r}; e.g. weights: true")
    if "hf" not in raw:
        raise ConfigError(f"{origin}: key 'model.weights' loads a Hugging Face model's safetensors and needs 'model.hf: DIR' "
                          "beside it; add hf or drop weights")
    return str(raw["hf"]) if flag else None
