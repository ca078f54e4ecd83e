"""``hal train`` of Qwen3 and GPT-NeoX from Hugging Face weights (two stages, the first tp 2), then ``hal export --to
hf``: transformers loads the export and gives the trained checkpoint's logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from hal.parallel.config.model import ModelConfig
from hal.parallel.models.stage import full_model
from hal.parallel.state.checkpoint import read_meta, read_tensors, resolve
from hal.parallel.state.hf_checks import check_weights

from .. import family_cases as cases
from ..conftest import run_hal

pytest.importorskip("transformers", reason="the reference is transformers' model ('test' extra)")

TOL = 1e-5
STEPS = 3
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM"}


def _train(root: Path, name: str) -> Path:
    """3 ranks: stage 0 (layer 0) tp2, stage 1 (layer 1) one device; a few steps of synthetic data."""
    hf_dir = cases.save_random(name, root / name, seed=7)
    raw = {
        "backend": "cpu", "precision": "fp32",
        "model": {"hf": str(hf_dir), "weights": True, "max_seq_len": cases.SEQ},
        "parallel": {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 1,
                     "stages": [{"backend": "cpu", "devices": 2, "layers": 1, "tp": 2}, {"backend": "cpu", "devices": 1, "layers": 1}]},
        "train": {"steps": STEPS, "lr": 1e-2, "seed": 0, "data": "synthetic"},
    }
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = run_hal("train", str(config), "--run-dir", str(root / f"run-{name}"), "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / f"run-{name}" / "checkpoints"


@pytest.mark.parametrize("name", ["qwen3", "gpt_neox"])
def test_trained_family_exports_and_transformers_gives_our_logits(tmp_path: Path, name: str) -> None:
    checkpoints = _train(tmp_path, name)
    out = tmp_path / "exported"
    result = run_hal("export", str(checkpoints), "--to", "hf", str(out), "--json")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (name, [ARCHITECTURES[name]])

    checkpoint = resolve(checkpoints)
    meta = read_meta(checkpoint)
    model = ModelConfig(**meta["model"])
    assert model.family == name
    params, _ = read_tensors(checkpoint, meta)
    ours = full_model(model, 0)
    with torch.no_grad():
        for pname, p in ours.named_parameters():
            p.copy_(params[pname])
        tokens = cases.ids()
        got = ours(tokens)
    want = cases.hf_cases.hf_logits(out, tokens)
    err = float((got - want).abs().max())
    assert err <= TOL, f"max |logit difference| {err:.3g} above {TOL}"
    before = cases.hf_cases.hf_logits(tmp_path / name, tokens)  # the weights it started from: training moved them
    assert float((before - want).abs().max()) > 100 * TOL
    assert ModelConfig.from_mapping({"hf": str(out)}) == model  # and back in
    check_weights(out, model, "export")
