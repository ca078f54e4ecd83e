"""``hal plan --config F``: validate model + plan + backends and show the topology, starting nothing.

It is the same check a training launch makes before it starts a process, so a plan that passes
here fails later only for reasons a dry run cannot see (a rank crashing, a network down).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from hal import strict_json

from .common import add_config_argument, add_standin_argument, config_path

NAME = "plan"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help="check a parallel plan against its model and backends and show the topology (starts nothing)",
        description="Validate the model, parallel and train sections of CONFIG (layers, tp/dp/sp divisibility, "
        "micro-batching, backends and their device counts) and print the stage table and every rank's "
        "(stage, dp, tp) coordinate. Nothing is started.",
    )
    add_config_argument(p, "YAML config with model:, parallel: and train: sections", required=True)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeline", metavar="OUT.png",
                   help="also draw the schedule's predicted timeline (each stage's time proportional to its layers; for a plan "
                        "hal plan --search wrote, and with --search for plan #1, the planner's own prediction in seconds) "
                   "as a PNG; needs matplotlib (the report extra)")
    p.add_argument("--search", action="store_true",
                   help="search the plans of the cluster (stage order over device types, grids, layer split, schedule, "
                   "micro-batching, recompute, zero1) keeping the config's global batch; print the best")
    p.add_argument("--cluster", metavar="C", help="--search or --profile: a YAML file with a cluster: section (default: "
                   "the config's, else the devices present)")
    p.add_argument("--profile", metavar="P", help="a profile from hal profile: with --search, the plans are priced with it "
                   "(default: measure the devices present now, quick; estimate the others); without, the config's own "
                   "plan (or replicas and their sync) is")
    p.add_argument("--calibrate", action="store_true",
                   help="time this host's devices for the config (a quick profile, seconds) and price its plan with them; "
                   "the profile is cached, and later hal plan runs of such a config use it (without one, each stage's "
                   "time is a guess from its layers)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="--search: how many plans to show (default 5)")
    p.add_argument("--write", metavar="PLAN.yaml", help="--search: write the config with the best plan (hal train runs it)")
    p.add_argument("--family", choices=("best", "stages", "replicas"), default="best",
                   help="--search --write: which family's first plan to write (default best: the faster predicted one)")
    p.add_argument("--use-all-types", action="store_true",
                   help="--search: every device type of the cluster holds at least one stage (default: a type that only "
                   "slows the plan down is left out)")
    add_standin_argument(p)
    p.set_defaults(func=run)


def _span(values: Sequence[int]) -> str:
    """Ranks or layers as '0-3' when consecutive, else '0,2,5'."""
    if not values:
        return "-"
    if len(values) > 1 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _chunks(stage: dict[str, Any]) -> str:
    """A stage's layers, one span per model chunk ('0-1 | 4-5') when the plan interleaves."""
    chunks = stage.get("chunks") or [stage["layers"]]
    return " | ".join(_span(c) for c in chunks)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _moe_line(model: dict[str, Any]) -> str:
    """``; moe: 8 experts top-2 (ffn 64), layers 2-3`` for an MoE model, else nothing."""
    if not model.get("moe_num_experts"):
        return ""
    from hal.parallel.config.model import ModelConfig

    layers = ModelConfig(**model).moe_layers()
    shared = f", shared expert ffn {model['moe_shared_ffn_size']}" if model.get("moe_shared_ffn_size") else ""
    return (f"; moe: {model['moe_num_experts']} experts top-{model['moe_top_k']} "
            f"(ffn {model.get('moe_ffn_hidden_size') or model['ffn_hidden_size']}{shared}), {model['moe_scoring']} router, "
            f"layers {', '.join(map(str, layers))}")


def _played(schedule: str) -> bool:
    """Whether the schedule's order is played, so ``parallel.order`` may play it from measured times."""
    from hal.parallel.schedules import get_schedule

    return get_schedule(schedule).plays_times


