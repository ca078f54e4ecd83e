"""``hal train F``: check the whole run, then one local process per rank of the plan, and train."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from hal import strict_json

from .common import add_standin_argument

NAME = "train"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help="train a hybrid-parallel plan: one local process per rank, progress, JSON-lines log, checkpoints",
        description="Validate CONFIG (model, plan, train, backends, data, --resume checkpoint), then start one process "
        "per rank of the plan on this machine, each with HAL_BACKEND of its stage, and train: a progress line on "
        "stderr (redrawn in place when stderr is a terminal, one line a step otherwise) and a line per evaluation, "
        "one JSON line per step (loss, tokens/s, per-stage compute / p2p / bubble) in train.log_file, a "
        "device-agnostic checkpoint at the end (and every train.checkpoint_every steps), and a summary: tokens/s, "
        "MFU (or why there is none), each stage's share of the step computing and its peak memory. Several nodes: "
        "see --print-multinode.",
    )
    p.add_argument("config", help="YAML config with model:, parallel: and train: sections")
    p.add_argument("--backend", metavar="X", help="run every stage on backend X, whatever the config names (its devices, "
                   "grids and layers kept): the model migrated by one flag")
    p.add_argument("--steps", type=int, help="train until this many steps are done in total (default: train.steps)")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (a step-N directory, or a checkpoint_dir: its latest) — "
                                                   "any plan with the same model")
    p.add_argument("--init-from", metavar="DIR",
                   help="start from a Hugging Face checkpoint (config.json + safetensors), as model: {hf: DIR, weights: true}; "
                   "the model section must describe DIR's model")
    p.add_argument("--run-dir", metavar="DIR", help="where the log, summary and checkpoints go (default: runs/<config>-<date-time>)")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON on stdout")
    p.add_argument("--profile", action="store_true",
                   help="per-phase times (compute, p2p, grad sync, optimizer) in every step's JSON line, from device events "
                   "read once at the end of each step, and the last step's timeline (RUN_DIR/timeline.json, drawn as timeline.png: "
                   "predicted against measured; one a replica with parallel.replicas); without it hal train never waits on an "
                   "accelerator for timing")
    p.add_argument("--cpu-binding", choices=("none", "cores"), default="none",
                   help="cores: pin each rank to a block of cores of its own, inside one NUMA node where it can "
                        "(refused when the ranks outnumber the cores); several nodes: torchrun --numa-binding")
    p.add_argument("--print-multinode", type=int, metavar="NODES",
                   help="print the plain torchrun command for each of NODES nodes and start nothing")
    p.add_argument("--emit", choices=("slurm", "kubernetes", "torchrun", "hostfile"),
                   help="print the run as the cluster's own job and start nothing: a Slurm heterogeneous job, Kubernetes "
                   "resources (a JobSet), torchrun lines or a FlagScale-style hostfile; one component per island, c10d "
                   "rendezvous (docs/clusters.md)")
    p.add_argument("--devices-per-node", action="append", metavar="BACKEND=N",
                   help="with --emit: processes a node for a backend's islands (default 8, cpu: the island's ranks)")
    p.add_argument("--resource", action="append", metavar="BACKEND=NAME",
                   help="with --emit kubernetes: the device plugin's resource name (e.g. rocm=hygon.com/dcu)")
    p.add_argument("--gres-name", action="append", metavar="BACKEND=NAME",
                   help="with --emit slurm: the site's GRES name for a backend (default gpu, npu for ascend, mlu for cambricon)")
    add_standin_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.emit is not None:
        return _emit(args)
    if args.devices_per_node or args.resource or args.gres_name:
        from hal.errors import ConfigError

        raise ConfigError("--devices-per-node, --resource and --gres-name shape what --emit prints; add --emit FORMAT")
    if args.print_multinode is not None:
        from hal.errors import ConfigError
        from hal.parallel.loop.job_runner import prepare

        if args.print_multinode < 1:
            raise ConfigError(f"--print-multinode {args.print_multinode} is not a node count; give 1 or more")
        job = prepare(args.config, steps=args.steps, resume=args.resume, run_dir=args.run_dir, check_backends=False,
                      init_from=args.init_from, backend=args.backend)
        print("\n".join(multinode_lines(job, args.print_multinode)))
        return 0
    from hal.backends.standins import keep_free
    from hal.parallel.loop.job_runner import describe, prepare, read_summary, run_local, write_job

    keep_free()  # the launcher loads no stand-in: its ranks (forked from it where they can be) load their own
    job = prepare(args.config, steps=args.steps, resume=args.resume, run_dir=args.run_dir, profile=args.profile,
                  init_from=args.init_from, cpu_binding=args.cpu_binding, backend=args.backend)
    print(f"hal train: {describe(job)}", file=sys.stderr)
    if args.backend:
        print(f"hal train: --backend {args.backend}: every stage runs on {job.replicas.replicas[0].plan.stages[0].backend}, "
              "whatever the config names (devices, grids and layers as it gives them)", file=sys.stderr)
    if job.planned is not None and not job.planned.matches:
        from hal.parallel.config.planned import mismatch_note

        print(f"hal train: {mismatch_note(args.config)}", file=sys.stderr)
    write_job(job)
    _tidy_checkpoints(job.checkpoint_dir)  # what an earlier run's stop left mid-write
    try:
        status = run_local(job, lambda commands, envs: spawn_ranks(commands, envs, job.checkpoint_dir, Path(job.run_dir)))
    finally:
        _tidy_checkpoints(job.checkpoint_dir)  # a write this run's stop (a failure, a signal) cut short
    if status == 0:
        summary = read_summary(job)
        _print_summary(summary, args.json)
        if job.profile:
            _draw_timeline(job)
        if summary.get("diverged"):  # trained to the end, but not into anything usable: said, and its own status
            from hal.parallel.observe.records import DIVERGED_STATUS

            print(f"hal train: warning: the run diverged: {summary['diverged']['reason']}; its checkpoints hold what it "
                  f"trained (resume from one before step {summary['diverged']['step']}, with a smaller learning rate or "
                  f"outer step); exit status {DIVERGED_STATUS}", file=sys.stderr)
            return DIVERGED_STATUS
    return status


def _tidy_checkpoints(checkpoints: Path | None) -> None:
    from hal.parallel.state.checkpoint import tidy

    for line in tidy(checkpoints):
        print(f"hal train: {line}", file=sys.stderr)


def _draw_timeline(job: Any) -> None:
    """RUN_DIR/timeline.png from the timeline.json the writer rank left (a replicated run: one a replica), with the
    planner's prediction added where the config keeps one for this plan; without matplotlib, one line why."""
    from hal.parallel.observe.timeline import check_document, planned_timeline
    from hal.parallel.observe.timeline_plot import missing, write_png
    from hal.run_dirs import write_text_atomic

    replicated = job.replicas.several
    for index, name in enumerate(job.timeline_files()):
        source = Path(job.run_dir) / name
        if not source.is_file():  # no step ran (a resume at the last step)
            continue
        doc = check_document(json.loads(source.read_text(encoding="utf-8")), str(source))
        if not replicated and job.planned is not None and job.planned.matches:
            doc["planned"] = planned_timeline(job.planned, job.plan)
            write_text_atomic(source, strict_json.dumps(doc) + "\n")
        whose = f"replica {index}: " if replicated else ""
        for line in _stage_shares(doc):
            print(f"hal train: {whose}{line}", file=sys.stderr)
        reason = missing()
        if reason is not None:
            print(f"hal train: {source.with_suffix('.png').name} not drawn: {reason} (the spans are in {source})",
                  file=sys.stderr)
            continue
        png = write_png(doc, source.with_suffix(".png"))
        against = "planned and predicted" if "planned" in doc else "predicted"
        print(f"hal train: {whose}timeline of step {doc['step']}, {against} against measured: {png}", file=sys.stderr)


