"""Two runs side by side: is device B's error, case by case, within ``factor`` times device A's?

For each case id in both runs, the compared metric is the first error metric both report, in the
order tol_ratio, rel_l2, max_rel, max_abs, ulp (``report.ERROR_METRICS``); failing that, the first
metric both runs bound with a positive tolerance of the same name, as ``metric / bound`` (e.g. a
training case's ``mean_rel_dev``), which reads like a tol_ratio. B is **worse** on a case when

    error_B > factor × max(error_A, floor[metric])

The floor keeps "A exact, B off by a rounding" from failing: errors below it count as equal to it —
tol_ratio and metric / bound 0.01 (1 % of the bound), rel_l2 / max_rel / max_abs 1e-6, ulp 1 (``FLOORS``;
``--floor`` overrides all). B is also worse when A passed and B failed or errored (whatever the numbers), and
when B's error is NaN where A's is not. A case B skipped or marked unsupported is not compared;
cases in only one run are listed. Exit 1 when any case is worse, 0 otherwise, 2 for a bad file.

Beside that verdict every common case that both runs measured gets a cross-device **level** (``levels``: L2, L1,
L0 or fail, from the ratios of B's mean-relative, max-relative and RMS error to A's), folded into a matrix per op
and dtype.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hal.conformance.reports import levels
from hal.conformance.reports.report import check_report_dir
from hal.conformance.reports.results import ERROR_METRICS, as_float, fmt, json_safe, load_results
from hal.run_dirs import write_text_atomic

FLOORS: dict[str, float] = {"tol_ratio": 0.01, "rel_l2": 1e-6, "max_rel": 1e-6, "max_abs": 1e-6, "ulp": 1.0}
DEFAULT_FACTOR = 2.0
FAILING = ("fail", "error")
NOT_RUN = ("skip", "unsupported")

COMPARE_FILES: tuple[str, ...] = ("compare.json", "compare.txt", "compare.html")
# run settings that must match for two runs' cases to be the same inputs and the same selection
COMPARED_SETTINGS: tuple[str, ...] = ("seed", "suites", "patterns", "max_world_size", "hal_version", "verdict_profile")


@dataclass(frozen=True)
class Row:
    """One common case: the metric compared, both values, B/A, and the verdict (worse | ok | not compared)."""

    id: str
    status_a: str
    status_b: str
    metric: str | None
    a: float | None
    b: float | None
    verdict: str
    why: str
    level: str | None = None  # the cross-device level (``levels``): L2 / L1 / L0 / fail; None: not graded
    level_ratios: dict[str, float] | None = None
    explained: dict[str, Any] | None = None  # below L2: what differs and the likely cause (``levels.explain``)

    @property
    def ratio(self) -> float | None:
        if self.a is None or self.b is None or math.isnan(self.a) or math.isnan(self.b):
            return None
        if self.a == 0:
            return 0.0 if self.b == 0 else math.inf
        return self.b / self.a

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "status_a": self.status_a, "status_b": self.status_b, "metric": self.metric,
                "a": self.a, "b": self.b, "b_over_a": self.ratio, "verdict": self.verdict, "why": self.why,
                "level": self.level, "level_ratios": self.level_ratios, "explained": self.explained}


def _common_metric(ca: dict[str, Any], cb: dict[str, Any]) -> tuple[str, float, float] | None:
    """The first error metric both cases report; else the first metric both bound (as metric / bound)."""
    ma, mb = ca.get("metrics") or {}, cb.get("metrics") or {}
    for name in ERROR_METRICS:
        a, b = as_float(ma.get(name)), as_float(mb.get(name))
        if a is not None and b is not None:
            return name, a, b
    ta, tb = ca.get("tolerance") or {}, cb.get("tolerance") or {}
    for name in ma:
        a, b, bound_a, bound_b = as_float(ma.get(name)), as_float(mb.get(name)), as_float(ta.get(name)), as_float(tb.get(name))
        if None not in (a, b, bound_a, bound_b) and bound_a > 0 and bound_b > 0:  # type: ignore[operator]
            return f"{name}/bound", a / bound_a, b / bound_b  # type: ignore[operator]
    return None


def compare_case(ca: dict[str, Any], cb: dict[str, Any], factor: float, floors: dict[str, float]) -> Row:
    """The verdict for one case present in both runs, with its cross-device level where both measured it."""
    row = _verdict(ca, cb, factor, floors)
    if row.status_a in NOT_RUN or row.status_b in NOT_RUN:
        return row
    r = levels.ratios(ca, cb)
    level = levels.grade(r)
    explained = levels.explain(ca, cb, r, level) if r is not None and level not in (None, "L2") else None
    return replace(row, level=level, level_ratios=r, explained=explained)


def _verdict(ca: dict[str, Any], cb: dict[str, Any], factor: float, floors: dict[str, float]) -> Row:
    sa, sb = ca["status"], cb["status"]
    found = _common_metric(ca, cb)
    metric, a, b = found if found else (None, None, None)
    if sb in NOT_RUN and sa not in NOT_RUN:
        return Row(ca["id"], sa, sb, metric, a, b, "not compared", f"B: {sb}: {cb.get('reason') or ''}".strip(": "))
    if sa not in FAILING and sb in FAILING:
        return Row(ca["id"], sa, sb, metric, a, b, "worse", f"A {sa}, B {sb}: {cb.get('reason') or ''}".strip(": "))
    if found is None:
        why = "no common error metric: status only" if sa not in NOT_RUN else f"A: {sa}"
        return Row(ca["id"], sa, sb, None, None, None, "ok" if sa not in NOT_RUN else "not compared", why)
    assert a is not None and b is not None and metric is not None
    if math.isnan(b) and not math.isnan(a):
        return Row(ca["id"], sa, sb, metric, a, b, "worse", f"B's {metric} is NaN")
    floor = floors.get(metric, floors.get("tol_ratio", 0.0) if metric.endswith("/bound") else 0.0)
    limit = factor * max(a, floor) if not math.isnan(a) else math.inf
    if b > limit:
        return Row(ca["id"], sa, sb, metric, a, b, "worse", f"B {fmt(b)} > {fmt(factor)} x max(A {fmt(a)}, floor {fmt(floor)})")
    return Row(ca["id"], sa, sb, metric, a, b, "ok", "")


@dataclass
class Comparison:
    a: dict[str, Any]
    b: dict[str, Any]
    a_path: str
    b_path: str
    factor: float
    floors: dict[str, float]
    rows: list[Row]
    only_a: list[str]
    only_b: list[str]

    @property
    def setting_differences(self) -> list[str]:
        """Run settings that differ between A and B: then the cases are not of the same inputs or selection."""
        return [f"{key} {self.a.get(key)!r} vs {self.b.get(key)!r}" for key in COMPARED_SETTINGS
                if self.a.get(key) != self.b.get(key)]

    @property
    def worse(self) -> list[Row]:
        return [r for r in self.rows if r.verdict == "worse"]

    @property
    def level_counts(self) -> dict[str, int]:
        return {level: sum(r.level == level for r in self.rows) for level in ("L2", "L1", "L0", "fail")}

    @property
    def levels(self) -> dict[str, dict[str, str]]:
        """The worst level per op and dtype over the graded cases."""
        return levels.matrix([(r.id, r.level) for r in self.rows if r.level is not None])

    @property
    def reductions(self) -> list[dict[str, Any]]:
        """For each reduction probe both runs hold (``collectives::reduction_probe/...``): the models of the sum each
        library's result matched bitwise, and whether the two all-reduces can agree bitwise — only when they sum
        the same way (a shared model); a library matching no model cannot be said to."""
        cases_b = {c["id"]: c for c in self.b["cases"]}
        out = []
        for ca in self.a["cases"]:
            cb = cases_b.get(ca["id"])
            if "reduction_probe/" not in ca["id"] or cb is None:
                continue
            ma, mb = (ca.get("data") or {}).get("models"), (cb.get("data") or {}).get("models")
            if ma is None or mb is None:  # not run on one side
                continue
            shared = [m for m in ma if m in mb]
            if shared:
                agree, line = True, f"can agree bitwise: both sum as {' = '.join(shared)}"
            elif not ma or not mb:
                agree, line = None, ("cannot tell: " + " and ".join(f"{side}'s sum matches none of the models"
                                                                     for side, m in (("A", ma), ("B", mb)) if not m))
            else:
                agree, line = False, f"cannot agree bitwise: A sums as {' = '.join(ma)}, B as {' = '.join(mb)}"
            out.append({"case": ca["id"], "a_models": ma, "b_models": mb, "agree_bitwise": agree, "line": line})
        return out

    @property
    def exit_code(self) -> int:
        return 1 if self.worse else 0

    def to_dict(self) -> dict[str, Any]:
        side = lambda doc, path: {"file": path, "backend": doc.get("backend"), "device": doc.get("device"),  # noqa: E731
                                  "verification": doc.get("verification"), "torch": doc.get("torch"),
                                  "started": doc.get("started")}
        return json_safe({
            "kind": "hal-conformance-compare", "schema": 1, "a": side(self.a, self.a_path), "b": side(self.b, self.b_path),
            "factor": self.factor, "floors": self.floors, "verdict": "worse" if self.worse else "ok",
            "setting_differences": self.setting_differences,
            "counts": {v: sum(r.verdict == v for r in self.rows) for v in ("worse", "ok", "not compared")},
            "cases": [r.to_dict() for r in self.rows], "only_in_a": self.only_a, "only_in_b": self.only_b,
            "levels": {"bounds": levels.BOUNDS, "floors": levels.FLOORS, "dtype_floor_roundings": levels.DTYPE_FLOOR,
                       "counts": self.level_counts,
                       "matrix": self.levels},
            "reductions": self.reductions,
        })


def compare(a: dict[str, Any], b: dict[str, Any], *, factor: float = DEFAULT_FACTOR,
            floors: dict[str, float] | None = None, a_path: str = "A", b_path: str = "B") -> Comparison:
    """Compare two validated results documents (``report.load_results``)."""
    floors = dict(FLOORS if floors is None else floors)
    cases_a = {c["id"]: c for c in a["cases"]}
    cases_b = {c["id"]: c for c in b["cases"]}
    rows = [compare_case(ca, cases_b[i], factor, floors) for i, ca in cases_a.items() if i in cases_b]
    order = {"worse": 0, "ok": 1, "not compared": 2}
    rows.sort(key=lambda r: (order[r.verdict], -(r.ratio if r.ratio is not None and not math.isnan(r.ratio) else -1.0)))
    return Comparison(a, b, a_path, b_path, factor, floors, rows,
                      [i for i in cases_a if i not in cases_b], [i for i in cases_b if i not in cases_a])


def _side(doc: dict[str, Any]) -> str:
    device = doc.get("device") or {}
    return f"{doc.get('backend')} on {device.get('name')} ({doc.get('verification')})"


def verdict_line(cmp: Comparison) -> str:
    counts = {v: sum(r.verdict == v for r in cmp.rows) for v in ("worse", "ok", "not compared")}
    return (f"verdict: {'WORSE' if cmp.worse else 'OK'}: {counts['worse']} worse, {counts['ok']} within "
            f"{fmt(cmp.factor)}x, {counts['not compared']} not compared, of {len(cmp.rows)} common case(s); "
            f"{len(cmp.only_a)} only in A, {len(cmp.only_b)} only in B")


def format_text(cmp: Comparison, *, every_case: bool = False, listed: int = 10) -> str:
    """The verdict first, then the worse cases (every case with ``every_case``: the report file's form)."""
    floors = ", ".join(f"{k} {fmt(v)}" for k, v in cmp.floors.items())
    out = [f"A: {cmp.a_path}: {_side(cmp.a)}", f"B: {cmp.b_path}: {_side(cmp.b)}"]
    if cmp.setting_differences:
        out.append(f"warning: A and B ran with different settings ({'; '.join(cmp.setting_differences)}): "
                   "their cases are not of the same inputs or selection")
    out += [f"B is worse on a case when its error > {fmt(cmp.factor)} x max(A's error, floor) (floors: {floors}), "
            "or when A passed and B failed", verdict_line(cmp), ""]
    shown = cmp.rows if every_case else cmp.worse
    header = ["case", "metric", "A", "B", "B/A", "verdict"]
    rows = [[r.id, r.metric or "status", fmt(r.a) if r.metric else r.status_a, fmt(r.b) if r.metric else r.status_b,
             fmt(r.ratio) if r.ratio is not None else "—", r.verdict + (f" ({r.why})" if r.why else "")] for r in shown]
    if rows:
        widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(len(header) - 1)]
        for row in [header, *rows]:
            out.append("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
                       + "  " + row[-1])
    if len(shown) < len(cmp.rows):
        out.append(f"({len(cmp.rows) - len(shown)} case(s) within the factor or not compared are not listed; --all lists them)")
    grades = cmp.levels
    if grades:
        counts = ", ".join(f"{n} {level}" for level, n in cmp.level_counts.items())
        out += ["", f"cross-device levels of B against A ({counts}; the worst case per op and dtype; L2: B's mean / max "
                    "relative and RMS error within 2 / 1.2 / 1.2 x A's, L1 5 / 1.5 / 1.5, L0 10 / 2 / 2):",
                *(f"  {line}" for line in levels.matrix_text(grades))]
    below = [r for r in cmp.rows if r.explained]
    if below:
        out += ["", f"below L2, what differs ({len(below)} case(s); the worst {min(len(below), listed)} by the limiting "
                    "ratio; compare.json has every one):"]
        for r in sorted(below, key=lambda r: -(r.explained or {}).get("ratio", 0.0))[:listed]:
            e = r.explained or {}
            rounds = e.get("roundings")
            told = (f"; worst element {rounds['a']:.1f} vs {rounds['b']:.1f} roundings of {e['dtype']}" if rounds else "")
            floor = f"; A floored at {', '.join(e['a_floor'])}" if e.get("a_floor") else ""
            out.append(f"  {r.level}  {r.id}: {e['limiting']} {fmt(e['ratio'])} x A's{told}{floor}; tol_ratio A "
                       f"{fmt(e['tol_ratio']['a'])}, B {fmt(e['tol_ratio']['b'])}")
            out.append(f"        likely: {e['cause']}")
    if cmp.reductions:
        out += ["", "how the two collective libraries sum (reduction probes; model names: hal conformance docs):",
                *(f"  {r['case']}: {r['line']}" for r in cmp.reductions)]
    for label, ids in (("only in A", cmp.only_a), ("only in B", cmp.only_b)):
        if ids:
            head = ids if every_case else ids[:listed]
            more = [f"  ... and {len(ids) - len(head)} more (--all lists them)"] if len(head) < len(ids) else []
            out += ["", f"{label} ({len(ids)}):", *(f"  {i}" for i in head), *more]
    return "\n".join(out) + "\n"


