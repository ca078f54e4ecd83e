"""Make a profile for a cluster: measure the device types this host has, estimate the others, measure the links.

Why one place: ``hal profile`` and ``hal plan --search`` (which profiles the present devices itself when
given no ``--profile``) must agree on what is measured and what is estimated.
"""
from __future__ import annotations

import dataclasses
import platform
import time
from typing import Any, Callable

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.planner.calibrate import STEPS as CALIBRATION_STEPS
from hal.parallel.planner.calibrate import calibrate_host, calibrate_node, calibrate_tp
from hal.parallel.planner.cluster import Cluster, DeviceType
from hal.parallel.planner.device_profile import DeviceProfile, LinkProfile, Profile
from hal.parallel.planner.estimate import estimate_device
from hal.parallel.planner.measure import LINK_SIZES, TP_DEGREE, measure_device, measure_link, measure_node_links, measure_tp_layers

QUICK_ROWS, ROWS = (1, 2), (1, 2, 4)
QUICK_CALIBRATION_STEPS = 3  # timed steps a calibration pipeline runs under quick (calibrate.STEPS otherwise)
MAX_QUICK_LAYER_FLOPS = 5e11  # a present device is measured only when one layer's forward at the largest point is below this
# ... and a probed host's cpu beside accelerators only below this: its calibration pipelines run the layer on a rank a
# core, minutes for a GPU-sized layer (1.2B model, 1 x H200 host: past 200 s), for a type the plan would not use
MAX_CPU_BESIDE_ACCELERATORS_FLOPS = 5e10


def present(kind: DeviceType) -> bool:
    """Whether this host runs ``kind`` (its backend is available and its device 0 is that catalog model)."""
    from hal.backend_registry import get_backend

    backend = get_backend(kind.backend)
    if not backend.is_available() or backend.device_count() == 0:
        return False
    return backend.capabilities(0).catalog_id == kind.device


