"""The shape of the Llama-style decoder the engine trains: every size a plan is checked against."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from hal import limits
from hal.config_schema import Custom, Flag, Number, PositiveInt, key, parse_section, reject_unknown, section_specs
from hal.errors import ConfigError

ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_mapping(raw: Mapping[str, Any], origin: str = "config") -> "ModelConfig":
        """Build from the ``model:`` section; one ConfigError line per problem.

        ``hf: DIR`` reads a Hugging Face ``config.json`` from DIR (``parallel.hf_config``); the section's
        other keys override what it gives (e.g. a shorter ``max_seq_len`` for training). ``weights: true``
        (with ``hf``) is not a shape: ``weights_source`` reads it, and it is dropped here.
        """
        if isinstance(raw, Mapping) and ("hf" in raw or "weights" in raw):
            from .hf_config import model_keys_from_hf

            reject_unknown(origin, "model", raw, [*section_specs(ModelConfig), "hf", "weights"])  # a typo next to hf: its own line
            weights_source(raw, origin)  # the key's own checks
            given = {k: v for k, v in raw.items() if k not in ("hf", "weights")}
            raw = {**model_keys_from_hf(raw["hf"], f"{origin}: model.hf"), **given}
        config: ModelConfig = parse_section(origin, "model", raw, ModelConfig)
        config.check(origin)
        return config

    def check(self, origin: str = "config") -> None:
        """The sizes agree with one another (heads divide hidden, kv heads divide heads, an even head size)."""
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{origin}: model.hidden_size {self.hidden_size} is not divisible by model.num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{origin}: model.num_heads {self.num_heads} is not divisible by model.num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{origin}: head size {self.head_dim} must be even for rotary embeddings; change hidden_size or num_heads")


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
