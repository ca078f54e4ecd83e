"""``hal profile --config F``: measure the device types present, estimate the rest, write the planner's profile file."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .common import add_config_argument, config_path

NAME = "profile"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help="measure one decoder layer, the embedding, head, optimizer and links per device type (planner input)",
        description="For the model and precision of CONFIG: time one decoder layer's forward and backward and its "
        "activation memory (a few micro-batch sizes, recompute off and on), the embedding, the head with the loss, "
        "AdamW per parameter and the P2P links, on every device type of the cluster that this host has (the layers "
        "compiled where the config's plan compiles them); device types "
        "it lacks are ESTIMATED from the catalog and labelled so. Writes a JSON file for hal plan --search --profile.",
    )
    add_config_argument(p, "YAML config with model:, parallel: and train: sections", required=True)
    p.add_argument("--cluster", metavar="C", help="a YAML file with a cluster: section (default: the config's, else the devices present)")
    p.add_argument("--out", metavar="P", default="profile.json", help="where the profile goes (default profile.json)")
    p.add_argument("--quick", action="store_true", help="fewer points and one repeat, no link measurement (tests, a first look)")
    p.add_argument("--no-links", action="store_true", help="skip the P2P measurements (the cluster's link figures are used)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hal.launch import run_function
    from hal.parallel.loop.preflight import PROFILE, Request, preflight
    from hal.parallel.planner.cluster import load_cluster
    from hal.parallel.planner.make_profile import fit_to_host, make_profile
    from hal.run_dirs import check_creatable_file

    check_creatable_file(Path(args.out), "--out")  # before minutes of measuring, not after
    path = config_path(args)
    config = preflight(Request(path, local=False, writes=False), PROFILE).loaded
    cluster = load_cluster(config.hal.cluster, config.origin, args.cluster)
    seq = config.train.seq_len or config.model.max_seq_len
    cluster = fit_to_host(cluster, config.model, seq, quick=args.quick, progress=_progress)
    compiled = [p.compile_backend for _, p in config.plans() if any(p.stage_compiles(k) for k in range(p.num_stages))]
    profile = make_profile(cluster, config.model, config.hal.precision, seq, quick=args.quick,
                           links=not (args.quick or args.no_links), progress=_progress, fallback=config.hal.fallback,
                           launch=run_function, compile_backend=compiled[0] if compiled else None)  # any replica's
    profile.save(args.out)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
    else:
        print(format_profile(profile.to_dict()))
    _progress(f"wrote {args.out} in {profile.meta['seconds']:.1f} s")
    return 0


def _progress(message: str) -> None:
    print(f"hal profile: {message}", file=sys.stderr, flush=True)


def format_profile(data: dict[str, Any]) -> str:
    """One block per device type (measured or ESTIMATED, and on what basis), then the links."""
    lines = [f"profile for model {data['model_key']} at {data['precision']}, sequence {data['seq']}"]
    for name, d in data["devices"].items():
        label = "measured" if d["source"] == "measured" else "ESTIMATED"
        lines += ["", f"{name} ({d['backend']}): {label} — {d['basis']}"]
        clocks = any(p.get("host_forward_s") is not None for p in d["layers"])
        lines.append(f"  {'tp':>4} {'rows':>4} {'recompute':>9} {'forward ms':>10} {'backward ms':>11} {'activations KiB':>15}"
                     + (f"  {'host f/b ms':>13}  {'device f/b ms':>13}" if clocks else ""))
        for p in d["layers"]:
            both = ""
            if clocks and p.get("host_forward_s") is not None:  # an accelerator's two clocks: which one sets the pace
                host, device = p["host_forward_s"] + p["host_backward_s"], p["device_forward_s"] + p["device_backward_s"]
                both = (f"  {p['host_forward_s'] * 1e3:>6.3f}/{p['host_backward_s'] * 1e3:<6.3f}"
                        f"  {p['device_forward_s'] * 1e3:>6.3f}/{p['device_backward_s'] * 1e3:<6.3f}"
                        + ("  host-bound" if host > device else ""))
            tp = f"{p['tp']}{'sp' if p.get('sp') else ''}"
            lines.append(f"  {tp:>4} {p['rows']:>4} {('on' if p['recompute'] else 'off'):>9} {p['forward_s'] * 1e3:>10.3f} "
                         f"{p['backward_s'] * 1e3:>11.3f} {p['activation_bytes'] / 1024:>15.1f}" + both)
        e, h = d["embedding"], d["head"]
        lines.append(f"  embedding {e['forward_s'] * 1e6:.3f} / {e['backward_s'] * 1e6:.3f} µs a token; head + loss "
                     f"{h['forward_s'] * 1e6:.3f} / {h['backward_s'] * 1e6:.3f} µs a token (forward / backward); AdamW "
                     f"{d['optimizer_s_per_param'] * 1e9:.2f} ns a parameter"
                     + (f"; {d['achieved_tflops']:.3g} TFLOP/s" if d.get("achieved_tflops") else "")
                     + (f" ({d['efficiency']:.1%} of peak)" if d.get("efficiency") else "")
                     + (" [estimated]" if d["source"] != "measured" else ""))
        if d.get("weight_share") is not None:
            split = d.get("split_cost")
            takes = ("" if not split else f"{split[0]:.2f}x the time" if d["backend"] == "cpu"  # one clock on the cpu
                     else f"{split[0]:.2f}x the host time and {split[1]:.2f}x the device time")
            lines.append(f"  zero-bubble split: the weight half is {d['weight_share']:.0%} of a layer's backward"
                         + (f"; the split layer takes {takes} of the whole one" if split else "")
                         + (" (from a measured device)" if d["source"] != "measured" else ""))
        if d.get("action_host_s"):
            lines.append(f"  the engine's host work: {d['action_host_s'] * 1e6:.1f} µs a compute action (calibration pipeline)")
        if d.get("contention"):
            points = [f"{p[0]:.2f} → {p[1]:.2f}×" + (f" + {p[2] * 1e3:.2f} ms an action" if len(p) > 2 and p[2] else "")
                      for p in sorted(d["contention"])]
            lines.append(f"  in a run on a shared node (occupancy → slowdown): {'; '.join(points)}")
        if d.get("tp_all_reduce") and len(d["tp_all_reduce"]) > 1:
            last = sorted(d["tp_all_reduce"])[-1]
            sp = f", an sp exchange {last[2] * 1e3:.2f} ms" if len(last) > 2 else ""
            lines.append(f"  tp at occupancy {last[0]:.2f}: an all-reduce waits {last[1] * 1e3:.2f} ms{sp}")
    for name, link in data["links"].items():
        lines.append(f"link {name}: {link['bandwidth_gbps']:.2f} GB/s, {link['latency_us']:.1f} µs ({link['source']}: {link['basis']})")
        loaded = link.get("loaded_collectives") or {}
        if loaded:
            size = link["loaded_sizes"][1] / 2**20
            what = ("the replicas' bucket sum across it" if link["kind"] == "bridge"
                    else "dp-sync collectives with every pair at once")
            rate = (f" ({link['loaded_sizes'][1] / max(loaded['all_reduce'][1], 1e-9) / 1e9:.2f} GB/s)"
                    if link["kind"] == "bridge" and "all_reduce" in loaded else "")
            lines.append(f"  {what}, {size:g} MiB: " + ", ".join(f"{op} {t[1] * 1e3:.1f} ms" for op, t in loaded.items())
                         + rate)
    if data["estimated"]:
        lines.append(f"\nestimated (not measured): {', '.join(data['estimated'])}")
    return "\n".join(lines)
