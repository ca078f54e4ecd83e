"""Replicas on GPUs (``pytest -m cuda``): a GPU replica (two GPUs in dp, or one) whose exchange runs during its
backward (a dp2 stage's reduce launched from the gradient hooks over NCCL, the bridge on a worker thread) beside a cpu
replica, each its own island, computes the single-device training."""
from __future__ import annotations

import pytest
import torch

from ..conftest import has_cuda
from ..dist_harness import run_world
from ..engine_cases import reference

pytestmark = pytest.mark.cuda

STEPS, LR = 20, 3e-3


def _gpus() -> int:
    from hal import get_backend

    return get_backend("cuda").device_count() if has_cuda() else 0


@pytest.mark.parametrize("gpus", [2, 1], ids=["a dp2 gpu replica", "a one-gpu replica"])
@pytest.mark.parametrize("bucket_bytes", [4096, None], ids=["many buckets", "shipped buckets"])
def test_a_gpu_replica_exchanging_during_its_backward_beside_a_cpu_replica_matches(gpus: int, bucket_bytes: int | None) -> None:
    """dp2: the reduce over NCCL orders the worker after the hook's pack; one GPU: no reduce, an event does."""
    if _gpus() < gpus:
        pytest.skip(f"needs {gpus} NVIDIA GPU{'s' if gpus > 1 else ''}")
    stage = {"backend": "cuda", "devices": gpus, "layers": 4, **({"dp": 2} if gpus == 2 else {})}
    raw = {"replicas": [{"rows": 6, "micro_batch_size": 2, "stages": [stage]},
                        {"rows": 2, "micro_batch_size": 1, "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}]}
    ref = reference({"schedule": "gpipe", "micro_batches": 1, "micro_batch_size": 8,
                     "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}, STEPS, LR)
    results = run_world("tests.replica_cases", "replica_run", gpus + 1, deadline_s=300,
                        backend=["cuda"] * gpus + ["cpu"], islands=[0] * gpus + [1], raw=raw, steps=STEPS, lr=LR,
                        bucket_bytes=bucket_bytes)
    for rank, outcome in results.items():
        assert outcome[0] == "ok", f"rank {rank}: {outcome[1]}\n{outcome[2] if len(outcome) > 2 else ''}"
    values = [outcome[1] for outcome in results.values()]
    for v in values:
        assert isinstance(v["overlapped"], int) and v["overlapped"] >= STEPS, v["overlapped"]  # buckets begun early
        for got, want in zip(v["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-4 * abs(want), (v["losses"], ref["losses"])
        for name, grad in v["grads"].items():
            torch.testing.assert_close(torch.tensor(grad), ref["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
