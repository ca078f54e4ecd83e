"""The shape of the Llama-style decoder the engine trains: every size a plan is checked against."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from hal import limits
from hal.config_schema import Flag, Number, PositiveInt, key, parse_section
from hal.errors import ConfigError


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_mapping(raw: Mapping[str, Any], origin: str = "config") -> "ModelConfig":
        """Build from the ``model:`` section; one ConfigError line per problem."""
        config: ModelConfig = parse_section(origin, "model", raw, ModelConfig)
        config.check(origin)
        return config

    def check(self, origin: str = "config") -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{origin}: model.hidden_size {self.hidden_size} is not divisible by model.num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{origin}: model.num_heads {self.num_heads} is not divisible by model.num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{origin}: head size {self.head_dim} must be even for rotary embeddings; change hidden_size or num_heads")
