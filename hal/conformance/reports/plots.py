"""The report's plots as inline SVG, drawn with matplotlib's object API (no pyplot state, Agg-safe).

matplotlib is the optional extra ``report``; ``missing()`` says why plots cannot be drawn when it is
absent, and each plot function returns None when the run has no data for it. All read a results
document (``conformance.reports.report``), never live objects, so a saved results.json re-renders the same.
"""
from __future__ import annotations

import io
import math
import random
from collections import defaultdict
from typing import Any

from hal.conformance.reports.results import as_float

INSTALL_HINT = "pip install 'hetero-hal[report]'"
RATIO_LOW, RATIO_HIGH = 1e-6, 1e6  # the tol_ratio axis; points outside sit on its edges
DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "int32", "int8", "bool")
ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn",
           "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
           "tf32": "tf32"}
UNNAMED = "dtype not in name"
MAX_LOSS_PANELS = 24


def missing() -> str | None:
    """None when matplotlib can draw; otherwise the reason and how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); {INSTALL_HINT}"
    return None


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _svg(fig: Any, salt: str) -> str:
    """The figure as an <svg> element (no XML prologue), text as text, ids unique to this plot."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def dtype_of(case: dict[str, Any]) -> str:
    """The dtype a case ran in, read from its name's components (or their ``_``-separated words) and tags."""
    parts = [*case.get("name", "").split("/"), *case.get("tags", [])]
    for part in parts:
        if part in DTYPES or part in ALIASES:
            return ALIASES.get(part, part)
    for word in (w for p in parts for w in p.split("_")):  # "test_attention_causal_bf16"; not "bool_mask"
        if word in ALIASES or (word in DTYPES and word.startswith("float")):
            return ALIASES.get(word, word)
    return UNNAMED


def op_of(case: dict[str, Any]) -> str:
    """The op group of a case: its name's first component."""
    return case.get("name", "").split("/")[0]


