"""``hal plan --search`` as a library: cluster + profile + cost model + search, the written config, the table.

Why here and not in hal/cli/: the accuracy benchmark and the tests run the same steps without a shell.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, Callable, Sequence

import yaml

from hal.errors import ConfigError
from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.planned import planned_section, profile_label
from hal.parallel.config.run import RunConfig
from hal.parallel.planner.cluster import Cluster, check_holds, load_cluster
from hal.parallel.planner.cost import CostModel
from hal.parallel.planner.device_profile import Profile
from hal.parallel.planner.make_profile import fit_to_host, make_profile
from hal.parallel.planner.profile_store import load_profile
from hal.parallel.planner.replica_search import ReplicaCandidate, ReplicaSearch, sync_cost
from hal.parallel.planner.search import Result, Search, SearchReport, report_dict
from hal.run_dirs import write_text_atomic


def planning_cluster(run: RunConfig, cluster_file: str | None) -> Cluster:
    """The cluster to plan for (``cluster_file``'s, the config's, or the devices present), refused in one line where
    its devices cannot hold the model."""
    from hal.parallel.config.flops import model_parameters

    cluster = load_cluster(run.hal.cluster, run.origin, cluster_file)
    check_holds(cluster, model_parameters(run.model), cluster_file or run.origin)
    return cluster


def planning_inputs(run: RunConfig, cluster_file: str | None, profile_file: str | None,
                    progress: Callable[[str], None] | None = None) -> tuple[Cluster, Profile, CostModel]:
    """The cluster (declared or probed), the profile (given, or measured now in quick mode) and the cost model."""
    cluster = planning_cluster(run, cluster_file)
    seq = run.train.seq_len or run.model.max_seq_len
    if profile_file is not None:
        profile = load_profile(profile_file, run.model, run.hal.precision)
        missing = [t for t in cluster.types if t.device not in profile.devices]
        if missing:  # estimate them beside the measured ones, labelled as every estimate is
            extra = make_profile(Cluster(tuple(missing), cluster.links, cluster.origin), run.model, run.hal.precision, seq,
                                 links=False, progress=progress)
            profile.devices.update(extra.devices)
    else:
        cluster = fit_to_host(cluster, run.model, seq, quick=True, progress=progress)
        profile = make_profile(cluster, run.model, run.hal.precision, seq, quick=True, links=False, progress=progress)
    return cluster, profile, CostModel(cluster, profile, run.model, seq)


def search(run: RunConfig, cluster_file: str | None, profile_file: str | None, top: int,
           progress: Callable[[str], None] | None = None, use_all_types: bool = False) -> tuple[SearchReport, CostModel]:
    cluster, profile, cost = planning_inputs(run, cluster_file, profile_file, progress)
    report = Search(cost, run.plan, progress=progress, use_all_types=use_all_types).run(top)
    if len(cluster.types) > 1:
        replicas = ReplicaSearch(cost, run.plan, progress=progress)
        report.replicas = [c for c in replicas.run(top) if not use_all_types or c.type_count == len(cluster.types)]
        report.notes += replicas.notes
        report.notes.append(family_note(report, replicas))
    if not profile_file:
        report.notes.append("no --profile: the devices present were measured now in quick mode (hal profile measures more)")
    if cluster.probed:
        report.notes.append("no cluster declared: planned for the devices present")
    report.notes += list(cluster.notes)  # the probe's: a backend it could not read, a type left out
    moe = moe_note(run)
    if moe:
        report.notes.append(moe)
    unfused = unfused_head_note([run.plan], profile)
    if unfused:
        report.notes.append(unfused)
    left_out = left_out_note(report, cluster)
    if left_out and not use_all_types:
        report.notes.append(left_out)
    shared = [t.device for t in cluster.types if t.is_cpu and t.per_node > 1 and t.device in profile.devices
              and not profile.devices[t.device].estimated and not profile.devices[t.device].contention]
    if shared:
        report.notes.append(f"{', '.join(shared)}: ranks sharing a node's cores without calibration — each busy rank is "
                            "assumed to get its share of the cores; hal profile calibrates the slowdown with real "
                            "pipeline runs (pass its file with --profile)")
    return report, cost


def unfused_head_note(plans: list[ParallelPlan], profile: Profile) -> str | None:
    """Said where a fused-head plan is priced with the plain head: a profile written before the fused one was timed."""
    if not any(p.fused_head for p in plans):
        return None
    lacking = sorted(d for d, p in profile.devices.items() if p.fused_head is None)
    if not lacking:
        return None
    return (f"{', '.join(lacking)}: the profile has no fused-head measurement (written before hal profile timed it), so "
            "the last stage's head is priced as the plain head with its full logits; run hal profile again")


def preferred(report: SearchReport) -> str:
    """The family of the fastest predicted plan: "replicas" or "stages"."""
    if report.replicas and (not report.results or report.replicas[0].step_s < report.results[0].prediction.step_s):
        return "replicas"
    return "stages"


def family_note(report: SearchReport, replicas: ReplicaSearch) -> str:
    """Which family the cost model prefers and why, with the fastest device type alone beside them."""
    if not report.replicas:
        return ("replica plans: none — no device type trains a share of the global batch on its own (memory, or rows "
                "that do not split); the stage plans above are the only ones")
    rep = report.replicas[0]
    sync = rep.sync
    how = f"every {sync.every} steps" if sync.every > 1 else "every step"
    why_rep = (f"replica plan R1: the slowest replica steps in {rep.compute_s:.4g} s and the bridge carries "
               f"{sync.bridge_bytes / 1e9:.3g} GB a replica {how} over {sync.stripes} pair(s) in {sync.seconds:.4g} s "
               f"({sync.seconds / rep.step_s:.0%} of its step, not overlapped with the backward)")
    parts = [why_rep]
    if report.results:
        best = report.results[0].prediction
        parts.append(f"stage plan #1: idle share {best.bubble_overall:.0%}, bound by {best.bound}")
        stages_s = best.step_s
    else:
        stages_s = math.inf
    alone = replicas.fastest_alone()
    if alone is not None and alone[1].prediction.step_s <= min(rep.step_s, stages_s):
        parts.append(f"{alone[0].count}× {alone[0].device} alone predicts {alone[1].prediction.step_s:.4g} s: adding the "
                     "other islands does not speed this job up")
    family = preferred(report)
    faster = rep.step_s if family == "replicas" else stages_s
    slower = stages_s if family == "replicas" else rep.step_s
    ratio = f"{slower / faster:.2f}× " if math.isfinite(slower) else ""
    return f"the cost model prefers {family} ({ratio}faster predicted step): " + "; ".join(parts)


def moe_note(run: RunConfig) -> str | None:
    """What the search's cost model leaves out of an MoE model, said beside its plans."""
    if not run.model.is_moe:
        return None
    return ("MoE model: ep is searched (the experts sharded over ep of a stage's dp ranks: their memory, and each MoE "
            "layer's four exchanges as bytes over the stage's link with balanced routing); not modelled: uneven "
            "routing, and on CUDA the symmetric exchange's buffers (up to 2 x 512 MiB staging and "
            "HAL_MOE_EXCHANGE_POOL_MIB, 1 GiB by default, an exchange shape) -- benchmarks/moe.py measures both")