def compare_files(a_path: str, b_path: str, *, factor: float = DEFAULT_FACTOR, floor: float | None = None,
                  report_dir: str | None = None, overwrite: bool = False) -> tuple[Comparison, list[Path]]:
    """Check the arguments, compare two results files, and write compare.json/compare.txt only with a report dir."""
    from hal.errors import ConfigError

    if not (factor > 0 and math.isfinite(factor)):
        raise ConfigError(f"--factor {factor}: give a positive number (e.g. 2)")
    if floor is not None and not (floor >= 0 and math.isfinite(floor)):
        raise ConfigError(f"--floor {floor}: give a non-negative number")
    a, b = load_results(a_path), load_results(b_path)
    refuse = () if overwrite else COMPARE_FILES
    directory = check_report_dir(report_dir, refuse_existing=refuse) if report_dir else None
    floors = {k: floor for k in FLOORS} if floor is not None else None
    cmp = compare(a, b, factor=factor, floors=floors, a_path=a_path, b_path=b_path)
    written: list[Path] = []
    if directory is not None:
        written = [Path(directory) / name for name in COMPARE_FILES]
        write_text_atomic(written[0], json.dumps(cmp.to_dict(), indent=2, allow_nan=False) + "\n")
        write_text_atomic(written[1], format_text(cmp, every_case=True))
        counts = ", ".join(f"{n} {level}" for level, n in cmp.level_counts.items())
        write_text_atomic(written[2], levels.matrix_html(
            cmp.levels, f"cross-device levels: {_side(cmp.b)} against {_side(cmp.a)}",
            f"{counts}; the worst case per op and dtype. L2: B's mean-relative, max-relative and RMS error within "
            "2 / 1.2 / 1.2 x A's; L1 5 / 1.5 / 1.5; L0 10 / 2 / 2; else fail. " + verdict_line(cmp)))
    return cmp, written
