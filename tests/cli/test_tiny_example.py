"""The README's new-user flow, as a user runs it: ``hal data prepare`` with the shipped tokenizer, then
``hal train examples/tiny_cpu.yaml`` (unmodified, for fewer steps) — finite losses, evaluation lines,
checkpoints where the config asks for them — then ``hal export`` and the README's transformers command."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
from pathlib import Path

import pytest
import yaml

from ..conftest import REPO, run_hal
from ..plain_client import run_plain, shared

pytest.importorskip("tokenizers")

EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"
STEPS = 50  # two evaluations (eval_every 25) and, with checkpoint_every 100, one checkpoint: the last step's


def _prepare_command() -> list[str]:
    """The example's own ``hal data prepare`` line, from its header comment (so the two cannot drift apart)."""
    lines = [line.strip("# \n") for line in EXAMPLE.read_text(encoding="utf-8").splitlines()]
    found = [line.split()[1:] for line in lines if line.startswith("hal data prepare ")]
    assert len(found) == 1, "examples/tiny_cpu.yaml: its header shows one 'hal data prepare' command"
    return found[0]


RUN_DIR = "runs/tiny"  # where the README's train command puts the run


def _readme_flow() -> list[str]:
    """The README's new-user block: prepare, train, export, load in transformers (one command each)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start = readme.index(f"\nhal {' '.join(_prepare_command())}\n") + 1
    block = readme[start:readme.index("```", start)].strip().splitlines()
    assert len(block) == 4, block
    return block


def test_the_readme_shows_the_examples_commands() -> None:
    prepare, train, export, load = _readme_flow()
    assert train == f"hal train examples/tiny_cpu.yaml --run-dir {RUN_DIR}"
    assert export.startswith(f"hal export {RUN_DIR}/checkpoints --to hf ") and load.startswith("python3 -c ")


def test_prepare_then_train_the_tiny_example(tmp_path: Path) -> None:
    # the data lands where the example reads it, relative to the current directory: here a scratch one
    (tmp_path / "examples" / "data").mkdir(parents=True)
    for name in ("tokenizer.json", "corpus.txt", "ledger.txt"):
        (tmp_path / "examples" / "data" / name).symlink_to(REPO / "examples" / "data" / name)
    prepared = run_hal(*_prepare_command(), cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    config = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    data = tmp_path / config["train"]["data"]
    index = json.loads(data.with_name(data.name.replace(".bin", ".idx.json")).read_text(encoding="utf-8"))
    assert index["vocab_size"] == config["model"]["vocab_size"]

    run_dir = tmp_path / RUN_DIR
    result = run_hal("train", str(EXAMPLE), "--steps", str(STEPS), "--run-dir", str(run_dir), "--json", cwd=tmp_path,
                     timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert records[0]["loss"] == pytest.approx(math.log(config["model"]["vocab_size"]), rel=0.1)  # untrained
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    evaluated = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [25, 50]
    assert all(math.isfinite(r["eval_loss"]) and r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in evaluated)
    assert evaluated[1]["eval_loss"] < evaluated[0]["eval_loss"]
    summary = json.loads(result.stdout)  # the evaluations reach the summary too (they were in the log only)
    assert summary["evals"] == [{"step": r["step"], "loss": r["eval_loss"]} for r in evaluated]
    assert summary["diverged"] is None
    # warm-up over the first 20 steps, then cosine decay
    lrs = [r["lr"] for r in records]
    assert lrs[19] == pytest.approx(config["train"]["lr"]) and lrs[0] < lrs[19] and lrs[-1] < lrs[20]
    # checkpoint_every 100 beside eval_every 25: the end of the run only
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", f"step-{STEPS:06d}"]
    assert json.loads(result.stdout)["checkpoint"] == str(run_dir / "checkpoints" / f"step-{STEPS:06d}")

    # the README's last two commands, as written: export, then transformers continues a sentence from the export
    _, _, export, load = _readme_flow()
    exported = run_hal(*shlex.split(export)[1:], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the test extra has it): the export was written, not loaded")
    loaded = run_plain(shared(), shlex.split(load)[1:], dict(os.environ), tmp_path, 300)  # python ARGS, torch preloaded
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    continued = loaded.stdout.strip()
    assert continued.startswith("The ledger") and len(continued) > len("The ledger") + 10, continued
