"""``model: {hf: DIR}``: a Hugging Face ``config.json`` mapped onto hal's decoder, or refused field by field.

Llama (2 and 3, with Llama 3's rope scaling) and Mistral (without a sliding window shorter than its
context) are the same decoder as hal's: GQA, SwiGLU, RMSNorm, rotary embeddings, no biases. Any
field that would change the computation and that the decoder cannot represent — attention or MLP
biases (Qwen2's qkv bias among them), another activation, another rope scaling, a head size that is
not hidden/heads, a sliding window — is one line naming the field, never silently dropped. The
weights are not read here (issue 13's weight loading is separate).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hal.errors import ConfigError

FAMILIES = ("llama", "mistral")
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; refuse anything absurd before reading it


def _read(path: Any, where: str) -> dict[str, Any]:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where} must be the path of a directory holding a Hugging Face config.json, got {path!r}")
    directory = Path(path).expanduser()
    file = directory / "config.json" if directory.is_dir() else directory
    if not file.is_file():
        raise ConfigError(f"{where}: {file} does not exist; give the model directory that holds config.json")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: {file} is {file.stat().st_size} bytes, more than a config.json can be; check the path")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: {file} is not valid JSON ({exc}); give the model's config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {file} holds {type(data).__name__}, not a JSON object")
    return data


def model_keys_from_hf(path: Any, where: str = "model.hf") -> dict[str, Any]:
    """The ``model:`` keys (``parallel.model_config.ModelConfig``) a Hugging Face config.json describes."""
    hf = _read(path, where)
    family = hf.get("model_type")
    if family not in FAMILIES:
        hint = " (Qwen2's qkv bias is not represented yet)" if family == "qwen2" else ""
        raise ConfigError(f"{where}: model_type {family!r} is not one hal's decoder represents{hint}; "
                          f"supported: {', '.join(FAMILIES)}")

    def need(name: str) -> Any:
        if name not in hf:
            raise ConfigError(f"{where}: config.json has no {name!r}, which a {family} config always has")
        return hf[name]

    def refuse(name: str, why: str) -> None:
        raise ConfigError(f"{where}: {name} = {hf.get(name)!r}: {why}; hal's decoder cannot represent it")

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the MLP is SwiGLU (silu)")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            refuse(name, "the decoder's linear layers have no bias")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        refuse("head_dim", f"the head size is hidden_size / num_attention_heads = {hidden // heads}")
    window = hf.get("sliding_window")
    if window is not None and window < need("max_position_embeddings"):
        refuse("sliding_window", "attention is full causal, no sliding window")
    keys: dict[str, Any] = {
        "vocab_size": need("vocab_size"), "hidden_size": hidden, "num_layers": need("num_hidden_layers"),
        "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": need("intermediate_size"), "max_seq_len": need("max_position_embeddings"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": hf.get("rope_theta", 10000.0), "norm_eps": hf.get("rms_norm_eps", 1e-6),
    }
    if hf.get("rope_scaling") is not None:
        keys["rope_scaling"] = hf["rope_scaling"]
    return keys


__all__ = ["FAMILIES", "model_keys_from_hf"]