def _stage_shares(doc: dict[str, Any]) -> list[str]:
    """Per rank of the profiled step: its compute, P2P (posts and waits) and idle shares of the step beside the
    simulator's idle share for its stage (fed the measured compute, communication free): what the plan's
    communication and waiting cost where the prediction has none."""
    if not doc.get("ranks"):  # a document with no measured step
        return []
    predicted = doc.get("predicted", {}).get("bubble", [])
    lines = [f"step {doc['step']} per rank: computing / in P2P calls / idle, and the simulator's idle for its stage"
             + (" (the order played from measured times)" if doc.get("order") == "measured" else "")]
    for r in doc.get("ranks", []):
        idle = f"{predicted[r['stage']]:.0%}" if r["stage"] < len(predicted) else "n/a"
        lines.append(f"  stage {r['stage']} rank {r['rank']}: {r['compute']:.0%} / {r['p2p']:.0%} / {r['idle']:.0%}; "
                     f"predicted idle {idle}")
    return lines


def _loss(value: float | None) -> str:
    """A summary loss; None is what the log writes for a loss that was not finite (the run diverged)."""
    return "not finite (diverged)" if value is None else f"{value:.4f}"


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    """The summary: --json's document as it is, else a line for the run, one per stage, one for the files."""
    if as_json:
        print(strict_json.dumps(summary, indent=2))
        return
    rate = summary["tokens_per_s"] or 0.0
    mfu = f"MFU {summary['mfu']:.1%}" if summary.get("mfu") is not None else f"MFU n/a ({summary.get('mfu_note') or 'unknown'})"
    print(f"hal train: steps {summary['first_step']}-{summary['last_step']} of {summary['steps']}: loss "
          f"{_loss(summary['first_loss'])} -> {_loss(summary['final_loss'])}, {rate:.0f} tok/s steady, {mfu}, "
          f"{summary['wall_s']:.1f} s wall")
    evals = summary.get("evals") or []
    if evals:
        best = min(evals, key=lambda e: float("inf") if e["loss"] is None else e["loss"])
        print(f"hal train: eval loss {_loss(evals[0]['loss'])} (step {evals[0]['step']}) -> {_loss(evals[-1]['loss'])} "
              f"(step {evals[-1]['step']}), best {_loss(best['loss'])} at step {best['step']}, {len(evals)} evaluation(s)")
    if summary.get("standin"):
        print(f"hal train: {', '.join(summary['standin']['backends'])} ran on {summary['standin']['note']}")
    for stage in summary.get("stages", []):
        where = f"replica {stage['replica']} " if "replica" in stage else ""
        print(f"hal train: {where}{_stage_line(stage)}")
    for replica in summary.get("replicas", []):
        share = replica["sync_share"]
        moved = replica.get("first_rows", replica["rows"])
        rows = f"{replica['rows']} rows a step" + (f", {moved} at the start" if moved != replica["rows"] else "")
        print(f"hal train: replica {replica['replica']} ({'+'.join(replica['backends'])}, {rows}): "
              f"{replica['tokens_per_s'] or 0:.0f} tok/s, waiting for and exchanging with the other replicas "
              f"{'n/a' if share is None else f'{share:.0%}'} of the step, "
              f"{_bytes(int(replica['cross_replica_bytes_per_step']))} sent a step"
              + _during(replica.get("buckets_during_backward_per_step")))
    for restart in summary.get("restarts") or []:
        print(f"hal train: restart {restart['restart']}: resumed at step {restart['resumed_at_step']}, "
              f"{restart['redone_steps']} step(s) done again")
    if summary.get("checkpoint_cadence"):
        print(f"hal train: checkpoints: {summary['checkpoint_cadence']['line']}")
    print(f"hal train: log {summary['log_file']}; checkpoint {summary['checkpoint']}")


