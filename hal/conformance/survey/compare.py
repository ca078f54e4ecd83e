"""Two surveys side by side: per (op, dtype), what changed from A to B, and both rates."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import tables

_RANK = {"pass": 0, "untested": 1, "raised": 2, "fallback": 3, "failed": 4}


@dataclass
class SurveyComparison:
    a: dict[str, Any]
    b: dict[str, Any]
    same_cohort: bool
    worse: list[tuple[str, str, str, str, str]] = field(default_factory=list)  # op, dtype, A, B, B's detail
    better: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    only_a: int = 0
    only_b: int = 0
    common: int = 0

    @property
    def exit_code(self) -> int:
        return 1 if self.worse else 0

    def to_dict(self) -> dict[str, Any]:
        row = lambda t: dict(zip(("op", "dtype", "a", "b", "detail"), t))  # noqa: E731
        return {"kind": "survey-comparison", "same_cohort": self.same_cohort,
                "a": {"backend": self.a["backend"], "cohort": self.a["cohort"]["digest"], "rates": self.a["rates"]},
                "b": {"backend": self.b["backend"], "cohort": self.b["cohort"]["digest"], "rates": self.b["rates"]},
                "common": self.common, "only_a": self.only_a, "only_b": self.only_b,
                "worse": [row(t) for t in self.worse], "better": [row(t) for t in self.better]}


def compare(a: dict[str, Any], b: dict[str, Any]) -> SurveyComparison:
    """B against A on the (op, dtype) pairs both surveyed: worse where B's outcome ranks below A's (pass, untested,
    raised, fallback, failed), better where above."""
    fa = {(f["op"], f["dtype"]): f for f in a["findings"]}
    fb = {(f["op"], f["dtype"]): f for f in b["findings"]}
    cmp = SurveyComparison(a, b, a["cohort"]["digest"] == b["cohort"]["digest"])
    common = sorted(fa.keys() & fb.keys())
    cmp.common, cmp.only_a, cmp.only_b = len(common), len(fa.keys() - fb.keys()), len(fb.keys() - fa.keys())
    for key in common:
        sa, sb = fa[key]["status"], fb[key]["status"]
        if _RANK[sb] > _RANK[sa]:
            cmp.worse.append((*key, sa, sb, fb[key].get("detail", "")))
        elif _RANK[sb] < _RANK[sa]:
            cmp.better.append((*key, sa, sb, fa[key].get("detail", "")))
    return cmp


def format_text(cmp: SurveyComparison, limit: int = 40) -> str:
    ra, rb = cmp.a["rates"], cmp.b["rates"]
    lines = [f"A: {cmp.a['backend']} · strict {100 * ra['strict_rate']:.1f} % · basic {100 * ra['basic_rate']:.1f} % "
             f"(cohort {cmp.a['cohort']['digest']})",
             f"B: {cmp.b['backend']} · strict {100 * rb['strict_rate']:.1f} % · basic {100 * rb['basic_rate']:.1f} % "
             f"(cohort {cmp.b['cohort']['digest']})"]
    if not cmp.same_cohort:
        lines.append(f"the cohorts differ (torch, op list, dtypes or sample settings): compared on the {cmp.common} pairs "
                     f"both surveyed; {cmp.only_a} only in A, {cmp.only_b} only in B")
    lines.append(f"{cmp.common} common pairs: {len(cmp.worse)} worse in B, {len(cmp.better)} better")
    for title, rows in (("worse in B", cmp.worse), ("better in B", cmp.better)):
        if rows:
            lines.append(f"{title}:")
            lines += [f"  {op} {dt}: {sa} -> {sb}  {detail}"[:240] for op, dt, sa, sb, detail in rows[:limit]]
            if len(rows) > limit:
                lines.append(f"  ... {len(rows) - limit} more (--json)")
    return "\n".join(lines) + "\n"


def is_survey(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == tables.KIND
