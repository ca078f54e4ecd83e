"""JSON that every JSON parser reads: a non-finite float (a diverged loss, a division by a zero time) becomes null.

Python's ``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which are not JSON: ``jq``, JavaScript and
most log tools refuse the whole line. A run that diverged still has to leave a log a machine can read.
"""
from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (nested in dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``finite(value)``; refuses (ValueError) rather than writes a non-JSON number."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
