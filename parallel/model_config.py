"""The shape of the Llama-style decoder the engine trains: every size a plan is checked against."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from hal.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level tokens by default
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention when fewer than num_heads
    ffn_hidden_size: int = 128  # SwiGLU inner width
    max_seq_len: int = 64
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_mapping(raw: Mapping[str, Any], origin: str = "config") -> "ModelConfig":
        """Build from the ``model:`` section; one ConfigError line per problem."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{origin}: key 'model' must be a mapping of model sizes, got {type(raw).__name__}")
        known = {f.name: f for f in fields(ModelConfig)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in known:
                raise ConfigError(f"{origin}: unknown key 'model.{key}'; allowed: {', '.join(known)}")
            default = known[key].default
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"{origin}: key 'model.{key}' must be true or false, got {value!r}")
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ConfigError(f"{origin}: key 'model.{key}' must be a positive integer, got {value!r}")
            elif isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ConfigError(f"{origin}: key 'model.{key}' must be a positive number, got {value!r}")
                value = float(value)
            values[key] = value
        config = ModelConfig(**values)
        config.check(origin)
        return config

    def check(self, origin: str = "config") -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{origin}: model.hidden_size {self.hidden_size} is not divisible by model.num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{origin}: model.num_heads {self.num_heads} is not divisible by model.num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{origin}: head size {self.head_dim} must be even for rotary embeddings; change hidden_size or num_heads")
