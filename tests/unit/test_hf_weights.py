"""``model: {hf: DIR, weights: true}`` in one process: transformers' own logits, and every bad checkpoint one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.models.stage import full_model
from hal.parallel.state.hf_checks import check_weights

from .. import hf_cases as cases

pytest.importorskip("transformers", reason="the reference is transformers' model ('test' extra)")
from safetensors.torch import load_file, save_file  # noqa: E402  (transformers brings safetensors)

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": cases.save_random("llama", root / "llama", seed=1),
        "mistral": cases.save_random("mistral", root / "mistral", seed=2),
        "qwen2": cases.save_random("qwen2", root / "qwen2", seed=3, max_shard_size="100KB"),  # sharded, with an index
        "mixtral": cases.save_random("mixtral", root / "mixtral", seed=4),
        "qwen2_moe": cases.save_random("qwen2_moe", root / "qwen2_moe", seed=5, max_shard_size="100KB"),
    }


def _load(directory: Path) -> tuple[ModelConfig, torch.nn.Module]:
    model = ModelConfig.from_mapping({"hf": str(directory), "weights": True})
    check_weights(directory, model, "test")
    return model, full_model(model, 0, init_from=directory)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "mixtral", "qwen2_moe"])
def test_loaded_model_gives_transformers_logits(checkpoints: dict[str, Path], family: str) -> None:
    directory = checkpoints[family]
    model, ours = _load(directory)
    assert model.qkv_bias == (family in ("qwen2", "qwen2_moe")) and model.tie_embeddings == (family == "mistral")
    assert (model.rope_scaling is not None) == (family == "llama")
    moe = {"mixtral": [0, 1, 2], "qwen2_moe": [1, 2]}.get(family, [])
    assert model.moe_layers() == moe and sorted(ours.moe_blocks()) == moe
    if family == "qwen2":
        assert (directory / "model.safetensors.index.json").is_file() and len(list(directory.glob("*.safetensors"))) > 1
        assert ours.layers["0"].attn.qkv.bias.abs().sum() > 0  # the bias came from the file, not the zero init
    tokens = cases.ids()
    with torch.no_grad():
        got = ours(tokens)
    want = cases.hf_logits(directory, tokens)
    assert got.shape == want.shape
    err = float((got - want).abs().max())
    assert err <= TOL, f"{family}: max |logit difference| {err:.3g} above {TOL} (logits up to {float(want.abs().max()):.3g})"
    seeded = full_model(model, 0)  # the seeded init is not what was loaded
    assert not torch.equal(seeded.layers["2"].attn.out.weight, ours.layers["2"].attn.out.weight)
    if moe:
        assert not torch.equal(seeded.layers["2"].mlp.experts.down, ours.layers["2"].mlp.experts.down)


# --- bad checkpoints: one ConfigError line naming the tensor or file ---------------------------------------------
@pytest.fixture
def llama(checkpoints: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoints["llama"], tmp_path / "llama"))


@pytest.fixture
def sharded(checkpoints: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoints["qwen2"], tmp_path / "qwen2"))


def _refused(directory: Path, words: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(directory)
    message = str(info.value)
    assert words in message and "\n" not in message, message
    return message


def _rewrite(directory: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_an_unsupported_architecture_is_refused(llama: Path) -> None:
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    _refused(llama, "model_type 'gpt2' is not one hal's decoder represents; supported: llama, mistral, qwen2, mixtral, qwen2_moe")


def test_a_truncated_shard_is_refused(sharded: Path) -> None:
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    _refused(sharded, f"{shard.name} is {len(data) - 100} bytes but its header describes {len(data)}: truncated")


def test_a_shard_the_index_names_but_is_absent_is_refused(sharded: Path) -> None:
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.unlink()
    _refused(sharded, f"names {shard.name}, which is not in")


def test_a_missing_tensor_is_refused(llama: Path) -> None:
    _rewrite(llama, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    _refused(llama, "tensor model.layers.1.mlp.down_proj.weight is missing from")


def test_a_mis_shaped_tensor_is_refused(llama: Path) -> None:
    _rewrite(llama, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    _refused(llama, "tensor model.layers.0.self_attn.k_proj.weight in model.safetensors has shape [16, 64], this model needs [32, 64]")


def test_an_extra_tensor_and_an_integer_tensor_are_refused(llama: Path) -> None:
    _rewrite(llama, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    _refused(llama, "holds tensor model.layers.0.self_attn.o_proj.bias, which this model has no place for")
    _rewrite(llama, lambda t: (t.pop("model.layers.0.self_attn.o_proj.bias"), t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})))
    _refused(llama, "tensor model.norm.weight in model.safetensors is I32, not a floating-point dtype")


def test_a_tensor_holding_nan_or_inf_is_refused_as_it_loads(llama: Path) -> None:
    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.1.mlp.up_proj.weight"][5, 2] = float("nan")

    _rewrite(llama, poison)
    _refused(llama, "tensor model.layers.1.mlp.up_proj.weight in model.safetensors holds NaN or infinite values (rows 0..")
    _rewrite(llama, lambda t: t["model.layers.1.mlp.up_proj.weight"].nan_to_num_(0.0).__setitem__((0, 0), float("inf")))
    _refused(llama, "holds NaN or infinite values")


def test_a_corrupt_header_and_no_weights_at_all_are_refused(llama: Path) -> None:
    file = llama / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:12] = b"\xff\xfe{["
    file.write_bytes(bytes(data))
    _refused(llama, "model.safetensors's safetensors header is not valid JSON")
    file.unlink()
    _refused(llama, "has neither model.safetensors nor model.safetensors.index.json")


def test_weights_needs_hf_and_a_flag() -> None:
    with pytest.raises(ConfigError, match="key 'model.weights' loads a Hugging Face model's safetensors and needs 'model.hf: DIR'"):
        ModelConfig.from_mapping({"weights": True})
    with pytest.raises(ConfigError, match="key 'model.weights' must be true or false, got 'yes'"):
        ModelConfig.from_mapping({"hf": "x", "weights": "yes"})
    with pytest.raises(ConfigError, match=r"unknown key 'model.weight' \(did you mean 'weights'\?\)"):
        ModelConfig.from_mapping({"hf": "x", "weight": True})
