"""``model: {hf: DIR}``: a Hugging Face ``config.json`` mapped onto hal's decoder, or refused field by field.

Llama (2 and 3, with Llama 3's rope scaling), Mistral and Qwen2 are the same decoder as hal's: GQA,
SwiGLU, RMSNorm, rotary embeddings; Qwen2 adds a bias on the q, k, v projections (``qkv_bias``).
Mixtral and Qwen2-MoE are those decoders with MoE feed-forwards (``model.moe_*``: softmax top-k routing,
SwiGLU experts; Qwen2-MoE's gated shared expert, its sparse step and leading dense layers).
Any field that would change the computation and that the decoder cannot represent — other biases
(Llama's ``attention_bias`` also biases the output projection), another activation, another rope
scaling, a head size that is not hidden/heads, a sliding window that is active and shorter than the
context — is one line naming the field, never silently dropped. A sliding window that is off
(Qwen2's ``use_sliding_window: false``, or every ``layer_types`` entry full attention) is no
difference, so it is accepted. Both the legacy ``rope_theta``/``rope_scaling`` keys and
transformers 5's ``rope_parameters`` are read. Qwen3 (RMSNorm on q and k per head, its own head size) and
GPT-NeoX (Pythia: LayerNorm, parallel residual, partial rotary, GELU MLP, biases) are families with blocks of their
own, so their keys carry ``model.family``. Each family's mapping is its own (``parallel.families``); this module
reads the file and finds the family. The weights themselves are ``parallel.models.hf_weights``'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hal.errors import ConfigError
from hal.parallel.families.registry import family_names, get_family
from hal.parallel.families.spec import Refuse, check_config_fields
from hal.run_dirs import read_limited

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; refuse anything absurd before reading it


def config_file(path: Any, where: str) -> Path:
    """DIR/config.json (or the file itself); one line if it is not there."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where} must be the path of a directory holding a Hugging Face config.json, got {path!r}")
    directory = Path(path).expanduser()
    file = directory / "config.json" if directory.is_dir() else directory
    if file.exists() and not file.is_file():  # a pipe would block the read; a directory named config.json fails it
        raise ConfigError(f"{where}: {file} is not a regular file (a directory, pipe or device); give the model "
                          "directory that holds config.json")
    if not file.is_file():
        raise ConfigError(f"{where}: {file} does not exist; give the model directory that holds config.json")
    return file


def _read(path: Any, where: str) -> dict[str, Any]:
    file = config_file(path, where)
    raw = read_limited(file, MAX_CONFIG_BYTES, f"{where}: {file}", "give the model directory that holds config.json")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: {file} is not valid JSON ({exc}); give the model's config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {file} holds {type(data).__name__}, not a JSON object")
    return data


def model_keys_from_hf(path: Any, where: str = "model.hf") -> dict[str, Any]:
    """The ``model:`` keys (``parallel.config.model.ModelConfig``) a Hugging Face config.json describes: its family's
    mapping (``Family.model_keys``) and ``model.family``, the family whose blocks build it."""
    hf = _read(path, where)
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in family_names():
        raise ConfigError(f"{where}: model_type {model_type!r} is not one hal's decoder represents; "
                          f"supported: {', '.join(family_names())}")
    family = get_family(model_type)
    check_config_fields(hf, family, f"{where}: {config_file(path, where)}")

    def need(name: str) -> Any:
        if name not in hf:
            raise ConfigError(f"{where}: config.json has no {name!r}, which a {family} config always has")
        return hf[name]

    return {"family": family.decoder, **family.model_keys(hf, need, _refuser(hf, where), where)}


def _refuser(hf: dict[str, Any], where: str) -> Refuse:
    def refuse(name: str, why: str) -> None:
        raise ConfigError(f"{where}: {name} = {hf.get(name)!r}: {why}; hal's decoder cannot represent it")

    return refuse


__all__ = ["config_file", "model_keys_from_hf"]