def format_plan(report: dict[str, Any]) -> str:
    plan, model, topo = report["plan"], report["model"], report["topology"]
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    lines = [
        f"plan {report['config']}: {len(plan['stages'])} stage(s), {topo['world_size']} rank(s), schedule {plan['schedule']}, "
        f"{plan['micro_batches']} micro-batches × {plan['micro_batch_size']} rows (global batch {report['global_batch_size']}), "
        f"zero1 {yes(plan['zero1'])}, fused head {yes(plan.get('fused_head'))}"
        + (f", {plan['virtual_stages']} chunks per stage" if plan.get("virtual_stages", 1) > 1 else "")
        + (" placed in a V (stage 0 holds the first and the last chunk: the embedding, the head and the loss)"
           if topo.get("placement") == "v" else "")
        + (f"; order played from measured times at hal train's step 2 (parallel.order {plan.get('order', 'auto')})"
           if _played(plan["schedule"]) and plan.get("order", "auto") != "unit" else ""),
        f"model: {model['num_layers']} layers, hidden {model['hidden_size']}, heads {model['num_heads']} "
        f"(kv {model['num_kv_heads']}), ffn {model['ffn_hidden_size']}, vocab {model['vocab_size']}, "
        f"max seq {model['max_seq_len']}" + _moe_line(model),
        "",
    ]
    precisions = report.get("stage_precision") or [report.get("precision", "?")] * len(topo["stages"])
    expert_parallel = any(s.get("ep", 1) > 1 for s in topo["stages"])
    rows = [["stage", "backend", "ranks", "tp", "dp", *(["ep"] if expert_parallel else []), "sp", "checkpoint", "layers",
             "rows/replica", "precision"]]
    for s, precision in zip(topo["stages"], precisions):
        rows.append([str(s["stage"]), s["backend"], _span(s["ranks"]), str(s["tp"]), str(s["dp"]),
                     *([str(s.get("ep", 1))] if expert_parallel else []), yes(s["sp"]),
                     yes(s["checkpoint"]), f"{_chunks(s)} ({len(s['layers'])})",
                     str(plan["micro_batch_size"] // s["dp"]), precision])
    lines += _table(rows)
    fp16 = [str(k) for k, p in enumerate(precisions) if p == "fp16-mixed"]
    if fp16:
        lines.append(f"fp16 on stage(s) {', '.join(fp16)}: one dynamic loss scale for the whole pipeline "
                     "(every rank unscales, an inf anywhere skips the step everywhere)")
    lines.append("")
    rows = [["rank", "stage", "dp", "tp", "backend"]]
    rows += [[str(r["rank"]), str(r["stage"]), str(r["dp"]), str(r["tp"]), r["backend"]] for r in topo["ranks"]]
    lines += _table(rows)
    for b in topo["boundaries"]:
        src, dst = b["backends"]
        path = "one backend" if src == dst else "bridged across backends"
        lines.append(f"boundary {b['from_stage']}->{b['to_stage']}: ranks {_span(b['ranks'])}, {src} -> {dst} ({path})")
    sched = report.get("schedule")
    if sched:
        measured = (report.get("predicted") or {}).get("prediction")
        lines += ["", f"schedule {sched['name']}: idle share overall {sched['bubble_overall']:.3f} — a GUESS, not a "
                      f"measurement ({sched['assumes']}; the devices, head and boundaries left out)"]
        if measured is None:
            lines.append(f"  priced with measured times: hal plan --config {report.get('config', 'F')} --calibrate (a "
                         "quick calibration of this host, cached) or --profile P")
        held = "micro-batches in flight" if sched.get("virtual_stages", 1) == 1 else "chunk activations held"
        from hal.parallel.schedules.pairs import in_brief

        pairs = sched.get("pairs")  # dualpipev: how each stage runs its pairs, as hal train will
        cost = measured["bubble"] if measured is not None and len(measured.get("bubble", [])) == len(sched["bubble"]) else None
        rows = [["stage", "idle share (guess)", *(["idle share (cost model)"] if cost else []), held,
                 *(["pairs (forward and backward at once)"] if pairs else [])]]
        rows += [[str(k), f"{b:.3f}", *([f"{cost[k]:.3f}"] if cost else []), str(n),
                  *([in_brief(pairs[k]) if pairs[k] else "-"] if pairs else [])]
                 for k, (b, n) in enumerate(zip(sched["bubble"], sched["in_flight"]))]
        lines += _table(rows)
    return "\n".join(lines)


def run_search(args: argparse.Namespace) -> int:
    """``--search``: plan the cluster; the best K plans (and --write the best)."""
    import sys

    from hal.errors import ConfigError
    from hal.parallel.loop.preflight import SEARCH, Request, preflight
    from hal.parallel.planner.run_search import as_json, format_search, preferred, search, write_plan, write_replicas

    if args.top < 1:
        raise ConfigError(f"--top {args.top}: give 1 or more plans to show")
    if args.family != "best" and not args.write:
        raise ConfigError(f"--family {args.family} says which plan --write writes; add --write PLAN.yaml or drop --family")
    if args.write:  # checked before the search: not a traceback after it
        _check_write(args)
    if args.timeline is not None:
        _check_timeline(args.timeline)
    run = preflight(Request(config_path(args), local=False, writes=False), SEARCH).loaded
    if run.replicas.several:
        raise ConfigError(f"{run.origin}: --search starts from one plan (parallel.stages) and proposes stage and replica "
                          "plans itself; search from a config with parallel.stages (this config's replicas are checked by "
                          "hal plan without --search)")
    report, cost = search(run, args.cluster, args.profile, args.top, use_all_types=args.use_all_types,
                          progress=lambda m: print(f"hal plan: {m}", file=sys.stderr, flush=True))
    print(strict_json.dumps(as_json(report, cost), indent=2) if args.json else format_search(report, cost))
    family = preferred(report) if args.family == "best" else args.family
    if args.write and family == "stages" and not report.results:
        raise ConfigError("--write: the search found no stage plan for this cluster (see the notes above)")
    if args.write and family == "replicas" and not report.replicas:
        raise ConfigError("--family replicas: the search found no replica plan for this cluster (see the notes above); "
                          "drop --family or use --family stages")
    if args.write and family == "replicas":
        write_replicas(run, report.replicas[0], args.write)
        print(f"hal plan: wrote {args.write}: hal train {args.write} runs replica plan R1", file=sys.stderr)
    elif args.write:
        write_plan(run, report.results[0], args.write, cost, args.profile)
        print(f"hal plan: wrote {args.write}: hal train {args.write} runs plan #1", file=sys.stderr)
    if args.timeline is not None:
        from hal.parallel.config.planned import planned_section, profile_label, read_planned
        from hal.parallel.observe.timeline import planned_document, planned_timeline

        best = report.results[0]
        planned = read_planned(planned_section(best.plan, best.prediction, profile_label(args.profile)), best.plan, "plan #1")
        assert planned is not None  # a section was given
        _draw(planned_document(best.plan, planned_timeline(planned, best.plan)), args.timeline,
              "the planner's predicted timeline of plan #1")
    return 0


def run(args: argparse.Namespace) -> int:
    """Validate the config and print its topology; a problem raises one ConfigError line (exit 2)."""
    from hal.errors import ConfigError

    if args.calibrate and (args.search or args.profile):
        why = "--search measures the devices present itself" if args.search else "--profile already gives the times"
        raise ConfigError(f"--calibrate prices the config's own plan with this host's times; {why}: drop one")
    if args.search:
        return run_search(args)

    if args.family != "best":
        raise ConfigError(f"--family {args.family} goes with --search --write; add them or drop --family")
    for flag in ("write", "use_all_types"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag} goes with --search; add --search or drop --{flag}")
    if args.cluster and not args.profile:
        raise ConfigError("--cluster goes with --search or --profile; add one or drop --cluster")
    from hal.parallel.loop.preflight import PLAN, Request, preflight
    from hal.parallel.observe.plan_report import plan_report

    if args.timeline is not None:
        _check_timeline(args.timeline)
    # hal train's checks but those of flags only it has: what passes here passes there, before anything starts
    run = preflight(Request(config_path(args), writes=False), PLAN).loaded
    host = _host_profile(run, args)
    predicted = _predicted(run, args, host) if args.profile or host else None
    if run.replicas.several:
        return _print_replicas(run, args, predicted)
    report = plan_report(run) | ({"predicted": predicted} if predicted else {})
    print(strict_json.dumps(report, indent=2) if args.json else format_plan(report))
    if predicted and not args.json:
        print("\n" + format_predicted(predicted))
    if args.timeline is not None:
        from hal.parallel.config.planned import mismatch_note
        from hal.parallel.observe.timeline import plan_document, planned_document, planned_timeline

        if run.planned is not None and run.planned.matches:  # hal plan --search wrote it: its own prediction
            _draw(planned_document(run.plan, planned_timeline(run.planned, run.plan)), args.timeline,
                  "the planner's predicted timeline")
        else:
            if run.planned is not None:
                print(f"hal plan: {mismatch_note(config_path(args))}", file=sys.stderr)
            _draw(plan_document(run.plan), args.timeline, "predicted timeline")
    return 0


def _host_profile(run: Any, args: argparse.Namespace) -> str | None:
    """This host's cached profile of the config (``--calibrate`` makes it now), where no --profile is given; None
    where there is none: the plan's schedule is then a guess from the layers, said beside its numbers."""
    if args.profile:
        return None
    from hal.parallel.planner import host_profile

    if args.calibrate:
        path = host_profile.calibrate(run, progress=lambda m: print(f"hal plan: {m}", file=sys.stderr))
        print(f"hal plan: this host calibrated for the config, cached at {path} (later hal plan runs of such a config "
              "use it)", file=sys.stderr)
        return str(path)
    found = host_profile.cached(run)
    return None if found is None else str(found)


def _predicted(run: Any, args: argparse.Namespace, host: str | None = None) -> dict[str, Any]:
    """The cost model's prediction for the config's own plan or replicas (``--profile``, or this host's calibrated
    profile ``host``, without ``--search``)."""
    import os
    from pathlib import Path

    from hal.parallel.planner.host_profile import made_on
    from hal.parallel.planner.run_search import predict_config

    label = (f"this host's calibrated profile ({host}, made {made_on(Path(host))}; hal plan --calibrate remakes it)"
             if host else None)
    return predict_config(run, args.cluster, args.profile or host, islands_apart=bool(os.environ.get("HAL_ISLANDS")),
                          priced_with=label)


def _order_line(order: dict[str, Any]) -> str:
    """What the prediction foresees of hal train's order calibration."""
    unit, measured = order["unit_step_s"], order["measured_step_s"]
    if order["chosen"] == "unit":
        return (f"order: played from these predicted times it is no faster ({measured:.4g} s against {unit:.4g} s a "
                "schedule): the unit-time order is predicted to stay after hal train's calibration")
    return (f"order: played from these predicted times, {unit / measured:.3f}x the unit-time order ({measured:.4g} s against "
            f"{unit:.4g} s a schedule); predicted as hal train keeps it after its calibration")


def format_predicted(p: dict[str, Any]) -> str:
    """The prediction's lines: one plan's step, or each replica's and the sync."""
    if "prediction" in p:
        one = p["prediction"]
        lines = [f"predicted (cost model): step {one['step_s']:.4g} s, {one['tokens_per_s']:,.0f} tokens/s, idle share "
                 f"{one['bubble_overall']:.1%}, bound by {one['bound']}"]
        if one.get("order"):
            lines.append(f"  {_order_line(one['order'])}")
        if one["estimated"]:
            lines.append(f"  ESTIMATED: {'; '.join(one['estimated'])}")
    else:
        lines = [f"predicted (cost model): step {p['step_s']:.4g} s, {p['tokens_per_s']:,.0f} tokens/s — the slowest "
                 f"replica {p['compute_s']:.4g} s + sync {p['sync_s']:.4g} s ({p['sync_s'] / p['step_s']:.0%} of the step, "
                 f"{p['bridge_bytes'] / 1e9:.3g} GB a replica over {p['stripes']} pair(s))"]
        for i, (rows, one) in enumerate(zip(p["rows"], p["replicas"])):
            lines.append(f"  replica {i}: {rows} rows, step {one['step_s']:.4g} s, bound by {one['bound']}")
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)


def _print_replicas(run: Any, args: argparse.Namespace, predicted: dict[str, Any] | None = None) -> int:
    """A replicated run: the global batch and sync, then each replica's plan as ``hal plan`` prints one plan (and with
    --timeline, each replica's predicted timeline in one picture)."""
    from hal.parallel.observe.plan_report import replicated_report

    report = replicated_report(run)
    if args.timeline is not None:
        from hal.parallel.observe.timeline import plan_document
        from hal.parallel.observe.timeline_plot import write_replicas_png

        docs = [plan_document(r.plan, r.first_rank) for r in run.replicas.replicas]
        titles = [f"replica {i}: " + ("auto rows" if r.rows is None else f"{r.rows} rows") + f", ranks {r.ranks[0]}-{r.ranks[-1]}"
                  for i, r in enumerate(run.replicas.replicas)]
        print(f"hal plan: predicted timelines of the replicas {write_replicas_png(docs, titles, args.timeline)}",
              file=sys.stderr)
    if predicted:
        report["predicted"] = predicted
    if args.json:
        print(strict_json.dumps(report, indent=2))
        return 0
    sync = report["replica_sync"]
    how = ("gradients summed every step (exact: the single-device training)" if sync["every"] == 1 else
           f"local SGD: the replicas meet every {sync['every']} steps (outer lr {sync['outer_lr']}, momentum "
           f"{sync['outer_momentum']})")
    wire = "" if sync["compress"] == "none" else f", {sync['compress']} on the wire"
    wire += ", exchanged during the backward where a stage allows it" if sync.get("overlap") == "on" else ""
    print(f"replicas {report['config']}: {len(report['replicas'])} replicas, {report['world_size']} rank(s), global batch "
          f"{report['global_batch_size']} rows; {how}{wire}")
    for replica in report["replicas"]:
        rows = "auto (by measured speed)" if replica["rows"] is None else f"{replica['rows']} rows"
        print(f"\nreplica {replica['replica']}: {rows}, ranks {replica['ranks'][0]}-{replica['ranks'][-1]}")
        print(format_plan(replica))
    if predicted:
        print("\n" + format_predicted(predicted))
    return 0


def _draw(document: dict[str, Any], path: str, what: str) -> None:
    from hal.parallel.observe.timeline_plot import write_png

    print(f"hal plan: {what} {write_png(document, path)}", file=sys.stderr)


def _check_write(args: argparse.Namespace) -> None:
    """--write names a new file: writable, and not one of the files the search reads (it would replace it)."""
    from pathlib import Path

    from hal.errors import ConfigError
    from hal.run_dirs import check_creatable_file

    target = Path(args.write)
    check_creatable_file(target, "--write")
    for flag, source in (("--config", config_path(args)), ("--cluster", args.cluster), ("--profile", args.profile)):
        if source and target.exists() and target.resolve() == Path(source).resolve():
            raise ConfigError(f"--write {args.write}: is the {flag} file this search reads; writing the plan there "
                              "would replace it: give another path")


def _check_timeline(path: str) -> None:
    """--timeline asked for a picture: matplotlib and a writable .png path, or one line (exit 2) first."""
    from pathlib import Path

    from hal.errors import HalError
    from hal.parallel.observe.timeline_plot import missing
    from hal.run_dirs import check_creatable_file

    if not path.lower().endswith(".png"):
        raise HalError(f"--timeline {path}: the picture is a PNG; give a path ending in .png")
    check_creatable_file(Path(path), "--timeline")
    reason = missing()
    if reason is not None:
        raise HalError(f"--timeline: {reason}")
