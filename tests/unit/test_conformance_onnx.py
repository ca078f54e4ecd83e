"""The onnx conformance suite on the CPU: ONNX node tests' golden data through the HAL ops.

onnx is an optional extra of the package but CI installs it (``.ci/run``: ``.[test,report,onnx]``), so
these tests do not skip without it: a missing onnx fails them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hal.backend_registry import get_backend
from hal.conformance.cases import Context
from hal.conformance.runner import CaseResult, execute, plan_from_cases
from hal.conformance.suites import onnx as onnx_suite
from hal.conformance.suites import onnx_cases
from hal.ops import registry


@pytest.fixture(scope="module")
def ctx() -> Context:
    backend = get_backend("cpu")
    return Context(backend=backend, device=backend.device(0), capabilities=backend.capabilities())


def run_suite(ctx: Context) -> tuple[dict[str, CaseResult], dict[str, int]]:
    result = execute(ctx, plan_from_cases(onnx_suite.cases(ctx)), progress=False)
    return {r.name: r for r in result.results}, result.counts()["by_suite"]["onnx"]


@pytest.fixture(scope="module")
def baseline(ctx: Context) -> tuple[dict[str, CaseResult], dict[str, int]]:
    return run_suite(ctx)


def test_suite_reports_counts_and_every_mapped_case_passes(baseline: tuple[dict[str, CaseResult], dict[str, int]]) -> None:
    results, counts = baseline
    assert counts["total"] == len(results) == counts["pass"] + counts["unsupported"]
    assert counts["fail"] == counts["error"] == 0
    assert counts["pass"] >= 100 and counts["unsupported"] > 0
    passed_ops = {n.split("/")[0] for n, r in results.items() if r.status == "pass"}
    assert passed_ops == set(onnx_suite.MAPPERS)  # every mapped ONNX op has golden cases that pass
    for name, r in results.items():
        if r.status == "unsupported":
            assert r.outcome.reason, name  # always says why
        else:
            assert "tol_ratio" in r.outcome.metrics and r.outcome.data["hal_op"], name


def test_unmappable_variants_are_unsupported_with_the_reason(baseline: tuple[dict[str, CaseResult], dict[str, int]]) -> None:
    results, _ = baseline
    assert "alpha=0.5" in results["Gemm/test_gemm_alpha"].outcome.reason
    assert "axis 0" in results["Gather/test_gather_1"].outcome.reason
    assert "weight" in results["SoftmaxCrossEntropyLoss/test_sce_mean_weight"].outcome.reason
    assert "interleaved" in results["RotaryEmbedding/test_rotary_embedding_interleaved"].outcome.reason
    for name in ("Gemm/test_gemm_transposeA", "LayerNormalization/test_layer_normalization_4d_axis1",
                 "RMSNormalization/test_rms_normalization_3d_axis1_epsilon", "Attention/test_attention_4d_gqa_causal",
                 "Attention/test_attention_3d_attn_mask", "RotaryEmbedding/test_rotary_embedding_3d_input",
                 "SoftmaxCrossEntropyLoss/test_sce_mean_no_weight_ii_4d", "Attention/test_attention_4d_causal_bf16"):
        assert results[name].status == "pass", (name, results[name].outcome.reason)


def test_a_wrong_softmax_fails_the_onnx_softmax_cases(ctx: Context) -> None:
    name = "test_onnx_softmax_plus_1e-2"
    registry.register("softmax", name, backends=["cpu"], priority=1000)(lambda x, dim=-1: torch.softmax(x, dim) + 1e-2)
    try:
        results, _ = run_suite(ctx)
    finally:
        registry.unregister("softmax", name)
    softmax = {n: r for n, r in results.items() if n.startswith("Softmax/")}
    assert softmax and all(r.status == "fail" and r.outcome.failed_metric == "tol_ratio" for r in softmax.values())
    assert all(r.status in ("pass", "unsupported") for n, r in results.items() if not n.startswith("Softmax/"))


def test_stored_pb_data_is_read_like_the_generated_tests(tmp_path: Path, ctx: Context) -> None:
    """The onnx layout <test>/model.onnx + test_data_set_0/{input,output}_N.pb, written and read back."""
    import onnx
    import onnx.backend.test.case.node as node_cases
    from onnx import numpy_helper

    generated = {t.name: t for t in onnx_cases.generate("Gemm")}
    source = next(c for c in node_cases._NodeTestCases if c.name == "test_gemm_transposeB")
    test_dir = tmp_path / source.name
    (test_dir / "test_data_set_0").mkdir(parents=True)
    onnx.save(source.model, str(test_dir / "model.onnx"))
    inputs, outputs = source.data_sets[0]
    for kind, arrays in (("input", inputs), ("output", outputs)):
        for i, array in enumerate(arrays):
            (test_dir / "test_data_set_0" / f"{kind}_{i}.pb").write_bytes(numpy_helper.from_array(array).SerializeToString())

    (stored,) = onnx_cases.load_stored(tmp_path)
    expected = generated["test_gemm_transposeB"]
    assert (stored.source, stored.op_type, stored.attrs) == ("stored", "Gemm", expected.attrs)
    assert all((a == b).all() for a, b in zip(stored.inputs, expected.inputs))
    assert (stored.outputs[0] == expected.outputs[0]).all()
    outcome = onnx_suite._run(ctx, test=stored)
    assert outcome.status == "pass", outcome.reason


def test_without_onnx_every_case_is_unsupported_with_the_install_hint(ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)  # what `import onnx` meets when the extra is not installed
    cases = onnx_suite.cases(ctx)
    assert len(cases) == len(onnx_suite.MAPPERS)
    for case in cases:
        outcome = case.run(ctx)
        assert outcome.status == "unsupported" and "pip install hetero-hal[onnx]" in outcome.reason
