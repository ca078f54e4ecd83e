"""Conformance: prove a backend's numbers agree with an fp64 CPU reference, and report it.

Cases are data (``cases.Case``), grouped in suites (``hal/conformance/suites``); ``runner`` runs them
with progress; ``report`` writes JSON, Markdown and one self-contained HTML page; ``compare`` puts two
runs side by side.
"""
from hal.conformance.suite_names import SUITES

__all__ = ["Case", "Context", "Outcome", "SUITES"]


def __getattr__(name: str) -> object:
    """The case model loads torch: import it on first use, so ``hal conformance --help`` stays instant."""
    if name in ("Case", "Context", "Outcome"):
        from . import cases

        return getattr(cases, name)
    raise AttributeError(f"module 'hal.conformance' has no attribute {name!r}")
