"""``hal train`` from Hugging Face weights, then ``hal export --to hf``: transformers loads the export and agrees."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.models.stage import full_model
from hal.parallel.state.checkpoint import read_meta, read_tensors, resolve
from hal.parallel.state.hf_checks import check_weights
from hal.parallel.state.hf_export import Source, export_hf, plan_shards, tokenizer_files

from .. import hf_cases as cases
from ..conftest import run_hal

pytest.importorskip("transformers", reason="the reference is transformers' model ('test' extra)")

TOL = 1e-5
STEPS = 5


def _tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json over 256 ids (what the export copies)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(cases.VOCAB - 1)} | {"<unk>": cases.VOCAB - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path))
    return path


def _config(tmp: Path, hf_dir: Path, **model: Any) -> Path:
    """3 ranks: stage 0 tp2 (2 layers), stage 1 one device (the last layer); 5 steps of synthetic data."""
    raw = {
        "backend": "cpu", "precision": "fp32",
        "model": {"hf": str(hf_dir), "weights": True, "max_seq_len": cases.SEQ, **model},
        "parallel": {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2,
                     "stages": [{"backend": "cpu", "devices": 2, "layers": 2, "tp": 2}, {"backend": "cpu", "devices": 1, "layers": 1}]},
        "train": {"steps": STEPS, "lr": 1e-3, "seed": 0, "data": "synthetic"},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    hf_dir = cases.save_random("qwen2", root / "qwen2", seed=5)
    _tokenizer(hf_dir / "tokenizer.json")
    result = run_hal("train", str(_config(root, hf_dir)), "--run-dir", str(root / "run"), "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "hf": hf_dir, "checkpoints": root / "run" / "checkpoints"}


def _checkpoint_model(checkpoints: Path) -> tuple[ModelConfig, torch.nn.Module]:
    """Our model with the checkpoint's weights (single process)."""
    checkpoint = resolve(checkpoints)
    meta = read_meta(checkpoint)
    model = ModelConfig(**meta["model"])
    params, _ = read_tensors(checkpoint, meta)
    module = full_model(model, 0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(params[name])
    return model, module


def test_trained_checkpoint_exports_and_transformers_gives_our_logits(trained: dict[str, Path]) -> None:
    out = trained["root"] / "exported"
    result = run_hal("export", str(trained["checkpoints"]), "--to", "hf", str(out), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["step"] == STEPS and report["model_type"] == "qwen2" and report["tokenizer"] == ["tokenizer.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(report["files"])
    assert (out / "model-00001-of-00001.safetensors").is_file() and (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer.json").read_bytes() == (trained["hf"] / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["torch_dtype"]) == ("qwen2", ["Qwen2ForCausalLM"], "float32")

    model, ours = _checkpoint_model(trained["checkpoints"])
    tokens = cases.ids()
    with torch.no_grad():
        got = ours(tokens)
    want = cases.hf_logits(out, tokens)
    err = float((got - want).abs().max())
    assert err <= TOL, f"max |logit difference| {err:.3g} above {TOL}"
    before = cases.hf_logits(trained["hf"], tokens)  # the weights it started from: training moved them
    assert float((before - want).abs().max()) > 100 * TOL
    # and back in: the export is a Hugging Face checkpoint of the same model
    assert ModelConfig.from_mapping({"hf": str(out)}) == model
    check_weights(out, model, "export")


def test_a_small_shard_size_writes_several_shards_transformers_loads(trained: dict[str, Path]) -> None:
    out = trained["root"] / "sharded"
    report = export_hf(trained["checkpoints"], out, max_shard_bytes=100_000)
    assert report["shards"] > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-{k:05d}-of-{report['shards']:05d}.safetensors"
                                                         for k in range(1, report["shards"] + 1)]
    _, ours = _checkpoint_model(trained["checkpoints"])
    tokens = cases.ids()
    with torch.no_grad():
        err = float((ours(tokens) - cases.hf_logits(out, tokens)).abs().max())
    assert err <= TOL


def test_shards_pack_consecutive_tensors_and_a_large_one_alone() -> None:
    tensors = [(name, torch.zeros(n)) for name, n in (("a", 10), ("b", 10), ("c", 30), ("d", 5))]
    assert [[n for n, _ in s] for s in plan_shards(tensors, 80)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in s] for s in plan_shards(tensors, 1000)] == [["a", "b", "c", "d"]]


# --- bad input: one line, exit 2, nothing written -------------------------------------------------------------
def _one_line_exit_2(result: Any, words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and words in lines[0], result.stderr


def test_an_existing_out_dir_is_refused_unless_force(trained: dict[str, Path]) -> None:
    out = trained["root"] / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    result = run_hal("export", str(trained["checkpoints"]), "--to", "hf", str(out))
    _one_line_exit_2(result, f"OUT_DIR {out} exists and is not empty; pass --force to replace it")
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    result = run_hal("export", str(trained["checkpoints"]), "--to", "hf", str(out), "--force")
    assert result.returncode == 0 and "qwen2" in result.stdout, result.stderr
    assert not (out / "mine.txt").exists() and (out / "config.json").is_file()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".taken")]  # no temporary left behind


def test_not_a_checkpoint_and_a_bad_format_are_one_line(trained: dict[str, Path]) -> None:
    _one_line_exit_2(run_hal("export", str(trained["hf"]), "--to", "hf", str(trained["root"] / "x")),
                     f"hal export {trained['hf']}: not a checkpoint (no meta.json)")
    _one_line_exit_2(run_hal("export", str(trained["checkpoints"]), "--to", "onnx", str(trained["root"] / "x")),
                     "argument --to: invalid choice: 'onnx'")
    assert not (trained["root"] / "x").exists()


def test_a_damaged_model_section_in_meta_json_is_one_line(trained: dict[str, Path], tmp_path: Path) -> None:
    """meta.json's model: is read through the config schema: a NaN (which would reach config.json as non-JSON NaN)
    and a misspelt choice are one line each, and nothing is written."""
    import json
    import shutil

    source = resolve(trained["checkpoints"])
    for key, value, says in (("rope_theta", float("nan"), "key 'model.rope_theta'"),
                             ("moe_scoring", "sigmoidx", "key 'model.moe_scoring'")):
        damaged = Path(shutil.copytree(source, tmp_path / key))
        meta = json.loads((damaged / "meta.json").read_text())
        meta["model"][key] = value
        (damaged / "meta.json").write_text(json.dumps(meta))
        _one_line_exit_2(run_hal("export", str(damaged), "--to", "hf", str(tmp_path / f"{key}-out")), says)
        assert not (tmp_path / f"{key}-out").exists()


def test_hal_train_refuses_a_truncated_shard_and_another_model_before_starting(trained: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    broken = Path(shutil.copytree(trained["hf"], tmp_path / "broken"))
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    result = run_hal("train", str(_config(tmp_path, broken)), "--run-dir", str(tmp_path / "run"))
    _one_line_exit_2(result, "model.safetensors is")
    assert "truncated" in result.stderr and not (tmp_path / "run").exists()
    other = cases.save_random("llama", tmp_path / "llama", layers=3)
    result = run_hal("train", str(_config(tmp_path, trained["hf"])), "--init-from", str(other), "--run-dir", str(tmp_path / "run"))
    _one_line_exit_2(result, f"--init-from {other}: its config.json gives model.rope_theta 500000.0 but the run's model has 10000.0")


def test_a_tokenizer_other_than_the_datas_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train.idx.json").write_text(json.dumps({"tokenizer_sha256": "0" * 64}))
    source = Source(tmp_path, {"data": {"source": str(tmp_path / "train.bin")}}, ModelConfig(), {})
    with pytest.raises(ConfigError, match="is not the tokenizer the training data was prepared with"):
        tokenizer_files(str(_tokenizer(tmp_path / "tokenizer.json")), source)


def _vocab_tokenizer(path: Path, tokens: int) -> Path:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(tokens)}, unk_token="t0")).save(str(path))
    return path


