"""``hal conformance survey`` (every OpInfo of torch's op_db on a backend) and ``hal conformance verify``
(a results.json against its digest): argument wiring and what is printed where."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hal.errors import ConfigError

from ..common import add_standin_argument, print_result
from . import parity


def add_parsers(inner: Any) -> None:
    s = inner.add_parser(
        "survey",
        help="run every OpInfo of PyTorch's op_db on a backend against the CPU: which ops work, which give wrong answers",
        description="The operator survey: each op of torch's OpInfo database, in each dtype the backend computes in, on "
        "device 0, forward and (where autograd applies) backward, judged against a float64 golden value, else torch's "
        "CPU kernel in the same dtype. Per (op, dtype): pass, failed (a wrong answer), raised, fallback (ran on the "
        "host) or untested (why); per op STRICT, BASIC (float32 only) or its worst outcome; strict and basic rates "
        "per op family. Writes results.json, summary.md and report.html. Exit 0 when no op gave a wrong answer, 1 "
        "when one did, 2 for bad input. Needs expecttest (pip install 'hetero-hal[survey]').",
    )
    s.add_argument("--backend", help="backend under test (default: HAL_BACKEND, else auto)")
    s.add_argument("-k", dest="patterns", metavar="PATTERN",
                   help="keep ops whose name matches any comma-separated pattern (substring, or a glob with * ? [)")
    s.add_argument("--dtypes", metavar="LIST", help="comma-separated dtypes to survey (default: float32, bfloat16, "
                   "float16, float64, int64, bool, less those the backend declares absent)")
    s.add_argument("--samples", type=int, default=None, metavar="N",
                   help="OpInfo sample inputs judged per (op, dtype) (default 4; part of the cohort's digest)")
    s.add_argument("--no-backward", action="store_true", help="forward only (backward is part of the digest)")
    s.add_argument("--jobs", type=int, metavar="N",
                   help="worker processes (default: the host's cores on cpu and stand-ins, 1 on an accelerator)")
    s.add_argument("--seed", type=int, default=1234, help="the seed samples are drawn with (default 1234)")
    s.add_argument("--report", metavar="DIR", help="where the files go (default: runs/survey-<backend>-<date-time>)")
    s.add_argument("--overwrite", action="store_true", help="replace a survey already in --report DIR")
    s.add_argument("--json", action="store_true", help="print results.json on stdout (the summary goes to stderr)")
    s.add_argument("--list", action="store_true", help="list the cohort's (op, dtype) pairs and its digest; run nothing")
    add_standin_argument(s)
    s.set_defaults(func=cmd_survey)

    parity.add_parser(inner)

    v = inner.add_parser(
        "verify",
        help="recompute a results.json's digest (run, survey or parity): was it edited after it was written?",
        description="Recompute the SHA-256 digest of a results.json (or the one in DIR) and compare it with the digest "
        "it records and the one its report.html shows. Exit 0 when they agree, 1 when the file was changed, 2 when it "
        "cannot be read. A checksum, not a signature: it catches an edit that did not recompute the digest.",
    )
    v.add_argument("path", metavar="DIR|results.json")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=cmd_verify)


DEFAULT_SAMPLES = 4


def _dtypes(spec: str | None, backend: Any) -> tuple[list[str], dict[str, str]]:
    from hal.capabilities import DtypeSupport
    from hal.conformance.survey.cohort import CAPABILITY_KEY, DTYPES

    names = [d.strip() for d in spec.split(",") if d.strip()] if spec else list(DTYPES)
    unknown = [d for d in names if d not in DTYPES]
    if unknown or not names:
        raise ConfigError(f"--dtypes {spec}: {', '.join(unknown) or 'empty'} is not a survey dtype; use some of "
                          f"{', '.join(DTYPES)}")
    caps = backend.capabilities(0)
    absent = {d: f"the backend declares no {CAPABILITY_KEY[d]} compute" for d in names
              if d in CAPABILITY_KEY and caps.support(CAPABILITY_KEY[d]) is DtypeSupport.ABSENT}
    return [d for d in names if d not in absent], absent


def cmd_survey(args: argparse.Namespace) -> int:
    from hal.conformance import runner
    from hal.conformance.reports.report import check_report_dir
    from hal.conformance.survey import cohort as C
    from hal.conformance.survey import document, run, tables
    from hal.conformance.survey.pair import Settings
    from hal.run_dirs import new_run_dir

    samples = DEFAULT_SAMPLES if args.samples is None else args.samples
    if not 1 <= samples <= 64:
        raise ConfigError(f"--samples {samples}: give 1 to 64 sample inputs a pair")
    if args.jobs is not None and not 1 <= args.jobs <= 256:
        raise ConfigError(f"--jobs {args.jobs}: give 1 to 256 worker processes")
    ctx, _ = runner.build_context(args.backend, seed=args.seed)
    backend = ctx.backend
    host_device = ctx.device.type == "cpu" or backend.standin is not None
    dtypes, absent = _dtypes(args.dtypes, backend)
    patterns = [p.strip() for p in (args.patterns or "").split(",") if p.strip()]
    op_db = C.load_op_db()
    cohort = C.build(op_db, dtypes, Settings(samples, args.seed, not args.no_backward), absent, patterns)
    if args.list:
        for p in cohort.pairs:
            print(f"{p.name}\t{p.dtype}\t{p.family}")
        print(f"cohort {cohort.digest}: {len(cohort.ops())} ops, {len(cohort.pairs)} pairs", file=sys.stderr)
        return 0
    jobs = args.jobs or (min(os.cpu_count() or 1, 8) if host_device else 1)
    target = Path(args.report) if args.report else new_run_dir(f"survey-{backend.name}")
    existed = target.is_dir()
    directory = check_report_dir(target, refuse_existing=() if args.overwrite else document.FILES)
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    print(f"survey: {len(cohort.pairs)} (op, dtype) pairs of {len(cohort.ops())} ops on {backend.name} "
          f"({backend.device_name(0)}), {jobs} job(s); cohort {cohort.digest}", file=sys.stderr, flush=True)
    try:
        findings = run.survey(backend.name, cohort, jobs, progress=run.Progress(len(cohort.pairs)), host_device=host_device)
    except BaseException:  # Ctrl-C: no empty report directory left behind
        if not existed and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
        raise
    doc = document.assemble(backend, cohort, findings, jobs=jobs, wall_s=time.monotonic() - t0, started=started)
    paths = document.write(doc, directory)
    summary = tables.summary_text(doc) + f"reports: {', '.join(str(p) for p in paths)}\n"
    print_result(summary, doc, args.json)
    return 1 if any(f["status"] == "failed" for f in findings) else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from hal.conformance.reports.verify import verify_path

    outcome = verify_path(args.path)
    if args.json:
        print(json.dumps(outcome.to_dict(), indent=2))
    else:
        print(outcome.text())
    return 0 if outcome.ok else 1
