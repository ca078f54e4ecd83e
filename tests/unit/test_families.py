"""Model families as specs: the registry finds each family by model_type and by a model's shape, and every exported
family's config.json reads back as the model it was written from (config mapping and export live in one file)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.families.registry import family_names, family_of, get_family
from hal.parallel.families.spec import Family
from hal.parallel.state.hf_export import hf_config

DENSE = {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 48,
         "max_seq_len": 16}
MOE = {"moe_num_experts": 4, "moe_top_k": 2}
SHAPES = {  # the family a model of these keys is named and exported as
    "llama": DENSE,
    "qwen2": {**DENSE, "qkv_bias": True},
    "mixtral": {**DENSE, **MOE, "moe_ffn_hidden_size": 48},
    "qwen2_moe": {**DENSE, **MOE, "qkv_bias": True, "moe_ffn_hidden_size": 24, "moe_shared_ffn_size": 16,
                  "moe_shared_gate": True, "moe_every": 2, "moe_first_dense": 1, "moe_normalize_top_k": False},
}


def test_every_family_is_registered_once_under_its_model_type() -> None:
    assert family_names() == ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3", "gpt_neox")
    for name in family_names():
        family = get_family(name)
        assert isinstance(family, Family) and family.model_type == name and str(family) == name
        assert family.architecture.endswith("ForCausalLM")
    with pytest.raises(KeyError):
        get_family("gpt2")


@pytest.mark.parametrize("name", SHAPES)
def test_a_model_is_named_as_the_first_exported_family_of_its_shape(name: str) -> None:
    assert family_of(ModelConfig(**SHAPES[name])) == get_family(name)


def test_mistral_reads_in_but_a_model_of_its_shape_is_exported_as_llama() -> None:
    mistral = get_family("mistral")
    assert not mistral.exported and mistral.represents(ModelConfig(**DENSE))
    assert family_of(ModelConfig(**DENSE)).model_type == "llama"
    assert mistral.layer_names == get_family("llama").layer_names  # the same tensor names


@pytest.mark.parametrize("name", SHAPES)
def test_export_then_read_back_gives_the_same_model(name: str, tmp_path: Path) -> None:
    model = ModelConfig(**SHAPES[name])
    config = hf_config(model, torch.float32)
    assert (config["model_type"], config["architectures"]) == (name, [get_family(name).architecture])
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert ModelConfig.from_mapping({"hf": str(tmp_path)}) == model


def test_a_family_refuses_what_its_config_json_cannot_say() -> None:
    sigmoid = ModelConfig(**{**SHAPES["mixtral"], "moe_scoring": "sigmoid"})
    with pytest.raises(ConfigError, match="hal export: the model's router scores with sigmoid; mixtral routes with softmax"):
        hf_config(sigmoid, torch.float32)
    no_shared = ModelConfig(**{**SHAPES["qwen2_moe"], "moe_shared_ffn_size": 0, "moe_shared_gate": False})
    assert family_of(no_shared).model_type == "qwen2_moe"
    with pytest.raises(ConfigError, match="Qwen2-MoE layers have a gated shared expert; this model has none"):
        hf_config(no_shared, torch.float32)