def tol_ratio_svg(doc: dict[str, Any]) -> str | None:
    """(a) tol_ratio per case on a log axis, grouped by op, coloured by dtype, with the pass line at 1.

    One panel per suite. The axis shows RATIO_LOW..HIGH: smaller ratios (exact results included) sit
    on the bottom edge as ▼, larger ones (inf included) on the top edge as ▲, so one outlier cannot
    squash every other point.
    """
    from matplotlib.lines import Line2D

    points: dict[str, list[tuple[str, str, float]]] = defaultdict(list)
    for case in doc["cases"]:
        value = as_float((case.get("metrics") or {}).get("tol_ratio"))
        if value is not None and not math.isnan(value):
            points[str(case.get("suite"))].append((op_of(case), dtype_of(case), value))
    if not points:
        return None
    every = [p for group in points.values() for p in group]
    dtypes = sorted({p[1] for p in every}, key=lambda d: (DTYPES.index(d) if d in DTYPES else len(DTYPES), d))
    colours = {d: f"C{i % 10}" for i, d in enumerate(dtypes)}
    finite = [v for _, _, v in every if math.isfinite(v) and v > 0]
    high = min(RATIO_HIGH, max([10.0, *finite]) * 2)
    widest = max(len({p[0] for p in group}) for group in points.values())
    fig = _figure(min(15.0, max(9.0, 0.6 * widest + 3.0)), 3.6 * len(points) + 0.4)
    axes = fig.subplots(len(points), 1, squeeze=False)[:, 0]
    jitter = random.Random(0)
    lanes = len(dtypes)
    for ax, (suite, group) in zip(axes, points.items()):
        ops = list(dict.fromkeys(p[0] for p in group))
        for d_index, dtype in enumerate(dtypes):
            marks: dict[str, tuple[list[float], list[float]]] = {"o": ([], []), "v": ([], []), "^": ([], [])}
            for op, dt, v in group:
                if dt != dtype:
                    continue
                marker = "v" if v < RATIO_LOW else ("^" if v > high else "o")
                lane = (d_index - (lanes - 1) / 2) * (0.76 / lanes)
                marks[marker][0].append(ops.index(op) + lane + jitter.uniform(-0.3, 0.3) * (0.76 / lanes))
                marks[marker][1].append(RATIO_LOW if marker == "v" else (high if marker == "^" else v))
            for marker, (xs, ys) in marks.items():
                if xs:
                    ax.scatter(xs, ys, s=16, marker=marker, color=colours[dtype], alpha=0.7, linewidths=0,
                               clip_on=False, zorder=3)
        ax.axhline(1.0, color="#c0392b", linestyle="--", linewidth=1.2, zorder=2)
        ax.set_yscale("log")
        ax.set_ylim(RATIO_LOW, high)
        ax.set_xticks(range(len(ops)), ops, rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.6, max(len(ops), 4) - 0.4)
        for x in range(len(ops) - 1):
            ax.axvline(x + 0.5, color="#e5e5e5", linewidth=0.6, zorder=0)
        ax.grid(True, axis="y", which="major", color="#f0f0f0", linewidth=0.6, zorder=0)
        ax.set_ylabel("max error / bound", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_title(f"{suite}: {len(group)} cases", fontsize=9, loc="left")
    handles = [Line2D([], [], marker="o", linestyle="", color=colours[d]) for d in dtypes]
    handles.append(Line2D([], [], color="#c0392b", linestyle="--"))
    fig.legend(handles, [*dtypes, "bound (tol_ratio = 1)"], fontsize=8, loc="outside right upper", frameon=False)
    fig.suptitle(f"above the dashed line fails; ▼ = {RATIO_LOW:g} or less (exact included), ▲ = above {high:g} "
                 "(inf included)", fontsize=9)
    return _svg(fig, "tol_ratio")


def _loss_cases(doc: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for case in doc["cases"]:
        data = case.get("data") or {}
        if isinstance(data.get("loss"), list) and isinstance(data.get("reference_loss"), list) and data["loss"]:
            found.append(case)
    return found


def loss_svg(doc: dict[str, Any]) -> str | None:
    """(b) each training case's loss against its reference loss, one small panel per case."""
    cases = _loss_cases(doc)[:MAX_LOSS_PANELS]
    if not cases:
        return None
    cols = min(3, len(cases))
    rows = math.ceil(len(cases) / cols)
    fig = _figure(4.2 * cols, 3.0 * rows)
    for i, case in enumerate(cases):
        data = case["data"]
        ax = fig.add_subplot(rows, cols, i + 1)
        loss = [as_float(v) for v in data["loss"]]
        ref = [as_float(v) for v in data["reference_loss"]]
        steps = data.get("steps") if isinstance(data.get("steps"), list) and len(data["steps"]) == len(loss) else list(range(len(loss)))
        ref_steps = steps if len(ref) == len(loss) else list(range(len(ref)))
        # the reference wide and pale underneath, so a run that matches it exactly still shows both lines
        ax.plot(ref_steps, ref, color="C1", linewidth=4, alpha=0.45, label="reference", zorder=1)
        ax.plot(steps, loss, color="C0", linewidth=1.3, marker="o" if len(loss) <= 30 else None, markersize=2.5,
                label=f"{doc.get('backend')}", zorder=2)
        ax.set_title(_short(case["name"], 48) + (f"  [{case['status']}]" if case["status"] != "pass" else ""),
                     fontsize=8, color="#c0392b" if case["status"] in ("fail", "error") else "black")
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("loss", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, frameon=False)
    return _svg(fig, "loss")


def _collective_cases(doc: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for case in doc["cases"]:
        data = case.get("data") or {}
        if isinstance(data.get("sizes_bytes"), list) and isinstance(data.get("busbw_gbs"), list) and data["sizes_bytes"]:
            found.append(case)
    return found


def _bytes_label(n: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}B"


def busbw_svg(doc: dict[str, Any]) -> str | None:
    """(c) bus bandwidth against message size (log x), one panel per collective op, a line per dtype."""
    cases = _collective_cases(doc)
    if not cases:
        return None
    by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for case in cases:
        by_op[str(case["data"].get("op") or case["name"].split("/")[0])].append(case)
    cols = min(3, len(by_op))
    rows = math.ceil(len(by_op) / cols)
    fig = _figure(4.4 * cols, 3.2 * rows)
    for i, (op, group) in enumerate(by_op.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        labels = [str(c["data"].get("dtype") or dtype_of(c)) for c in group]
        for case, label in zip(group, labels):
            pairs = [(as_float(s), as_float(b)) for s, b in zip(case["data"]["sizes_bytes"], case["data"]["busbw_gbs"])]
            pairs = [(s, b) for s, b in pairs if s is not None and b is not None and s > 0 and math.isfinite(b)]
            if not pairs:
                continue
            if labels.count(label) > 1:  # the same dtype twice: tell the cases apart by what their names differ in
                label = f"{label} {_distinct(case['name'], [c['name'] for c in group])}"
            ax.plot([s for s, _ in pairs], [b for _, b in pairs], marker="o", markersize=3, linewidth=1.3, label=label)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_bytes_formatter())
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("message size", fontsize=8)
        ax.set_ylabel("busbw (GB/s)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", color="#eeeeee", linewidth=0.6)
        ax.legend(fontsize=7, frameon=False)
    return _svg(fig, "busbw")


def _distinct(name: str, names: list[str]) -> str:
    """The components of ``name`` (a path) that not every name in ``names`` shares."""
    split = [n.split("/") for n in names]
    parts = name.split("/")
    keep = [p for i, p in enumerate(parts) if not all(len(o) > i and o[i] == p for o in split)]
    return "/".join(keep) or name


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _bytes_formatter() -> Any:
    """Tick labels 8B, 1K, 64M, 1G."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _pos: _bytes_label(value))