def _stage_line(stage: dict[str, Any]) -> str:
    """``stage 0 cpu tp2, layers 0-2: computing 81% of the step, peak memory 212 MiB (peak RSS)``."""
    grid = " × ".join(f"{name}{stage[name]}" for name in ("tp", "dp") if stage.get(name, 1) > 1) or "1 device"
    layers = stage.get("layers") or []
    share = stage.get("compute_share")
    busy = "computing: not measured (--profile measures it)" if share is None else f"computing {share:.0%} of the step"
    memory = stage.get("peak_memory_bytes")
    kind = "peak RSS" if stage.get("backend") == "cpu" else "allocator peak"
    held = "peak memory unknown" if memory is None else f"peak memory {_bytes(memory)} ({kind})"
    return (f"stage {stage['stage']} {stage['backend']} {grid}{' sp' if stage.get('sp') else ''}, "
            f"layer{'s' if len(layers) != 1 else ''} {_spans(layers)}: {busy}, {held}")


def _spans(ids: Sequence[int]) -> str:
    """``0-2``, ``0, 2`` or ``0-1, 4-5``: layer ids as runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"


def _during(buckets: float | None) -> str:
    """How much of the exchange began inside the backward (``replica_sync.overlap: on``; nothing when it did not)."""
    return "" if buckets is None else f"; {buckets:.3g} bucket(s) a step begun during the backward"


def _bytes(n: int) -> str:
    """Bytes as MiB, or GiB from 1 GiB on."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _emit(args: argparse.Namespace) -> int:
    """``--emit FORMAT``: the checked run as the cluster's own job on stdout; nothing written, nothing started."""
    from hal.errors import ConfigError
    from hal.parallel.emit import EMITTERS
    from hal.parallel.emit.components import Layout, parse_pairs
    from hal.parallel.loop.job_runner import prepare

    if args.print_multinode is not None:
        raise ConfigError("--emit and --print-multinode both print the run for several nodes; give one")
    layout = Layout(devices_per_node=parse_pairs(args.devices_per_node, "--devices-per-node", as_int=True),  # type: ignore[arg-type]
                    resources=parse_pairs(args.resource, "--resource"),  # type: ignore[arg-type]
                    gres=parse_pairs(args.gres_name, "--gres-name"),  # type: ignore[arg-type]
                    job_name="hal-" + Path(args.config).stem.replace("_", "-").lower())
    job = prepare(args.config, steps=args.steps, resume=args.resume, run_dir=args.run_dir, check_backends=False,
                  init_from=args.init_from, backend=args.backend)
    sys.stdout.write(EMITTERS[args.emit](job, layout))
    return 0