def test_the_shipped_tokenizer_must_parse_and_fit_the_model_one_line_and_nothing_written(
        tmp_path: Path, trained: dict[str, Path]) -> None:
    """Random bytes, a tokenizer of 1024 tokens for a model of 256, a tokenizer_config.json that is not JSON: each
    one line, exit 2, no OUT_DIR; a tokenizer that fits (fewer tokens than rows: padding) is shipped."""
    junk = tmp_path / "junk" / "tokenizer.json"
    junk.parent.mkdir()
    junk.write_bytes(bytes(range(256)) * 8)
    big = _vocab_tokenizer(tmp_path / "big.json", 4 * cases.VOCAB)
    bad_side = tmp_path / "side"
    bad_side.mkdir()
    _tokenizer(bad_side / "tokenizer.json")
    (bad_side / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    out = tmp_path / "out"
    for given, says in ((junk, "not a Hugging Face tokenizer.json"),
                        (big, f"has {4 * cases.VOCAB} tokens (ids up to {4 * cases.VOCAB - 1}) but the model's "
                              f"vocabulary has {cases.VOCAB} rows"),
                        (bad_side, "tokenizer_config.json (copied beside the tokenizer) is not a JSON object")):
        result = run_hal("export", str(trained["checkpoints"]), "--to", "hf", str(out), "--tokenizer", str(given))
        _one_line_exit_2(result, says)
        assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    small = _vocab_tokenizer(tmp_path / "small.json", cases.VOCAB // 2)
    result = run_hal("export", str(trained["checkpoints"]), "--to", "hf", str(out), "--tokenizer", str(small))
    assert result.returncode == 0, result.stderr
    assert (out / "tokenizer.json").read_bytes() == small.read_bytes()


# --- MoE families ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_an_moe_model_written_by_the_export_path_is_read_back_by_transformers(tmp_path: Path, family: str) -> None:
    """A Mixtral / Qwen2-MoE checkpoint into hal, out again through the export's config.json, tensor names and
    writer: transformers reads it and gives the same logits, and hal reads the same model from it."""
    from hal.parallel.state.hf_export import _write

    hf_dir = cases.save_random(family, tmp_path / "in", seed=7)
    model = ModelConfig.from_mapping({"hf": str(hf_dir), "weights": True})
    ours = full_model(model, 0, init_from=hf_dir)
    source = Source(tmp_path, {}, model, {n: p.detach() for n, p in ours.named_parameters()})
    from hal.parallel.state.hf_export import hf_tensors

    out = tmp_path / "out"
    out.mkdir()
    _write(out, source, hf_tensors(source), 2**30, [], torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    tokens = cases.ids()
    with torch.no_grad():
        got = ours(tokens)
    want = cases.hf_logits(out, tokens)
    assert float((got - want).abs().max()) <= TOL
    assert ModelConfig.from_mapping({"hf": str(out)}) == model
    check_weights(out, model, "export")


def test_an_moe_model_no_family_states_is_refused_at_export() -> None:
    from hal.parallel.state.hf_export import hf_config

    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                moe_num_experts=4, moe_top_k=2)
    with pytest.raises(ConfigError, match="Mixtral has every layer MoE"):
        hf_config(ModelConfig(**base, moe_shared_ffn_size=16), torch.float32)
    with pytest.raises(ConfigError, match="gated shared expert"):
        hf_config(ModelConfig(**base, qkv_bias=True), torch.float32)
    with pytest.raises(ConfigError, match="routes with softmax"):
        hf_config(ModelConfig(**base, moe_scoring="sigmoid"), torch.float32)


def test_hal_train_from_qwen2_moe_weights_exports_a_checkpoint_transformers_agrees_with(tmp_path: Path) -> None:
    """The MoE layers on the one-device stage (tp 1), the dense ones tensor-parallel: trained, exported, read back."""
    hf_dir = cases.save_random("qwen2_moe", tmp_path / "qwen2_moe", seed=9, dense_layers=2)
    result = run_hal("train", str(_config(tmp_path, hf_dir)), "--run-dir", str(tmp_path / "run"), "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "exported"
    result = run_hal("export", str(tmp_path / "run" / "checkpoints"), "--to", "hf", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model_type"] == "qwen2_moe"
    model, ours = _checkpoint_model(tmp_path / "run" / "checkpoints")
    assert model.moe_layers() == [2]
    tokens = cases.ids()
    with torch.no_grad():
        got = ours(tokens)
    want = cases.hf_logits(out, tokens)
    assert float((got - want).abs().max()) <= TOL
    before = cases.hf_logits(hf_dir, tokens)
    assert float((before - want).abs().max()) > 100 * TOL  # training moved the weights
