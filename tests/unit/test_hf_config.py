"""``model: {hf: DIR}``: Hugging Face config.json onto hal's decoder (Llama 2/3, Mistral, Qwen2), the rest refused by field."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.families.rotary import rope_tables

# The published shapes of Llama-3.2-1B's config.json (the fields the mapping reads).
LLAMA_32_1B: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
MISTRAL_7B: dict[str, Any] = {
    "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
}
# Qwen2.5-0.5B's published config.json: a sliding window declared but switched off.
QWEN25_05B: dict[str, Any] = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21, "tie_word_embeddings": True,
}


def _dir(tmp_path: Path, config: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(tmp_path)


def test_llama_3_2_1b_maps_onto_the_decoder_and_the_section_overrides(tmp_path: Path) -> None:
    model = ModelConfig.from_mapping({"hf": _dir(tmp_path, LLAMA_32_1B), "max_seq_len": 2048})
    assert (model.vocab_size, model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads) == (128256, 2048, 16, 32, 8)
    assert (model.ffn_hidden_size, model.max_seq_len, model.tie_embeddings) == (8192, 2048, True)
    assert model.rope_theta == 500000.0 and model.norm_eps == 1e-5 and model.head_dim == 64
    assert model.rope_scaling == {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192.0}
    assert ModelConfig(**json.loads(json.dumps(model.to_dict()))) == model  # job files and checkpoints round-trip


def test_mistral_without_a_sliding_window_maps(tmp_path: Path) -> None:
    model = ModelConfig.from_mapping({"hf": _dir(tmp_path, MISTRAL_7B), "max_seq_len": 4096})
    assert (model.num_layers, model.num_kv_heads, model.rope_theta, model.rope_scaling) == (32, 8, 1e6, None)


def test_qwen2_maps_with_a_qkv_bias_and_its_inactive_sliding_window(tmp_path: Path) -> None:
    model = ModelConfig.from_mapping({"hf": _dir(tmp_path, QWEN25_05B), "max_seq_len": 512})
    assert (model.qkv_bias, model.num_heads, model.num_kv_heads, model.head_dim, model.tie_embeddings) == (True, 14, 2, 64, True)
    assert not ModelConfig.from_mapping({"hf": _dir(tmp_path, LLAMA_32_1B), "max_seq_len": 512}).qkv_bias
    # transformers 5 writes the per-layer kinds instead: all full attention is no window either
    v5 = {**QWEN25_05B, "sliding_window": None, "layer_types": ["full_attention"] * 24}
    assert ModelConfig.from_mapping({"hf": _dir(tmp_path, v5), "max_seq_len": 512}).qkv_bias


def test_transformers_5_rope_parameters_are_read(tmp_path: Path) -> None:
    legacy = {k: v for k, v in LLAMA_32_1B.items() if k not in ("rope_theta", "rope_scaling")}
    v5 = {**legacy, "rope_parameters": {"rope_theta": 500000.0, **LLAMA_32_1B["rope_scaling"]}}
    assert ModelConfig.from_mapping({"hf": _dir(tmp_path, v5), "max_seq_len": 64}) == \
        ModelConfig.from_mapping({"hf": _dir(tmp_path, LLAMA_32_1B), "max_seq_len": 64})
    plain = {**legacy, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    model = ModelConfig.from_mapping({"hf": _dir(tmp_path, plain), "max_seq_len": 64})
    assert (model.rope_theta, model.rope_scaling) == (1e6, None)


@pytest.mark.parametrize("change,words", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not one hal's decoder represents; supported: llama, mistral, qwen2"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not one hal's decoder represents"),
    ({"attention_bias": True}, "attention_bias = True"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"head_dim": 128}, "head_dim = 128"),
    ({"sliding_window": 4096}, "sliding_window = 4096"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 10},
     "sliding_window = 4096: layers 10..15 would attend through a window"),
    ({"layer_types": ["full_attention"] * 15 + ["sliding_attention"], "sliding_window": 1024}, "sliding_window = 1024: layers 15..15"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not represented"),
    ({"num_hidden_layers": None}, "config.json has no 'num_hidden_layers'"),
])
def test_what_the_decoder_cannot_represent_is_one_line_naming_the_field(tmp_path: Path, change: dict, words: str) -> None:
    config = {**LLAMA_32_1B, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ConfigError, match=None) as info:
        ModelConfig.from_mapping({"hf": _dir(tmp_path, config), "max_seq_len": 2048})
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_missing_or_broken_config_json_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; give the model directory"):
        ModelConfig.from_mapping({"hf": str(tmp_path / "nowhere")})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ModelConfig.from_mapping({"hf": str(tmp_path)})


def test_a_config_json_that_is_a_pipe_a_folder_or_huge_is_one_line_before_any_read(tmp_path: Path) -> None:
    import os

    pipe_dir, folder_dir, huge_dir = (tmp_path / name for name in ("pipe", "folder", "huge"))
    for d in (pipe_dir, folder_dir, huge_dir):
        d.mkdir()
    os.mkfifo(pipe_dir / "config.json")  # reading it would block forever
    (folder_dir / "config.json").mkdir()
    with open(huge_dir / "config.json", "wb") as f:
        f.truncate((1 << 20) + 1)  # sparse: nothing of it may be read
    for d, words in ((pipe_dir, "is not a regular file (a directory, pipe or device)"),
                     (folder_dir, "is not a regular file"),
                     (huge_dir, "larger than 1 MiB, more than such a file holds; give the model directory")):
        with pytest.raises(ConfigError, match=None) as info:
            ModelConfig.from_mapping({"hf": str(d)})
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_llama3_rope_scaling_keeps_short_wavelengths_and_stretches_long_ones() -> None:
    seq, head_dim, theta = 64, 64, 500000.0
    scaling = (32.0, 1.0, 4.0, 8192.0)
    cos0, sin0 = rope_tables(seq, head_dim, theta, torch.device("cpu"), torch.float64)
    cos1, sin1 = rope_tables(seq, head_dim, theta, torch.device("cpu"), torch.float64, scaling)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelength = 2 * math.pi / inv
    high = wavelength < 8192 / 4.0  # kept as they are
    low = wavelength > 8192 / 1.0  # divided by the factor
    angles = torch.atan2(sin1[1, : head_dim // 2], cos1[1, : head_dim // 2])  # position 1: the frequency itself
    torch.testing.assert_close(angles[high], inv[high])
    torch.testing.assert_close(angles[low], inv[low] / 32.0)
    middle = ~(high | low)
    assert bool(((angles[middle] < inv[middle]) & (angles[middle] > inv[middle] / 32.0)).all())
    assert not torch.equal(cos0, cos1)


MIXTRAL_SMALL: dict[str, Any] = {**MISTRAL_7B, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
QWEN2_MOE_SMALL: dict[str, Any] = {**QWEN25_05B, "model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
                                   "decoder_sparse_step": 1}


def test_mixtral_and_qwen2_moe_counts_map(tmp_path: Path) -> None:
    mixtral = ModelConfig.from_mapping({"hf": _dir(tmp_path, MIXTRAL_SMALL), "max_seq_len": 512})
    assert (mixtral.moe_num_experts, mixtral.moe_top_k, mixtral.moe_every) == (8, 2, 1)
    qwen = ModelConfig.from_mapping({"hf": _dir(tmp_path, {**QWEN2_MOE_SMALL, "decoder_sparse_step": 2}), "max_seq_len": 512})
    assert (qwen.moe_num_experts, qwen.moe_ffn_hidden_size, qwen.moe_every) == (8, 64, 2)


@pytest.mark.parametrize("base,change", [
    (MIXTRAL_SMALL, {"num_local_experts": 0}),  # was read as a dense model
    (MIXTRAL_SMALL, {"num_experts_per_tok": 0}),
    (QWEN2_MOE_SMALL, {"moe_intermediate_size": 0}),  # was replaced by intermediate_size
    (QWEN2_MOE_SMALL, {"decoder_sparse_step": 0}),  # was taken as 1
    (QWEN2_MOE_SMALL, {"num_experts": "8"}),
    (QWEN2_MOE_SMALL, {"num_experts": True}),
], ids=["mixtral-experts-0", "mixtral-top-k-0", "qwen-expert-width-0", "qwen-sparse-step-0", "qwen-experts-str",
        "qwen-experts-bool"])
def test_an_moe_count_that_is_not_a_positive_number_is_one_line_naming_config_json(tmp_path: Path, base: dict,
                                                                                   change: dict) -> None:
    (name, value), = change.items()
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_mapping({"hf": _dir(tmp_path, {**base, **change}), "max_seq_len": 512})
    said = str(info.value)
    assert f"config.json: key '{name}' must be a positive integer, got {value!r}" in said and "\n" not in said, said


# --- every field checked before any arithmetic, for every family ---------------------------------------------
SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False, "max_window_layers": 2},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "use_sliding_window": False, "max_window_layers": 2},
}
COMMON_ABSURD = [("num_attention_heads", 0), ("hidden_size", "64"), ("num_hidden_layers", 10**12),
                 ("intermediate_size", -5), ("vocab_size", 2.5), ("rms_norm_eps", "tiny"), ("head_dim", 0),
                 ("max_position_embeddings", True), ("num_key_value_heads", 0), ("sliding_window", "off"),
                 ("layer_types", "full_attention"), ("rope_scaling", 3), ("tie_word_embeddings", "yes")]
FAMILY_ABSURD = {"qwen2": [("max_window_layers", "all"), ("use_sliding_window", "no")],
                 "mixtral": [("num_local_experts", 0), ("num_experts_per_tok", "2"), ("router_aux_loss_coef", -1)],
                 "qwen2_moe": [("max_window_layers", "all"), ("mlp_only_layers", ["x"]), ("mlp_only_layers", [0] * 5000),
                               ("decoder_sparse_step", 0), ("moe_intermediate_size", 10**12), ("num_experts", None)]}


@pytest.mark.parametrize("family, key, value", [(f, k, v) for f in FAMILIES for k, v in COMMON_ABSURD]
                         + [(f, k, v) for f, cases in FAMILY_ABSURD.items() for k, v in cases])
def test_an_absurd_config_json_value_is_one_line_naming_the_file_and_key(tmp_path: Path, family: str, key: str,
                                                                        value: Any) -> None:
    base = {**SMALL, **FAMILIES[family]}
    ModelConfig.from_mapping({"hf": _dir(tmp_path, base)})  # the family's small config itself maps
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_mapping({"hf": _dir(tmp_path, {**base, key: value})})
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "config.json") in message and f"'{key}" in message, message