def multinode_lines(job: Any, nodes: int) -> list[str]:
    """The job file as a here-document (run on every node, or once on a shared filesystem), then one
    torchrun command per node block of the plan (static rendezvous: the node rank fixes its ranks); with replicas,
    whole replicas a node where the nodes are few enough."""
    import shlex

    from hal.launch import torchrun
    from hal.parallel.config.job import job_text
    from hal.parallel.loop.job_runner import split_nodes

    marker = "HAL_JOB_EOF"
    lines = [f"# every node (or once on a shared filesystem): write the job file the ranks read; nothing else is needed\n"
             f"mkdir -p {shlex.quote(str(job.run_dir))} && cat > {shlex.quote(str(job.path))} <<'{marker}'\n{job_text(job)}{marker}"]
    topologies = job.topologies()
    for node, ranks in enumerate(split_nodes(topologies, nodes)):
        backends = sorted({next(t for t in topologies if r in t.ranks).backend_of(r) for r in ranks})
        env = {"HAL_BACKEND": backends[0]} if len(backends) == 1 else {}  # mixed node: each rank takes its stage's
        program = ["-m", "hal.parallel.loop.trainer", *job.rank_args()]
        line = torchrun.static_line(nodes, node, len(ranks), program, env)
        replicas = sorted({job.replicas.replica_of(r) for r in ranks}) if job.replicas.several else []
        holds = f"; replica{'s' if len(replicas) > 1 else ''} {', '.join(map(str, replicas))}" if replicas else ""
        which = f"ranks {ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else f"rank {ranks.start}"
        lines.append(f"# node {node}: {which} ({', '.join(backends)}{holds})\n{line}")
    return lines


