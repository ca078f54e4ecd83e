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
transformers 5's ``rope_parameters`` are read. The weights themselves are ``parallel.models.hf_weights``'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from hal.errors import ConfigError
from hal.parallel.families.registry import family_names, get_family
from hal.parallel.families.spec import check_config_fields
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


def _rope(hf: dict[str, Any]) -> tuple[Any, Any]:
    """(theta, scaling or None) from transformers 5's ``rope_parameters`` or the legacy keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling: Any = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None  # plain rotary embeddings, said explicitly
    return theta, scaling


def model_keys_from_hf(path: Any, where: str = "model.hf") -> dict[str, Any]:
    """The ``model:`` keys (``parallel.config.model.ModelConfig``) a Hugging Face config.json describes."""
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

    refuse: Callable[[str, str], None] = _refuser(hf, where)
    hidden, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the MLP is SwiGLU (silu)")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            refuse(name, "only the q, k, v projections can have a bias (Qwen2's), not the output projection or the MLP")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        refuse("head_dim", f"the head size is hidden_size / num_attention_heads = {hidden // heads}")
    window, context = hf.get("sliding_window"), need("max_position_embeddings")
    windowed = family.windowed_layers(hf, layers)
    if windowed and (window is None or window < context):
        name = "layer_types" if isinstance(hf.get("layer_types"), list) and window is None else "sliding_window"
        refuse(name, f"layers {windowed[0]}..{windowed[-1]} would attend through a window shorter than the context; "
                     "attention is full causal")
    theta, scaling = _rope(hf)
    keys: dict[str, Any] = {
        "vocab_size": need("vocab_size"), "hidden_size": hidden, "num_layers": layers,
        "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": need("intermediate_size"), "max_seq_len": context,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": theta, "norm_eps": hf.get("rms_norm_eps", 1e-6),
    }
    if scaling is not None:
        keys["rope_scaling"] = scaling
    keys.update(family.config_keys(hf, need, refuse, where))
    return keys


def _refuser(hf: dict[str, Any], where: str) -> Callable[[str, str], None]:
    def refuse(name: str, why: str) -> None:
        raise ConfigError(f"{where}: {name} = {hf.get(name)!r}: {why}; hal's decoder cannot represent it")

    return refuse


__all__ = ["config_file", "model_keys_from_hf"]
