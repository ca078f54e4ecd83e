"""`hal ops` on a backend says which kernels exist only for other backends (why they are not used here)."""
from __future__ import annotations

from hal.cli.ops import ops_report


def test_cpu_report_names_the_triton_kernels_and_where_they_run() -> None:
    report = ops_report("cpu")
    others = {entry["impl"]: entry for entry in report["other_backends"]}
    assert others["triton"]["backends"] == ["cuda"]
    assert {"rms_norm", "swiglu", "rotary_embedding", "linear_cross_entropy"} <= set(others["triton"]["ops"])
    assert all(cell["impl"] == "reference" for row in report["ops"].values() for cell in row.values())


def test_cuda_report_lists_no_triton_as_foreign() -> None:
    report = ops_report("cuda")
    assert "triton" not in {entry["impl"] for entry in report["other_backends"]}
    assert report["ops"]["rms_norm"]["bfloat16"]["impl"] in ("triton", "reference")  # reference where no GPU, with the reason
