"""``hal devices``: every registered backend — available or not and why, devices, CCL, verification."""
from __future__ import annotations

import argparse
import json
from typing import Any

from .common import add_standin_argument, gib

NAME = "devices"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(NAME, help="list every backend: available or not and why, devices, CCL, verification")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_standin_argument(p)
    p.set_defaults(func=run)


def _device_rows(backend: Any) -> list[dict[str, Any]]:
    rows = []
    for index in range(backend.device_count()):
        caps = backend.capabilities(index).to_dict()
        try:
            free, total = backend.mem_get_info(index)
        except Exception as exc:  # shown, not fatal: the rest of the listing still helps
            free, total = None, caps["memory_bytes"]
            caps["memory_error"] = str(exc)
        rows.append({"index": index, **caps, "memory_free_bytes": free, "memory_total_bytes": total})
    return rows


def _contract(backend: Any) -> dict[str, Any]:
    """Each contract item's answer (supported / unsupported / unavailable, the API, why not)."""
    try:
        return {item: answer.to_dict() for item, answer in backend.contract().items()}
    except Exception as exc:  # a plug-in's broken answer is shown, not raised
        return {"error": {"item": "contract", "state": "error", "api": "", "reason": f"{type(exc).__name__}: {exc}"}}


def _print_contract(contract: dict[str, Any]) -> None:
    marks = {"supported": "yes", "unsupported": "no", "unavailable": "n/a"}
    print(f"  {'contract':<9} " + ", ".join(f"{item} {marks.get(a['state'], a['state'])}" for item, a in contract.items()))
    for item, a in contract.items():
        if a["state"] == "unsupported" or a["state"] == "error":
            print(f"  {'':<9} {item}: {a['reason']}")
        elif a["state"] == "unavailable" and item in ("graph_capture", "host_cache", "profiler"):
            print(f"  {'':<9} {item} would use {a['api']}")


def backend_entry(name: str, backend: Any) -> dict[str, Any]:
    """One backend's entry: availability and why, devices, CCL, verification, contract, stand-in or not."""
    try:
        status = backend.availability()
        available, reason = status.available, status.reason
        devices = _device_rows(backend) if available else []
    except Exception as exc:  # a third-party backend's broken probe is reported, not raised
        available, reason, devices = False, f"probe raised {type(exc).__name__}: {exc}", []
    return {
        "name": name,
        "vendor": backend.vendor,
        "device_type": backend.device_type,
        "ccl": backend.ccl,
        "process_group_backend": backend.process_group_backend(),
        "visible_devices_env": backend.visible_devices_env,
        "available": available,
        "reason": reason,
        "standin": backend.standin if available else None,
        "device_count": len(devices),
        "devices": devices,
        "verified_on_hardware": backend.hardware_verification is not None,
        "verification": backend.verification,
        "contract": _contract(backend),
    }


def _entry_in_child(name: str) -> dict[str, Any]:
    """``backend_entry`` of a stand-in probed in a child process holding its runtime alone: each vendor runtime owns
    PrivateUse1, so one process holds one (``hal.backends.standins``)."""
    from hal.backends.standins.elsewhere import in_child

    return in_child(name, "hal.cli.devices:standin_entry")


def standin_entry(name: str) -> dict[str, Any]:
    """``backend_entry`` of ``name`` in this process (what ``_entry_in_child`` runs in the child)."""
    from hal.backend_registry import get_backend

    return backend_entry(name, get_backend(name))


def devices_report() -> dict[str, Any]:
    """Every registered backend: availability and why, devices, CCL, hardware verification."""
    import torch

    from hal.backend_registry import all_backends, load_problems
    from hal.selection import choose_backend
    from hal.standin import requested

    standins = requested()
    entries = []
    for name, backend in all_backends().items():
        if name in standins and len(standins) > 1:  # one vendor runtime a process: each stand-in probed in its own
            entries.append(_entry_in_child(name))
        else:
            entries.append(backend_entry(name, backend))
    chosen, why = choose_backend("auto")
    return {
        "torch": torch.__version__,
        "backends": entries,
        "auto": {"backend": chosen.name, "reason": why},
        "load_problems": [p.__dict__ for p in load_problems()],
    }


def _print_devices(report: dict[str, Any]) -> None:
    print(f"hal devices (torch {report['torch']})")
    for b in report["backends"]:
        state = "available" if b["available"] else "unavailable"
        standin = f" — {b['standin']}" if b.get("standin") else ""
        print(f"\n{b['name']:<10} {state:<12} vendor {b['vendor']}, device type '{b['device_type']}', ccl {b['ccl']}{standin}")
        print(f"  {'why':<9} {b['reason']}")
        print(f"  {'verified':<9} {b['verification']}")
        _print_contract(b["contract"])
        for d in b["devices"]:
            native = " ".join(k for k, v in d["dtypes"].items() if v == "native")
            catalog = d["catalog_id"] or "not in catalog (probed facts only)"
            print(f"  {b['device_type']}:{d['index']:<6} {d['name']}  memory {gib(d['memory_total_bytes'])} "
                  f"(free {gib(d['memory_free_bytes'])})  catalog {catalog}")
            print(f"  {'':<9} native dtypes: {native or 'none'}")
    for p in report["load_problems"]:
        print(f"\nplug-in {p['name']}: {p['reason']} [{p['origin']}]")
    print(f"\nauto -> {report['auto']['backend']}: {report['auto']['reason']}")


def run(args: argparse.Namespace) -> int:
    report = devices_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_devices(report)
    return 0