RANKS_FILE = "ranks.json"


def record_ranks(path: Path, ranks: Sequence[int], pids: Sequence[int]) -> None:
    """``{"host", "ranks": [{"rank", "pid", "name"}]}``: which process is which rank, to ``py-spy dump`` a hung one or
    stop one in a drill; written once every rank has started (atomically), removed when they have ended."""
    import socket

    from hal.rank.name import rank_name
    from hal.run_dirs import write_text_atomic

    doc = {"host": socket.gethostname(),
           "ranks": [{"rank": r, "pid": pid, "name": rank_name(r)} for r, pid in sorted(zip(ranks, pids))]}
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


def spawn_ranks(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], checkpoints: Path | None = None,
                run_dir: Path | None = None) -> int:
    """hal train's spawner: hal.launch's local ranks, ranks' stderr shown live, the failure report printed; while the
    ranks live, ``RUN_DIR/ranks.json`` says which process is which rank (``record_ranks``).

    A rank's stderr is a pipe to here, so the ranks write plain lines; where this process's stderr is a
    terminal, their progress lines are redrawn in place on one line (``parallel.observe.progress.InPlace``),
    ended with a newline before anything else is printed."""
    import os

    from hal.launch import spawn_ranks as spawn
    from hal.parallel.loop.job_runner import REPLICA_ENV
    from hal.parallel.observe.progress import InPlace, on_screen

    from .launch import print_report

    echo = on_screen(sys.stderr)
    # A job of CPU and stand-in ranks forks them from one interpreter that imported torch and the trainer once
    # (hal.launch.zygote): 4 ranks on 2 cores start in seconds, not 4 imports' worth. A device runtime is never
    # forked; a stand-in's is loaded after the fork, by its rank (this process kept PrivateUse1 free: keep_free).
    from hal.backends.standins import kept_free
    from hal.standin import host_backends

    host = host_backends() if kept_free() else {"cpu"}
    preload = ("torch", "torch._dynamo") if all(env.get("HAL_BACKEND") in host for env in envs) else ()
    ranks = [int(env.get("RANK", i)) for i, env in enumerate(envs)]
    record = None if run_dir is None else run_dir / RANKS_FILE
    try:
        report = spawn(commands, [{**os.environ, **env} for env in envs], echo_stderr=echo,  # type: ignore[arg-type]
                       fork_from=preload, started=None if record is None else lambda pids: record_ranks(record, ranks, pids))
    finally:
        if record is not None:
            record.unlink(missing_ok=True)  # the ranks are gone: the record would name other processes
        if isinstance(echo, InPlace):
            echo.close()
    status = print_report(report, "hal train")
    replica_of = {int(env["RANK"]): env[REPLICA_ENV] for env in envs if REPLICA_ENV in env and "RANK" in env}
    if replica_of and report.causes and not report.interrupted:
        first = report.causes[0]
        ranks = sorted(r for r, k in replica_of.items() if k == replica_of.get(first.rank))
        from hal.parallel.state.checkpoint import latest_written

        latest = latest_written(checkpoints)
        stands = f"the last checkpoint written stands ({latest})" if latest else "no checkpoint had been written"
        print(f"hal train: replica {replica_of.get(first.rank)} (ranks {ranks[0]}-{ranks[-1]}) failed first, at its rank "
              f"{first.rank}; every replica was stopped, and {stands}", file=sys.stderr)
    return status
