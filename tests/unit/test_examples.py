"""Every shipped example config passes the checks ``hal train`` makes before it starts anything (in-process:
backends this machine lacks are left out, as for ``--print-multinode``), and the Llama-3.2-1B config is
that model's shape."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hal.parallel.config.model import ModelConfig
from hal.parallel.config.run import load_run_config
from hal.parallel.data.token_file import is_token_file
from hal.parallel.loop.preflight import check_training

from ..conftest import REPO
from .test_hf_config import LLAMA_32_1B

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_the_examples_are_found() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"hetero_cpu.yaml", "tiny_cpu.yaml", "llama32_1b_4gpu.yaml", "llama_1b_4gpu.yaml"} <= names, names


def _prepare_like_the_header(example: Path, cwd: Path) -> None:
    """Run the ``hal data prepare`` line an example's header shows (in-process), in ``cwd``."""
    from hal.parallel.data.prepare import prepare_tokens

    lines = [line.strip("# \n") for line in example.read_text(encoding="utf-8").splitlines()]
    args = next(shlex.split(line)[3:] for line in lines if line.startswith("hal data prepare "))
    tokenizer, out = args[args.index("--tokenizer") + 1], args[args.index("--out") + 1]
    files = [a for i, a in enumerate(args) if not a.startswith("--") and args[i - 1] not in ("--tokenizer", "--out")]
    (cwd / out).parent.mkdir(parents=True, exist_ok=True)
    prepare_tokens([REPO / f for f in files], REPO / tokenizer, cwd / out)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_each_example_passes_the_checks_before_training(example: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = load_run_config(example, check_backends=False)
    assert all(sum(stage.layers for stage in plan.stages) == run.model.num_layers for _, plan in run.plans())
    if is_token_file(run.train.data):  # made by the command in the example's header, read from the current directory
        pytest.importorskip("tokenizers")
        monkeypatch.chdir(tmp_path)
        _prepare_like_the_header(example, tmp_path)
    check_training(run, "allow")


def test_llama32_1b_is_that_models_shape(tmp_path: Path) -> None:
    run = load_run_config(REPO / "examples" / "llama32_1b_4gpu.yaml", check_backends=False)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B), encoding="utf-8")
    published = ModelConfig.from_mapping({"hf": str(tmp_path), "max_seq_len": run.model.max_seq_len})
    assert run.model == published
    plan = run.plan
    assert [s.backend for s in plan.stages] == ["cuda"] * 4 and [s.devices for s in plan.stages] == [1] * 4
    layers = [s.layers for s in plan.stages]
    assert layers[-1] < min(layers[:-1])  # the last stage also runs the 128k-vocabulary head
    assert plan.fused_head and plan.compile and run.hal.precision == "bf16-mixed"
    train = run.train
    assert train.warmup_steps > 0 and train.lr_schedule == "cosine" and train.grad_clip is not None
