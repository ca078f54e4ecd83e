"""The MoE equivalence plans on NCCL (``pytest -m cuda``, 2-4 NVIDIA GPUs): expert parallelism's grouped
all-to-alls, experts split over tp, MoE under sequence parallelism, each against the single process on the cpu.

fp32 with TF32 off on both sides; a GPU's matmuls add in another order than the cpu's, so the bounds are
looser than the cpu's own 1e-5: the first loss within 1e-5, 20 steps within 1e-4, gradients within 1e-4
(relative) + 1e-6."""
from __future__ import annotations

import pytest

from ..conftest import has_cuda
from ..ranks.test_moe_pipeline import CASES, _matches_single_process


def _gpus() -> int:
    from hal import get_backend

    return get_backend("cuda").device_count() if has_cuda() else 0


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_gpus() < 4, reason="needs 4 NVIDIA GPUs")]

ON_NCCL = ["one stage dp4 ep4, dense layer then moe",
           "moe tp2 -> moe tp2 (experts split over tp), shared gated expert",
           "one stage tp2 x dp2 ep2: experts split over tp and shared over ep",
           "moe tp2+sp -> moe dp2 ep2: the sequence gathered into the experts, shared gated expert"]


@pytest.mark.parametrize("name", ON_NCCL)
def test_moe_plan_on_nccl_matches_single_process(name: str) -> None:
    _matches_single_process(name, *CASES[name], backend="cuda", grad_rtol=1e-4, grad_atol=1e-6)
