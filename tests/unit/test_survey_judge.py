"""The operator survey's judgement, grades, host-fallback watch and cohort, on values built to sit on each side of
each line (no device: the pieces the CLI tests run end to end)."""
from __future__ import annotations

import warnings

import pytest
import torch

from hal.conformance.survey import cohort as C
from hal.conformance.survey.judge import GOLDEN, judge_outputs
from hal.conformance.survey.pair import Settings, pytorch_skips
from hal.conformance.survey.tables import grade
from hal.conformance.verdicts.host_watch import watcher


def _golden(x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [("out", x.to(torch.float64))]


def test_one_rounding_passes_and_a_relative_error_of_1e_4_fails_in_float32() -> None:
    exact = torch.linspace(-3, 3, 101, dtype=torch.float64)
    rounded = exact.to(torch.float32)
    miss, by, ratio = judge_outputs([("out", rounded)], [("out", exact)], [("out", rounded)])
    assert miss is None and by == "golden" and ratio <= 1.0
    wrong = rounded.clone()
    wrong[17] *= 1 + 1e-4
    miss, by, _ = judge_outputs([("out", wrong)], [("out", exact)], [("out", rounded)])
    assert miss is not None and miss.index == 17 and "outside the tolerance" in miss.why, miss


def test_a_result_off_the_golden_value_but_equal_to_the_cpu_kernel_in_its_dtype_passes_said_so() -> None:
    # floor(a / b) in float32 at a rounding boundary: exact arithmetic gives 4, the dtype's division rounds up to 5
    a, b = torch.tensor([1.0], dtype=torch.float32), torch.tensor([0.2], dtype=torch.float32)
    same = torch.floor(a / b)
    golden = torch.floor(a.double() / b.double())
    assert same.item() != golden.item()
    miss, by, ratio = judge_outputs([("out", same.clone())], [("out", golden)], [("out", same)])
    assert miss is None and by == "cpu" and ratio > 1.0
    miss, _, _ = judge_outputs([("out", same + 1)], [("out", golden)], [("out", same)])
    assert miss is not None


def test_non_finite_values_must_sit_where_the_references_have_them_and_integers_must_be_equal() -> None:
    ref = torch.tensor([1.0, float("nan"), float("inf")])
    got = torch.tensor([1.0, 0.0, float("inf")])
    miss, _, _ = judge_outputs([("out", got)], _golden(ref), [("out", ref)])
    assert miss is not None and miss.why == "non-finite mismatch" and miss.index == 1
    miss, _, _ = judge_outputs([("out", torch.tensor([1, 2, 4]))], None, [("out", torch.tensor([1, 2, 3]))])
    assert miss is not None and miss.why == "must be equal" and miss.index == 2
    miss, _, _ = judge_outputs([("out", torch.ones(2, dtype=torch.float16))], None, [("out", torch.ones(2))])
    assert miss is not None and miss.why == "result dtype differs"


def test_a_sum_that_cancels_is_held_to_the_rounding_of_its_terms() -> None:
    # 1e4 - (1e4 - 1e-3) in float32: the golden atol scales with the output's largest magnitude
    golden = torch.tensor([1e4, 1e-3], dtype=torch.float64)
    got = golden.to(torch.float32)
    got[1] = 9.765625e-04  # one float32 rounding of 1e4 away from the exact difference
    miss, _, _ = judge_outputs([("out", got)], [("out", golden)], [("out", got.clone() * 0 + 5)])
    assert miss is None
    assert GOLDEN[torch.float32] == (1.3e-6, 1e-5)


@pytest.mark.parametrize(("statuses", "expected"), [
    ({"float32": "pass", "bfloat16": "pass", "int64": "untested"}, "STRICT"),
    ({"float32": "pass", "bfloat16": "failed"}, "BASIC"),
    ({"float32": "raised", "bfloat16": "pass"}, "RAISED"),
    ({"float32": "fallback", "bfloat16": "failed"}, "FAILED"),
    ({"float32": "untested"}, "UNTESTED"),
])
def test_an_ops_grade(statuses: dict[str, str], expected: str) -> None:
    assert grade(statuses) == expected


def test_the_watch_hears_the_runtimes_fallback_warning_and_sees_inputs_copied_to_the_host() -> None:
    copied = [0]
    watch = watcher(lambda: copied[0])
    with watch(400) as use:
        warnings.warn("CAUTION: The operator 'aten::bitwise_left_shift.Tensor_out' is not currently supported on the "
                      "NPU backend and will fall back to run on the CPU. This may have performance implications.", stacklevel=2)
    assert use.fell_back and "aten::bitwise_left_shift.Tensor_out" in use.why()
    with watch(400) as use:
        copied[0] += 8  # a count read back to size an output (nonzero): far below the inputs
    assert not use.fell_back
    with watch(400) as use:
        copied[0] += 400
    assert use.fell_back and "400 bytes" in use.why()
    with watcher(lambda: None)(400) as use:  # a runtime without a counter: only its warning tells
        pass
    assert not use.fell_back


def test_pytorch_own_word_on_comparing_with_the_cpu_is_honoured() -> None:
    ops = {C.op_name(op): op for op in C.load_op_db()}
    assert "non-deterministic" in (pytorch_skips(ops["empty_like"], "npu", torch.float32) or "")
    assert "expected failure" in (pytorch_skips(ops["linalg.lu"], "npu", torch.float32) or "")
    assert pytorch_skips(ops["sin"], "npu", torch.float32) is None


def test_the_cohort_digest_pins_ops_dtypes_and_sample_settings() -> None:
    db = C.load_op_db()
    a = C.build(db, ["float32", "int64"], Settings(), {}, ["sin", "mul"])
    assert a.digest == C.build(db, ["float32", "int64"], Settings(), {}, ["sin", "mul"]).digest
    assert a.digest != C.build(db, ["float32", "int64"], Settings(max_samples=5), {}, ["sin", "mul"]).digest
    assert a.digest != C.build(db, ["float32"], Settings(), {}, ["sin", "mul"]).digest
    assert {p.dtype for p in a.pairs if p.name == "sin"} == {"float32", "int64"}
