"""Every shipped example meant for GPUs trains a few steps on them (``pytest -m cuda``, as many NVIDIA GPUs as the
example's plan asks; skipped with fewer). A guard against a first step that never ends: the Llama-3.2-1B example
once spent 187 s in its first compiled step (4 × H200), which looked like a hang. The bound is a hang guard with
room for a slow compile, not a speed figure (those live in ``benchmarks/``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hal import get_backend
from hal.parallel.config.run import load_run_config

from ..conftest import REPO, has_cuda, run_hal

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

FIRST_STEP_BOUND_S = 150.0
"""The most the first step (compiles included) may take; a run that has not ended in 3 of these has hung."""


def _gpu_examples() -> list[Path]:
    """The examples whose every stage is cuda, but the planner's what-ifs (``whatif_*.yaml``: nothing there runs)."""
    found = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        if path.name.startswith("whatif_"):
            continue
        run = load_run_config(path, check_backends=False)
        if all(stage.backend == "cuda" for _, plan in run.plans() for stage in plan.stages):
            found.append(path)
    return found


GPU_EXAMPLES = _gpu_examples()


def test_the_gpu_examples_are_found() -> None:
    assert {p.name for p in GPU_EXAMPLES} >= {"llama_1b_4gpu.yaml", "llama32_1b_4gpu.yaml"}


@pytest.mark.parametrize("example", GPU_EXAMPLES, ids=[p.stem for p in GPU_EXAMPLES])
def test_each_gpu_example_trains_with_a_bounded_first_step(example: Path, tmp_path: Path) -> None:
    run = load_run_config(example, check_backends=False)
    needed = max(plan.world_size for _, plan in run.plans()) if run.replicas is None else run.replicas.world_size
    if not has_cuda() or get_backend("cuda").device_count() < needed:
        pytest.skip(f"needs {needed} NVIDIA GPUs")
    result = run_hal("train", str(example), "--steps", "3", "--run-dir", str(tmp_path / "run"),
                     timeout=3 * FIRST_STEP_BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["step_s"] <= FIRST_STEP_BOUND_S, f"first step {records[0]['step_s']:.0f} s"
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN
    # once a run, not once a rank: no line of the run's stderr repeats (the Dynamo lru_cache warning did, per rank)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "step " not in line]
    repeated = {line for line in lines if lines.count(line) > 1}
    assert not repeated, sorted(repeated)[:5]
