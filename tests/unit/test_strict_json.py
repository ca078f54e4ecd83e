"""Logs and --json output stay JSON when a number is not finite (a diverged loss): null, never NaN."""
from __future__ import annotations

import json
import math

import pytest

from hal import strict_json


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_at_any_depth() -> None:
    value = {"loss": math.nan, "stages": [{"t": math.inf}, (1.5, -math.inf)], "n": 3, "ok": True, "name": "nan"}
    assert _strict(strict_json.dumps(value)) == {"loss": None, "stages": [{"t": None}, [1.5, None]], "n": 3,
                                                  "ok": True, "name": "nan"}
    with pytest.raises(ValueError):  # what json.dumps alone writes is not JSON
        _strict(json.dumps(value))


def test_indent_and_other_options_pass_through() -> None:
    assert strict_json.dumps({"a": 1.0}, indent=2) == '{\n  "a": 1.0\n}'
