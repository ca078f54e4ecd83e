"""The version policy in pyproject.toml: every dependency has a lower bound (a release the tests passed on, which
``.ci/lowest`` installs exactly) and none has an upper pin, so CI takes the newest releases and a break shows."""
from __future__ import annotations

import re

import pytest

from ..conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
LOWER_BOUND_ONLY = re.compile(r"[A-Za-z0-9_.-]+>=[0-9][0-9.]*")


def policy_breaks(pyproject: str) -> list[str]:
    project = tomllib.loads(pyproject)["project"]
    groups = {"dependencies": project["dependencies"], **project.get("optional-dependencies", {})}
    return [f"{group}: {requirement!r} (write NAME>=TESTED_VERSION, no upper pin)"
            for group, requirements in groups.items() for requirement in requirements
            if not LOWER_BOUND_ONLY.fullmatch(requirement)]


def test_every_dependency_has_a_lower_bound_and_no_upper_pin() -> None:
    assert policy_breaks((REPO / "pyproject.toml").read_text(encoding="utf-8")) == []


def test_the_check_catches_a_missing_bound_and_an_upper_pin() -> None:
    planted = '[project]\ndependencies = ["numpy>=2.0", "pyyaml"]\n[project.optional-dependencies]\nhf = ["transformers<5.25"]\n'
    assert policy_breaks(planted) == [
        "dependencies: 'pyyaml' (write NAME>=TESTED_VERSION, no upper pin)",
        "hf: 'transformers<5.25' (write NAME>=TESTED_VERSION, no upper pin)",
    ]