def cpu_threads(kind: DeviceType) -> int:
    """Threads each cpu rank computes with in a run (hal train: the node's cores over its ranks)."""
    return max(1, (kind.cores or 1) // kind.per_node)


def make_profile(cluster: Cluster, model: ModelConfig, precision: str, seq: int, *, quick: bool = False,
                 links: bool = True, repeats: int | None = None, progress: Callable[[str], None] | None = None,
                 fallback: str = "warn", launch: Callable[..., Any] | None = None, calibrate: bool = True,
                 compile_backend: str | None = None, calibration_steps: int | None = None) -> Profile:
    """Measure every device type of ``cluster`` present here, estimate the rest from the catalog; the links too.

    A cpu node with several ranks also gets its in-run slowdown (``planner.calibrate``) unless ``calibrate``
    is off or no ``launch`` is given.

    ``launch`` (``hal.launch.run_function``) starts the two ranks a link is timed between; links are measured
    only when it is given (the command hands it in: the launcher is above this floor). ``compile_backend``: the
    layers are timed compiled (a plan that compiles them runs another program); the calibration pipelines stay
    eager — they measure the node's slowdown and the engine's own work, ratios and per-action costs the layer's
    program does not set. ``calibration_steps``: timed steps of each calibration pipeline (the median is kept;
    default 5, 3 under ``quick``)."""
    from hal.backend_registry import get_backend
    from hal.precision import resolve_precision

    say = progress or (lambda _: None)
    started = time.monotonic()
    rows = QUICK_ROWS if quick else ROWS
    for kind in cluster.types:  # before any measuring (``fit_to_host`` leaves such a type out of a probed cluster)
        if present(kind):
            _check_size(model, seq, max(rows), kind)
    reps = repeats or (1 if quick else 3)
    steps = calibration_steps or (QUICK_CALIBRATION_STEPS if quick else CALIBRATION_STEPS)
    measured_links: dict[str, LinkProfile] = {}
    if links and launch is not None and any(k.is_cpu and present(k) for k in cluster.types):
        ranks = max((k.per_node for k in cluster.types if k.is_cpu and present(k)), default=1)
        say("cpu: P2P inside one island and across the bridge (two declared islands)"
            + (f", then dp-sync collectives, {ranks - ranks % 2} ranks in pairs at once" if ranks >= 2 else "")
            + " (one launch)")
        island, bridge, loaded = measure_node_links("cpu", ranks, launch)
        measured_links["cpu-bridge"] = bridge
        if loaded is not None:
            island = dataclasses.replace(
                island, loaded_collectives=loaded, loaded_sizes=LINK_SIZES,
                basis=island.basis + f"; {', '.join(loaded)} between 2 ranks with every pair of {ranks - ranks % 2} at once")
        measured_links["cpu-island"] = island
    if links and launch is not None:
        for backend_name in _bridgeable(cluster):  # an accelerator's host-staged bridge: what replicas' gradients cross
            say(f"{backend_name}: P2P across the bridge (two declared islands, host-staged)")
            measured_links[f"{backend_name}-bridge"] = measure_link(backend_name, True, launch)
    devices: dict[str, DeviceProfile] = {}
    beside_accelerators = cluster.probed and any(not k.is_cpu and present(k) for k in cluster.types)
    for kind in cluster.types:
        if not present(kind):
            continue
        backend = get_backend(kind.backend)
        plan = resolve_precision(precision, backend, backend.capabilities(0), fallback)  # type: ignore[arg-type]
        plan.apply(backend)
        measured = measure_device(
            backend, model, seq=seq, rows=rows, autocast=lambda b=backend, p=plan: p.autocast(b), precision=precision,
            repeats=reps, threads=cpu_threads(kind) if kind.is_cpu else None, progress=say, compile_backend=compile_backend)
        if kind.is_cpu and kind.per_node > 1 and launch is not None and calibrate and beside_accelerators:
            say(f"cpu: not calibrated beside the accelerators ({kind.per_node} ranks' calibration pipelines take "
                "minutes on a GPU host's cores; the cost model assumes each rank gets its share of the cores): declare "
                "a cluster: section to calibrate it")
        elif kind.is_cpu and kind.per_node > 1 and launch is not None and calibrate:
            say(f"cpu: calibration pipelines of {kind.per_node} rank(s) sharing {kind.cores} core(s)")
            boundary = boundary_time(cluster, kind, measured_links, model, seq)
            points = calibrate_node(measured, model, ranks=kind.per_node, cores=kind.cores or 1, threads=cpu_threads(kind),
                                    rows=max(rows), seq=seq, launch=launch, boundary=boundary, steps=steps)
            measured = dataclasses.replace(measured, contention=points)
            if splits_over_tp(model):
                tp_points = calibrate_tp(measured, model, ranks=kind.per_node, cores=kind.cores or 1,
                                         threads=cpu_threads(kind), rows=max(rows), seq=seq, launch=launch, boundary=boundary,
                                         steps=steps)
                measured = dataclasses.replace(measured, tp_all_reduce=tp_points)
            else:
                say(f"cpu: no tp {TP_DEGREE} calibration: {_no_tp(model)}")
            measured = dataclasses.replace(measured, basis=measured.basis + "; in-run slowdown and waits from "
                                           "calibration pipelines")
        elif not kind.is_cpu and launch is not None and calibrate and backend.device_count() >= TP_DEGREE \
                and splits_over_tp(model):
            say(f"{kind.device}: one layer at tp {TP_DEGREE} (sp off and on) on {TP_DEGREE} devices")
            tp_layers = measure_tp_layers(kind.backend, model, seq=seq, rows=rows, precision=precision, repeats=reps,
                                          launch=launch, fallback=fallback, compile_backend=compile_backend)
            measured = dataclasses.replace(measured, layers=measured.layers + tp_layers)
            say(f"{kind.device}: calibration pipeline (the engine's host work per action)")
            per_action = calibrate_host(measured, cluster, kind, model, precision=precision, seq=seq, launch=launch,
                                        fallback=fallback, steps=steps)
            measured = dataclasses.replace(measured, action_host_s=per_action,
                                           basis=measured.basis + f"; tp {TP_DEGREE} layers measured with their group; "
                                           "the engine's host work from a calibration pipeline")
        devices[kind.device] = measured
    reference = Profile(model.to_dict(), precision, dict(devices), seq=seq)
    for kind in cluster.types:
        if kind.device not in devices:
            say(f"{kind.device}: not on this host — estimated from the catalog")
            devices[kind.device] = estimate_device(kind, model, precision, seq, reference)
    meta = {"torch": _torch_version(), "host": platform.node(), "quick": quick, "repeats": reps, "compiled_layers": compile_backend,
            "seconds": round(time.monotonic() - started, 2), "cluster": cluster.origin}
    return Profile(model.to_dict(), precision, devices, measured_links, seq, meta)


def splits_over_tp(model: ModelConfig) -> bool:
    """Whether the model splits over ``TP_DEGREE`` ranks (heads, kv heads and widths divisible): its tp layers can be
    timed; a model that cannot run tp has no tp points to measure."""
    return _no_tp(model) is None


def _no_tp(model: ModelConfig) -> str | None:
    sizes = {"num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads, "hidden_size": model.hidden_size,
             "ffn_hidden_size": model.ffn_hidden_size, "vocab_size": model.vocab_size}
    odd = [f"model.{k} {v}" for k, v in sizes.items() if v % TP_DEGREE]
    return f"{', '.join(odd)} not divisible by {TP_DEGREE}" if odd else None


def _bridgeable(cluster: Cluster) -> list[str]:
    """Accelerator backends present here with two devices or more: their bridge between two islands can be timed."""
    from hal.backend_registry import get_backend

    out = []
    for kind in cluster.types:
        if kind.is_cpu or not present(kind) or kind.backend in out:
            continue
        if get_backend(kind.backend).device_count() >= 2:
            out.append(kind.backend)
    return out


def boundary_time(cluster: Cluster, kind: DeviceType, links: dict[str, LinkProfile], model: ModelConfig,
                  seq: int) -> Callable[[int], float]:
    """Seconds to send a micro-batch of ``rows`` rows' boundary activations between two ranks of ``kind`` on one
    node, timed as the cost model will time them (the measured island link where there is one, else the cluster's
    figure): a calibration pipeline's transfers are played with it, so its fitted waits do not count them twice."""
    from hal.parallel.planner.cost import BOUNDARY_BYTES, transfer_s

    bw, latency = cluster.between(kind, kind, True)
    gbps, lat = bw.value, latency.value
    island = links.get("cpu-island") if kind.is_cpu else None
    if island is not None:  # as ``CostModel.link``: a measured island replaces a default figure, not a declared one
        gbps = island.bandwidth_gbps if bw.source == "default" else gbps
        lat = island.latency_us if latency.source == "default" else lat
    return lambda rows: transfer_s(rows * seq * model.hidden_size * BOUNDARY_BYTES, gbps, lat)


def _layer_flops(model: ModelConfig, seq: int, rows: int) -> float:
    from hal.parallel.config.memory import layer_parameters

    return 2.0 * layer_parameters(model) * rows * seq


def _too_big(model: ModelConfig, seq: int, rows: int, kind: DeviceType) -> bool:
    """Whether one layer's forward at ``rows`` rows is too much to time in seconds on ``kind`` (the cpu)."""
    return kind.is_cpu and _layer_flops(model, seq, rows) > MAX_QUICK_LAYER_FLOPS


def _check_size(model: ModelConfig, seq: int, rows: int, kind: DeviceType) -> None:
    """Refuse, before allocating, a layer too big to time in seconds on this host (a 70B layer on a laptop cpu)."""
    if _too_big(model, seq, rows, kind):
        raise ConfigError(f"hal profile: one layer of this model at {rows} row(s) × {seq} tokens is "
                          f"{_layer_flops(model, seq, rows):.2g} FLOPs, too much to time on the cpu (limit "
                          f"{MAX_QUICK_LAYER_FLOPS:.0e}); profile with a shorter train.seq_len, or plan with the cpu left "
                          "out of the cluster")


def fit_to_host(cluster: Cluster, model: ModelConfig, seq: int, *, quick: bool = False,
                progress: Callable[[str], None] | None = None) -> Cluster:
    """The cluster this host can profile, decided before anything is measured: in a probed cluster (no cluster
    declared), a present type whose layer is too big to time here (the host's cpu beside GPUs, for a GPU-sized model)
    is left out, said with how to include it; a declared type, or the only one, that is too big is refused (one
    line). Why up front: the alternative measured the GPUs for a minute, then refused at the cpu."""
    rows = max(QUICK_ROWS if quick else ROWS)
    big = [k for k in cluster.types if present(k) and _too_big(model, seq, rows, k)]
    beside = cluster.probed and any(not k.is_cpu for k in cluster.types)
    slow = [k for k in cluster.types if beside and k.is_cpu and k not in big and present(k)
            and _layer_flops(model, seq, rows) > MAX_CPU_BESIDE_ACCELERATORS_FLOPS]
    if not big and not slow:
        return cluster
    kept = tuple(k for k in cluster.types if k not in big and k not in slow)
    if big and (not cluster.probed or not kept):
        _check_size(model, seq, rows, big[0])
    flops = f"{_layer_flops(model, seq, rows):.2g} FLOPs"
    notes = tuple(f"{kind.device}: one layer at {rows} row(s) × {seq} tokens is {flops}, too much to time here: left "
                  "out of the probed cluster (to plan with it, declare a cluster: section and profile it at a shorter "
                  "train.seq_len)" for kind in big)
    notes += tuple(f"{kind.device}: one layer at {rows} row(s) × {seq} tokens is {flops}, beyond what the host's cpu "
                   f"beside the accelerators is timed for ({MAX_CPU_BESIDE_ACCELERATORS_FLOPS:.0e}: its calibration "
                   "pipelines would take minutes): left out of the probed cluster (to plan with it, declare a cluster: "
                   "section with it)" for kind in slow)
    for note in notes:
        (progress or (lambda _: None))(note)
    return dataclasses.replace(cluster, types=kept, notes=cluster.notes + notes)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
