"""``hal conformance run`` and ``hal conformance compare``: argument wiring and what is printed where.

stdout carries the result (the summary table, or JSON with ``--json``); stderr carries progress and,
with ``--json``, the human summary. Bad input raises a HalError, which ``hal``'s main prints as one
line and exit 2, before any case runs and before any file is written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hal.conformance.suite_names import SUITES
from hal.errors import HalError

from ..common import add_standin_argument, print_result
from . import survey

NAME = "conformance"


def add_parser(sub: Any) -> None:
    """Add ``conformance`` (with ``run`` and ``compare``) to hal's sub-command parsers."""
    p = sub.add_parser(
        NAME,
        help="check a backend's numbers against an fp64 CPU reference (run), survey torch's op database on it (survey), "
        "compare two runs or surveys (compare), check a results.json against its digest (verify)",
        description="Conformance suites: ops, precision, collectives, training and onnx, each case judged against a "
        "float64 CPU reference; reports as JSON, Markdown and one self-contained HTML page.",
    )
    inner = p.add_subparsers(dest="conformance", metavar="{run,survey,parity,compare,verify}", parser_class=type(p))
    inner.required = True

    r = inner.add_parser(
        "run",
        help="run the conformance suites on a backend and write results.json, summary.md and report.html",
        description="Run the chosen suites on BACKEND (device 0; collectives and training use up to --world-size "
        "ranks), with progress on stderr, then print a summary (counts per suite, failures, worst tol_ratio) and write "
        "results.json, summary.md and report.html. Exit 0 when no case failed or errored, 1 otherwise, 2 for bad input.",
    )
    r.add_argument("--backend", help="backend under test (default: HAL_BACKEND, else auto)")
    r.add_argument("--suite", metavar="NAMES",
                   help=f"comma-separated suites (default all: {','.join(SUITES)}); a dotted module path runs your own suite")
    r.add_argument("-k", dest="patterns", metavar="PATTERN",
                   help="keep cases matching any of these comma-separated patterns: a substring of the case id "
                   "(suite::name), or a glob (* ? [) matching the whole id or name, e.g. -k 'softmax,ops::*/bfloat16/*'")
    r.add_argument("--report", metavar="DIR", help="where the report files go (default: runs/conformance-<backend>-<date-time>)")
    r.add_argument("--json", action="store_true", help="print the results JSON on stdout (the summary goes to stderr)")
    r.add_argument("--list", action="store_true", help="list the selected case ids and counts per suite; run nothing")
    r.add_argument("--world-size", type=int, metavar="N",
                   help="ranks for collectives and training (default: every device; 4 processes on cpu)")
    r.add_argument("--seed", type=int, default=None, help="the seed every case starts from (default 1234)")
    r.add_argument("--overwrite", action="store_true", help="replace a report already in --report DIR (refused otherwise)")
    r.add_argument("--verdict", choices=("hal", "torch", "cann"), default="hal",
                   help="the rule the ops and precision cases are judged by: our table (hal, the default), "
                   "assert_close's defaults (torch) or the mixed-tolerance standard (cann: 99 %% of elements and a 32-ULP "
                   "cap); recorded in the report, which says where our default is looser (docs/conformance.md)")
    add_standin_argument(r)
    r.set_defaults(func=cmd_run)

    c = inner.add_parser(
        "compare",
        help="compare two results.json: is B's error within --factor times A's on every common case?",
        description="Side by side per common case: B is worse when its error (tol_ratio, else rel_l2, max_rel, max_abs, "
        "ulp, else the first metric both runs bound, as metric/bound) exceeds FACTOR x max(A's error, floor), or when "
        "A passed and B failed. Floors: tol_ratio and metric/bound 0.01, rel_l2/max_rel/max_abs 1e-6, ulp 1. Cases B "
        "skipped are not compared; cases in one run only are listed. Exit 1 when any case is worse, 0 otherwise, 2 for "
        "an unreadable file.",
    )
    c.add_argument("a", metavar="A.json", help="the reference run's results.json")
    c.add_argument("b", metavar="B.json", help="the run under comparison")
    c.add_argument("--factor", type=float, default=2.0, help="allowed ratio of B's error to A's (default 2)")
    c.add_argument("--floor", type=float, help="one absolute floor for every metric (default: per metric, see above)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.add_argument("--report", metavar="DIR", help="also write compare.json and compare.txt (every case) there")
    c.add_argument("--all", action="store_true", help="list every common case, not only the worse ones")
    c.add_argument("--overwrite", action="store_true", help="replace a comparison already in --report DIR")
    c.set_defaults(func=cmd_compare)
    survey.add_parsers(inner)


def _list(the_plan: Any, as_json: bool) -> int:
    from collections import Counter

    per_suite = Counter(c.suite for c in the_plan.cases)
    if as_json:
        print(json.dumps({"cases": [{"id": c.id, "description": c.description, "tags": list(c.tags)} for c in the_plan.cases],
                          "problems": [{"id": p.id, "reason": p.outcome.reason} for p in the_plan.problems],
                          "counts": dict(per_suite), "total": len(the_plan.cases)}, indent=2))
        return 1 if the_plan.problems else 0
    for case in the_plan.cases:
        print(case.id)
    for problem in the_plan.problems:
        print(f"{problem.id}  error: {problem.outcome.reason}")
    print("", file=sys.stderr)
    for suite in the_plan.suites:
        print(f"{suite:<12} {per_suite.get(suite, 0)} case(s)", file=sys.stderr)
    print(f"{'total':<12} {len(the_plan.cases)} case(s)"
          + (f" of {the_plan.collected} (-k {','.join(the_plan.patterns)})" if the_plan.patterns else ""), file=sys.stderr)
    return 1 if the_plan.problems else 0


def cmd_run(args: argparse.Namespace) -> int:
    from hal.conformance import runner
    from hal.conformance.reports.provenance import provenance, seal
    from hal.conformance.reports.report import REPORT_FILES, check_report_dir, default_report_dir, summary_text, write_reports
    from hal.conformance.reports.results import json_safe
    from hal.launch import run_function

    seed = runner.DEFAULT_SEED if args.seed is None else args.seed
    ctx, reason = runner.build_context(args.backend, world_size=args.world_size, seed=seed, launch=run_function,
                                       options={"verdict": args.verdict})
    the_plan = runner.plan(ctx, args.suite, args.patterns)
    if args.list:
        print(f"verdict profile: {args.verdict}", file=sys.stderr)
        return _list(the_plan, args.json)
    target = Path(args.report) if args.report else default_report_dir(ctx.backend_name)
    existed = target.is_dir()
    directory = check_report_dir(target, refuse_existing=() if args.overwrite else REPORT_FILES)
    try:
        result = runner.execute(ctx, the_plan, backend_reason=reason)
    except BaseException:  # Ctrl-C: leave no empty report directory behind
        if not existed and not any(directory.iterdir()):
            directory.rmdir()
        raise
    doc = result.to_dict()
    fell_back = sum(1 for c in doc["cases"] if (c.get("data") or {}).get("host_fallback"))
    doc["provenance"] = provenance(ctx.backend, fell_back=fell_back)  # what exactly was qualified (reports.provenance)
    doc = seal(json_safe(doc))  # the digest verify recomputes; the same document on stdout and on disk
    try:
        paths = write_reports(doc, directory)
    except OSError as exc:  # e.g. the disk filled up during the run: say so after the summary, exit 2
        sys.stdout.write(summary_text(doc))
        raise HalError(f"writing the reports to {directory} failed: {exc.strerror or exc}") from None
    summary = summary_text(doc) + f"reports: {', '.join(str(p) for p in paths)}\n"
    print_result(summary, doc, args.json)
    return result.exit_code


def cmd_compare(args: argparse.Namespace) -> int:
    from hal.conformance.reports.compare import compare_files, format_text
    from hal.conformance.reports.results import read_document
    from hal.conformance.survey import compare as survey_compare
    from hal.conformance.survey.document import check

    a, b = read_document(args.a), read_document(args.b)
    if survey_compare.is_survey(a) or survey_compare.is_survey(b):
        cmp_s = survey_compare.compare(check(a, args.a), check(b, args.b))
        print(json.dumps(cmp_s.to_dict(), indent=2) if args.json else survey_compare.format_text(cmp_s), end="" if not args.json else "\n")
        return cmp_s.exit_code

    cmp, written = compare_files(args.a, args.b, factor=args.factor, floor=args.floor, report_dir=args.report,
                                 overwrite=args.overwrite)
    if cmp.setting_differences:
        print(f"hal: warning: A and B ran with different settings ({'; '.join(cmp.setting_differences)})", file=sys.stderr)
    if args.json:
        print(json.dumps(cmp.to_dict(), indent=2, allow_nan=False))
    else:
        sys.stdout.write(format_text(cmp, every_case=args.all))
        if written:
            print(f"written: {', '.join(str(p) for p in written)}")
    return cmp.exit_code