def left_out_note(report: SearchReport, cluster: Cluster) -> str | None:
    """Which device types the top plan leaves idle, said: half a cluster doing nothing needs its reason on screen."""
    if not report.results:
        return None
    used = {kind.device for kind in report.results[0].placement.kinds}
    idle = [t for t in cluster.types if t.device not in used]
    if not idle:
        return None
    return (f"plan #1 leaves out {', '.join(f'{t.count}× {t.device}' for t in idle)}: the plans giving "
            f"{'it' if len(idle) == 1 else 'them'} stages ranked slower (--use-all-types: every type holds a stage)")


def write_plan(run: RunConfig, result: Result, path: str | os.PathLike[str], cost: CostModel,
               profile: str | None = None) -> None:
    """The config with its parallel: section replaced by the chosen plan: ``hal train PATH`` runs it as is.
    Its ``planned:`` section keeps the prediction (``planner.planned``; ``profile``: the file it came from)."""
    with open(run.origin, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    data["parallel"] = result.plan.to_dict()
    data["planned"] = planned_section(result.plan, result.prediction, profile_label(profile))
    # hal train refuses a top-level backend its stages contradict: the plan's own, or none where it mixes backends
    backends = sorted({stage.backend for stage in result.plan.stages})
    if "backend" in data and data["backend"] != "auto":
        if len(backends) == 1:
            data["backend"] = backends[0]
        else:
            del data["backend"]
    p = result.prediction
    head = [f"# written by hal plan --search from {run.origin}: predicted {p.step_s:.4g} s a step, "
            f"{p.tokens_per_s:,.0f} tokens/s, idle share {p.bubble_overall:.1%}, bound by {p.bound}",
            f"# stages on: {', '.join(k.device for k in result.placement.kinds)}"]
    if p.estimated:
        head.append(f"# ESTIMATED (not measured): {'; '.join(p.estimated)}")
    write_text_atomic(path, "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False))


def write_replicas(run: RunConfig, candidate: ReplicaCandidate, path: str | os.PathLike[str]) -> None:
    """The config with its parallel: section replaced by the replica plan (exact sync every step)."""
    from hal.parallel.config.replicas import ReplicaSync

    with open(run.origin, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    data["parallel"] = candidate.replicated(ReplicaSync()).to_dict()
    data.pop("planned", None)  # a stage plan's prediction: not this plan's
    if "backend" in data and data["backend"] != "auto":
        backends = sorted({s.backend for r in candidate.results for s in r.plan.stages})
        if len(backends) == 1:
            data["backend"] = backends[0]
        else:
            del data["backend"]
    head = [f"# written by hal plan --search from {run.origin}: replicas, predicted {candidate.step_s:.4g} s a step, "
            f"{candidate.tokens_per_s:,.0f} tokens/s, cross-island sync {candidate.sync.seconds:.4g} s a step",
            f"# replicas on: {', '.join(candidate.devices)}; their ranks are consecutive, replica 0 first"]
    write_text_atomic(path, "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def stage_text(result: Result) -> str:
    parts = []
    for stage, kind in zip(result.plan.stages, result.placement.kinds):
        grid = (f"tp{stage.tp}" + ("+sp" if stage.sp else "") + (f" dp{stage.dp}" if stage.dp > 1 else "")
                + (f" ep{stage.ep}" if stage.ep > 1 else ""))
        layers = stage.layers if isinstance(stage.layers, int) else "+".join(map(str, stage.layers))
        parts.append(f"{kind.device}×{stage.devices}[{grid} L{layers}{' rc' if stage.checkpoint else ''}]")
    return " → ".join(parts)


def _order_note(p: Any) -> str:
    """Where a result was predicted with the measured-time order hal train will keep: that, and its gain."""
    order = getattr(p, "order", None)
    if not order or order["chosen"] != "measured":
        return ""
    return f"  measured-time order ({order['unit_step_s'] / order['measured_step_s']:.3f}x the unit order's schedule)"


def format_search(report: SearchReport, cost: CostModel) -> str:
    data = report_dict(report, cost)
    lines = [f"hal plan --search: {cost.cluster.device_count} device(s) ({', '.join(f'{t.count}× {t.device}' for t in cost.cluster.types)}), "
             f"{report.considered} candidates ranked by the closed form, best {report.confirmed} re-predicted with the "
             f"schedule simulator, {report.pruned_memory} dropped for memory; {report.seconds:.2f} s"]
    for i, r in enumerate(report.results, 1):
        p, plan = r.prediction, r.plan
        mem: dict[str, tuple[int, int | None]] = {}
        for s in p.stages:
            have = mem.get(s.device, (0, s.capacity_bytes))
            mem[s.device] = (max(have[0], s.memory_bytes), s.capacity_bytes)
        memory = ", ".join(f"{d} {_gib(m)} GiB" + (f" of {_gib(c)}" if c else "") for d, (m, c) in mem.items())
        lines += ["", f"#{i}  {p.tokens_per_s:,.0f} tokens/s  step {p.step_s:.4g} s  idle {p.bubble_overall:.1%}  "
                      f"{plan.schedule}{f' V={plan.virtual_stages}' if plan.virtual_stages > 1 else ''}  "
                      f"{plan.micro_batches} × {plan.micro_batch_size} rows{'  zero1' if plan.zero1 else ''}"
                      + _order_note(p),
                  f"    {stage_text(r)}", f"    memory a rank: {memory}; bound by {p.bound}"]
        if p.estimated:
            lines.append(f"    ESTIMATED: {'; '.join(p.estimated)}")
    if report.replicas:
        lines += ["", "replica plans (each device type — or, in a mixed replica (a+b), a pipeline over several types — "
                      "trains a whole replica on its share of the batch; gradients meet over the bridge every step):"]
    for i, c in enumerate(report.replicas, 1):
        shares = " + ".join(f"{d} {n}" for d, n in zip(c.devices, c.rows))
        lines += ["", f"R{i}  {c.tokens_per_s:,.0f} tokens/s  step {c.step_s:.4g} s  (slowest replica {c.compute_s:.4g} s "
                      f"+ sync {c.sync.seconds:.4g} s over {c.sync.stripes} pair(s))  rows {shares}"]
        if i == 1:  # what compression and local SGD would change (the same replicas and shares)
            bf16 = sync_cost(cost, c.results, compress="bf16")
            fp8 = sync_cost(cost, c.results, compress="fp8")
            local = sync_cost(cost, c.results, every=8)
            lines.append(f"    sync variants: bf16 on the wire {bf16.seconds:.4g} s (step {c.compute_s + bf16.seconds:.4g} s); "
                         f"fp8 {fp8.seconds:.4g} s (step {c.compute_s + fp8.seconds:.4g} s); "
                         f"local SGD every 8 steps {local.seconds:.4g} s a step (step {c.compute_s + local.seconds:.4g} s; "
                         "trains differently from the single device)")
        for d, r in zip(c.devices, c.results):
            plan = r.plan
            lines.append(f"    {d}: {r.prediction.step_s:.4g} s  {plan.schedule}"
                         f"{f' V={plan.virtual_stages}' if plan.virtual_stages > 1 else ''}  {plan.micro_batches} × "
                         f"{plan.micro_batch_size} rows{'  zero1' if plan.zero1 else ''}  {stage_text(r)}")
    for note in data["notes"]:
        lines.append(f"\nnote: {note}")
    return "\n".join(lines)


def as_json(report: SearchReport, cost: CostModel) -> dict[str, Any]:
    return {**report_dict(report, cost), "preferred": preferred(report)}


def holding_the_plans(cluster: Cluster, plans: Sequence[ParallelPlan]) -> tuple[Cluster, list[str]]:
    """The cluster with room for the config's own plans, placed as ``Placement.pack`` places them, and what was
    widened: a probed host's cpu takes every cpu rank the plans ask for (they share its cores, as hal train runs them);
    any other type short of devices is one line (it crashed the pricing: an IndexError in the cost model)."""
    from hal.parallel.planner.replica_search import stage_kinds

    needed: dict[str, int] = {}
    for plan in plans:
        used: dict[str, int] = {}
        for stage, kind in zip(plan.stages, stage_kinds(cluster, plan)):
            used[kind.device] = used.get(kind.device, 0) + stage.devices
        for device, n in used.items():
            needed[device] = max(needed.get(device, 0), n)
    types, notes = [], []
    for kind in cluster.types:
        want = needed.get(kind.device, 0)
        if want <= kind.count:
            types.append(kind)
        elif kind.is_cpu and cluster.probed and len(kind.nodes) == 1:
            types.append(replace(kind, nodes=((kind.nodes[0][0], want),)))
            notes.append(f"the plan's {want} cpu ranks share this host's {kind.cores or kind.count} cores, as hal train runs them")
        else:
            raise ConfigError(f"the config's plan puts {want} ranks on {kind.device} but the cluster ({cluster.origin}) has "
                              f"{kind.count}; give --cluster with enough of them")
    return replace(cluster, types=tuple(types)), notes


def predict_config(run: RunConfig, cluster_file: str | None, profile_file: str, *,
                   islands_apart: bool = False, priced_with: str | None = None) -> dict[str, Any]:
    """``hal plan --profile P`` without ``--search``: what the cost model predicts for the config's own plan — one plan,
    or its replicas and their sync (``rows: auto`` shared by the predicted speeds, as the search shares them).
    ``islands_apart``: every replica its own island (``HAL_ISLANDS`` set): the sync crosses the bridge.
    ``priced_with``: how the notes name the profile (default: its path)."""
    from hal.parallel.config.replicas import shares_by_speed
    from hal.parallel.planner.cost import Placement
    from hal.parallel.planner.replica_search import predict_replicas, stage_kinds

    cluster, profile, cost = planning_inputs(run, cluster_file, profile_file)
    plans = run.replicas.plans()
    cluster, shared = holding_the_plans(cluster, plans)
    cost = CostModel(cluster, profile, run.model, cost.seq)
    notes = [f"priced with {priced_with or profile_file} on {cluster.origin}", *shared]
    unfused = unfused_head_note(plans, profile)
    if unfused:
        notes.append(unfused)
    odd = sorted({s.precision for p in plans for s in p.stages if s.precision and s.precision != run.hal.precision})
    if odd:
        notes.append(f"stage precision {', '.join(odd)} priced at the profile's {run.hal.precision} (hal profile of a "
                     "config at that precision times it)")

    if not run.replicas.several:
        plan = run.replicas.plan
        prediction = cost.predict(plan, Placement.pack(plan, stage_kinds(cluster, plan)), measured_order=True)
        return {"prediction": prediction.to_dict(), "notes": notes}
    rep = run.replicas
    if not rep.resolved:  # rows: auto -> each auto replica's predicted speed on the whole batch, as the search shares
        speeds = []
        for r in rep.replicas:
            whole = replace(r.plan, micro_batches=max(1, rep.global_batch // r.plan.micro_batch_size))
            speeds.append(whole.global_batch_size / cost.predict(whole, Placement.pack(whole, stage_kinds(cluster, whole))).step_s)
        rows = shares_by_speed(rep, speeds)
        rep = rep.with_rows(rows)
        notes.append(f"rows: auto shared by predicted speed: {' + '.join(map(str, rows))} (hal train measures them at start)")
    candidate = predict_replicas([cost] * len(rep.replicas), [r.plan for r in rep.replicas],
                                 [r.rows or 0 for r in rep.replicas], bridged=True if islands_apart else None,
                                 every=rep.sync.every, compress=rep.sync.compress)
    if rep.sync.overlap == "on":
        notes.append("replica_sync.overlap: on is not priced (the sync is added after the slowest replica's step)")
    notes.append("each replica its own island (HAL_ISLANDS): the sync crosses the bridge" if islands_apart else
                 "islands by backend (as hal train forms them without HAL_ISLANDS): replicas of one backend sum over "
                 "its own library")
    return {"step_s": candidate.step_s, "tokens_per_s": candidate.tokens_per_s, "compute_s": candidate.compute_s,
            "sync_s": candidate.sync.seconds, "bridge_bytes": candidate.sync.bridge_bytes,
            "stripes": candidate.sync.stripes, "rows": list(candidate.rows),
            "replicas": [r.prediction.to_dict() for r in candidate.results], "notes": notes}
