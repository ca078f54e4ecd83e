"""The engine on GPUs: a CUDA plan and a CUDA + CPU plan match the single-process run (``pytest -m cuda``)."""
from __future__ import annotations

import pytest
import torch

from ..conftest import has_cuda
from ..dist_harness import run_world
from ..engine_cases import reference


def _gpus() -> int:
    from hal import get_backend

    return get_backend("cuda").device_count() if has_cuda() else 0


pytestmark = pytest.mark.cuda

STEPS, LR = 20, 3e-3


def _plan(first: str, second: str) -> dict:
    return {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 2,
            "stages": [{"backend": first, "devices": 2, "layers": 3, "tp": 2},
                       {"backend": second, "devices": 2, "layers": 1, "dp": 2}]}


def _check(plan: dict, backends: list[str], rtol: float, num_layers: int = 4) -> list[dict]:
    ref = reference(plan, STEPS, LR, num_layers=num_layers)
    results = run_world("tests.engine_cases", "engine_run", len(backends), deadline_s=400, backend=backends, plan_raw=plan,
                        steps=STEPS, lr=LR, num_layers=num_layers)
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    values = [o[1] for o in results.values()]
    last = len(plan["stages"]) - 1
    assert any(v["coord"][0] == last for v in values)
    for run in (v["losses"] for v in values if v["coord"][0] == last):
        for got, want in zip(run, ref["losses"]):
            assert abs(got - want) <= rtol * abs(want), (run, ref["losses"])
    for v in values:
        for name, grad in v["grads"].items():
            torch.testing.assert_close(torch.tensor(grad), ref["grads"][name], rtol=rtol, atol=1e-6, msg=name)
    return values


@pytest.mark.skipif(_gpus() < 1, reason="needs an NVIDIA GPU")
def test_dualpipev_pairs_at_once_on_a_cuda_stage_beside_a_cpu_stage_match() -> None:
    """DualPipeV's pairs at once: on the cuda stage the forward's thread enqueues on the rank's stream (the V's first
    stage holds the embedding, the head and the loss); the cpu stage runs its pairs at once too."""
    plan = {"schedule": "dualpipev", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
            "stages": [{"backend": "cuda", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 2}]}
    ref = reference(plan, STEPS, LR)
    results = run_world("tests.engine_cases", "engine_run", 2, deadline_s=400, backend=["cuda", "cpu"], plan_raw=plan,
                        steps=STEPS, lr=LR, pair_overlap="1")
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    values = [o[1] for o in results.values()]
    for run in (v["losses"] for v in values if v["coord"][0] == 0):  # the V: the loss on the first stage
        for got, want in zip(run, ref["losses"]):
            assert abs(got - want) <= 1e-4 * abs(want), (run, ref["losses"])
    for v in values:
        assert v["pairs"][0] == "at once" and v["pairs"][1] >= STEPS, v["pairs"]
        for name, grad in v["grads"].items():
            torch.testing.assert_close(torch.tensor(grad), ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(_gpus() < 4, reason="needs 4 NVIDIA GPUs")
def test_tp2_on_gpus_0_1_then_dp2_on_gpus_2_3_matches() -> None:
    _check(_plan("cuda", "cuda"), ["cuda"] * 4, rtol=1e-4)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 NVIDIA GPUs")
def test_cuda_stage_then_cpu_stage_matches() -> None:
    _check(_plan("cuda", "cpu"), ["cuda", "cuda", "cpu", "cpu"], rtol=1e-4)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 NVIDIA GPUs")
def test_interleaved_cuda_tp2_stage_and_cpu_dp2_stage_match() -> None:
    """Two chunks per stage: every micro-batch crosses the CUDA -> CPU bridge and comes back over the wrap link."""
    plan = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
            "stages": [{"backend": "cuda", "devices": 2, "layers": [2, 1], "tp": 2},
                       {"backend": "cpu", "devices": 2, "layers": [1, 2], "dp": 2}]}
    _check(plan, ["cuda", "cuda", "cpu", "cpu"], rtol=1e-4, num_layers=6)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 NVIDIA GPUs")
def test_interleaved_zero_bubble_on_two_gpus_matches() -> None:
    """NCCL between two GPU stages, both links (forward and wrap) on one communicator, batches posted unwaited."""
    plan = {"schedule": "interleaved-zero-bubble", "virtual_stages": 2, "micro_batches": 4, "micro_batch_size": 2,
            "stages": [{"backend": "cuda", "devices": 1, "layers": 2}, {"backend": "cuda", "devices": 1, "layers": 2}]}
    _check(plan, ["cuda", "cuda"], rtol=1e-4)
