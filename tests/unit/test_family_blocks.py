"""Families with blocks of their own (Qwen3: q/k norm and its own head size; GPT-NeoX: LayerNorm, parallel residual,
partial rotary, GELU MLP, biases): transformers' logits from the same weights, ``model: {hf: DIR}``, the memory and
planner arithmetic against the built model, export read back, and what a family cannot represent refused."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hal.errors import ConfigError
from hal.parallel.config.flops import flops_per_token, model_parameters
from hal.parallel.config.memory import layer_parameters, stage_parameters
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan
from hal.parallel.families.registry import decoder_names, family_of, get_family
from hal.parallel.models.stage import full_model
from hal.parallel.state.hf_export import hf_config

from .. import family_cases as cases

pytest.importorskip("transformers", reason="the reference is transformers' model ('test' extra)")

TOL = 1e-5
EXPECTED = {  # the model keys each tiny config.json maps to, beyond the sizes
    "qwen3": {"family": "qwen3", "head_size": 16, "num_kv_heads": 2, "norm_eps": 1e-6, "activation": "silu",
              "rotary_fraction": 1.0, "parallel_residual": False},
    "gpt_neox": {"family": "gpt_neox", "head_size": 0, "num_kv_heads": 4, "norm_eps": 1e-5, "activation": "gelu",
                 "rotary_fraction": 0.5, "parallel_residual": True},
    "gpt_neox_sequential": {"family": "gpt_neox", "head_size": 0, "num_kv_heads": 4, "norm_eps": 1e-5,
                            "activation": "gelu_tanh", "rotary_fraction": 0.25, "parallel_residual": False},
}
NEOX = {"family": "gpt_neox", "vocab_size": 128, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
        "ffn_hidden_size": 96, "max_seq_len": 16, "activation": "gelu", "rotary_fraction": 0.25, "parallel_residual": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: cases.save_random(name, root / name, seed=i) for i, name in enumerate(cases.FAMILIES)}


def _model(directory: Path) -> ModelConfig:
    return ModelConfig.from_mapping({"hf": str(directory), "max_seq_len": cases.SEQ})


def _hf_model(directory: Path) -> Any:
    model = cases.hf_cases.transformers().AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def test_qwen3_and_gpt_neox_are_registered_with_blocks_of_their_own() -> None:
    assert decoder_names() == ("llama", "qwen3", "gpt_neox")
    assert get_family("qwen3").decoder == "qwen3" and get_family("gpt_neox").decoder == "gpt_neox"
    assert family_of(ModelConfig(**NEOX)) == get_family("gpt_neox")


@pytest.mark.parametrize("name", cases.FAMILIES)
def test_config_json_maps_onto_the_familys_keys(checkpoints: dict[str, Path], name: str) -> None:
    model = _model(checkpoints[name])
    assert {k: getattr(model, k) for k in EXPECTED[name]} == EXPECTED[name]
    assert (model.vocab_size, model.hidden_size, model.num_layers, model.num_heads) == (cases.VOCAB, 32, 2, 4)
    assert ModelConfig(**json.loads(json.dumps(model.to_dict()))) == model  # job files and checkpoints round-trip


@pytest.mark.parametrize("name", cases.FAMILIES)
def test_logits_equal_transformers_from_the_same_weights(checkpoints: dict[str, Path], name: str) -> None:
    ours = full_model(_model(checkpoints[name]), 0, init_from=checkpoints[name])
    tokens = cases.ids()
    with torch.no_grad():
        got, want = ours(tokens), _hf_model(checkpoints[name])(tokens).logits
    diff = float((got - want).abs().max())
    assert diff <= TOL * float(want.abs().max()), f"{name}: max |logit difference| {diff:.3g}"


@pytest.mark.parametrize("name", cases.FAMILIES)
def test_memory_flops_and_planner_count_the_built_models_parameters(checkpoints: dict[str, Path], name: str) -> None:
    from hal.parallel.planner.cluster import parse_cluster, resolve
    from hal.parallel.planner.cost import CostModel
    from hal.parallel.planner.device_profile import Profile
    from hal.parallel.planner.estimate import estimate_device
    from hal.parallel.planner.search import Search

    model = _model(checkpoints[name])
    with torch.device("meta"):
        built = full_model(model, 0)
    real = sum(p.numel() for p in built.parameters())
    assert real == sum(p.numel() for p in _hf_model(checkpoints[name]).parameters())  # transformers' count
    assert model_parameters(model) == real
    assert [layer_parameters(model, i) for i in range(2)] == [sum(p.numel() for p in built.layers[str(i)].parameters())
                                                              for i in range(2)]
    plan = ParallelPlan((StagePlan("cpu", 1, 1), StagePlan("cpu", 1, 1)), "1f1b", 2, 2, False)
    per_stage = [sum(p.numel() for n, p in built.named_parameters() if (n.startswith("layers.1") or n.startswith("norm")
                                                                        or n.startswith("head")) == bool(k))
                 for k in (0, 1)]
    assert [stage_parameters(model, plan, k) for k in (0, 1)] == per_stage
    embedding = built.embed.weight.numel()
    attention = 12 * model.num_layers * model.num_heads * model.head_dim * cases.SEQ
    assert flops_per_token(model, cases.SEQ) == 6 * (real - embedding) + attention
    cluster = resolve(parse_cluster({"groups": [{"backend": "cpu", "device": "cpu-generic", "count": 2}]}))
    kind = cluster.types[0]
    device = estimate_device(kind, model, "fp32", cases.SEQ, None) if kind.peak_tflops.get("fp32") else None
    profile = Profile(model.to_dict(), "fp32", {kind.device: device} if device else {})
    search = Search(CostModel(cluster, profile, model, cases.SEQ), plan)
    assert [search._stage_params(k, 2, 1) for k in (0, 1)] == per_stage  # the search's stage memory


@pytest.mark.parametrize("name", cases.FAMILIES)
def test_export_config_reads_back_and_transformers_builds_it(checkpoints: dict[str, Path], name: str,
                                                             tmp_path: Path) -> None:
    model = _model(checkpoints[name])
    config = hf_config(model, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert ModelConfig.from_mapping({"hf": str(tmp_path)}) == ModelConfig(**{**model.to_dict(), "max_seq_len": cases.SEQ})
    hf = cases.hf_cases.transformers()
    built = hf.AutoModelForCausalLM.from_config(hf.AutoConfig.from_pretrained(tmp_path))
    assert sum(p.numel() for p in built.parameters()) == model_parameters(model)


def test_yaml_keys_build_a_family_and_older_files_keep_their_keys() -> None:
    neox = ModelConfig.from_mapping(NEOX)
    assert neox.family == "gpt_neox" and neox.head_dim == 8
    llama = ModelConfig(hidden_size=32)
    assert not set(llama.to_dict()) & {"family", "head_size", "activation", "rotary_fraction", "parallel_residual"}
    assert ModelConfig(**llama.to_dict()) == llama and ModelConfig.from_mapping(llama.to_dict()) == llama
    qwen3 = ModelConfig.from_mapping({"family": "qwen3", "hidden_size": 32, "num_heads": 4, "head_size": 16})
    assert qwen3.head_dim == 16 and qwen3.to_dict()["head_size"] == 16


@pytest.mark.parametrize("keys, words", [
    ({**NEOX, "num_kv_heads": 2}, "model.family gpt_neox has no grouped-query attention; set model.num_kv_heads"),
    ({**NEOX, "rotary_fraction": 0.1}, "rotates 0 channels, which must be even and at least 2"),
    ({**NEOX, "qkv_bias": True}, "every linear of its layers has a bias; drop model.qkv_bias"),
    ({**NEOX, "moe_num_experts": 4}, "model.family gpt_neox is dense"),
    ({"hidden_size": 32, "parallel_residual": True}, "model.family llama adds attention and MLP one after the other"),
    ({"hidden_size": 32, "activation": "gelu"}, "model.family llama has a SwiGLU MLP; model.activation must be silu"),
    ({"hidden_size": 32, "num_heads": 4, "head_size": 16}, "drop model.head_size (or use family qwen3)"),
    ({"family": "qwen3", "hidden_size": 32, "qkv_bias": True}, "biases the output projection too"),
    ({"family": "mistral"}, "key 'model.family'"),
])
def test_what_a_familys_blocks_cannot_represent_is_one_line(keys: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_mapping(keys)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("change, words", [
    ({"attention_bias": False}, "attention_bias = False: the attention's linears always carry a bias"),
    ({"hidden_act": "gelu_10"}, "hidden_act = 'gelu_10'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_parameters = "),
    ({"rotary_pct": "half"}, "key 'rotary_pct'"),
])
def test_what_gpt_neox_config_json_cannot_say_is_one_line(checkpoints: dict[str, Path], change: dict[str, Any],
                                                          words: str, tmp_path: Path) -> None:
    config = json.loads((checkpoints["gpt_neox"] / "config.json").read_text())
    config.pop("rope_parameters", None) if "rotary_pct" in change else None
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_mapping({"hf": str(tmp_path)})
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_qwen3_config_json_with_an_attention_bias_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = json.loads((checkpoints["qwen3"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True}), encoding="utf-8")
    with pytest.raises(ConfigError, match="attention_bias = True"):
        ModelConfig.from_mapping({"hf": str(tmp_path)})
