"""The timeline picture (PNG): the planner's and the simulator's prediction on top, measured below, one time axis.

Why a picture: a schedule's bubble is a shape — warm-up, steady state, cool-down, a slow stage that
starves the next — and a row of coloured bars shows where a rank waited in a way the per-phase sums
cannot. Drawn from a ``parallel.observe.timeline`` document, never from live objects, with matplotlib's
object API (no pyplot state, Agg-safe) as the conformance plots are; matplotlib is the ``report``
extra and ``missing()`` says how to install it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

INSTALL_HINT = "pip install 'hetero-hal[report]'"
MAX_RANK_ROWS = 16  # more ranks than this: one row per stage (its first rank), the rest said in the title

COLOURS = {"F": "#4C78A8", "B": "#F58518", "I": "#F58518", "W": "#54A24B", "P": "#72B7B2", "p2p": "#B279A2",
           "grad_sync": "#9D755D", "idle": "#E6E6E6"}
NAMES = {"F": "forward", "B": "backward", "I": "backward, input half (I)", "W": "backward, weight half (W)",
         "P": "pair: F (named) + a B at once",
         "p2p": "send / recv (post or wait)", "grad_sync": "dp gradient sync", "idle": "idle"}
COMPUTE = ("F", "B", "I", "W", "P")
WIDTH, DPI = 13.0, 110
PLOT_PX = WIDTH * DPI * 0.78  # about how wide the time axis is drawn, for fitting bar labels
BAR, THIN = 0.72, 0.34  # bar heights: compute fills the row, P2P is a thin band on it


def missing() -> str | None:
    """None when matplotlib can draw; otherwise the reason and how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); {INSTALL_HINT}"
    return None


def write_png(doc: dict[str, Any], path: str | Path) -> Path:
    """Draw ``doc`` (``parallel.observe.timeline``) into the PNG at ``path``; matplotlib must be there (``missing``)."""
    fig = draw(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return path


def draw(doc: dict[str, Any]) -> Any:
    """The figure: the planner's timeline (where the document has it) and the simulator's on top, one row a stage;
    measured ranks (when the document has them) below."""
    from matplotlib.figure import Figure

    seconds = doc["unit"] == "s"
    scale = 1e3 if seconds else 1.0  # seconds are drawn in ms
    measured = _measured_rows(doc)
    predictions = [key for key in ("planned", "predicted") if key in doc]
    end = max([*(doc[key]["makespan"] for key in predictions), *(s["end"] for r in measured for s in r["spans"])]) * scale or 1.0
    heights = [len(doc["stages"])] * len(predictions) + ([len(measured)] if measured else [])
    fig = Figure(figsize=(WIDTH, 1.6 + 0.42 * sum(heights) + 0.9 * len(heights)), layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    used: set[str] = {"idle"}
    for ax, key in zip(axes, predictions):
        _predicted_panel(ax, doc, key, scale, end, used)
    if measured:
        _measured_panel(axes[len(predictions)], doc, measured, scale, end, used)
    axes[-1].set_xlabel("ms since the step's schedule began" if seconds else "time (one layer's forward = 1)",
                        fontsize=9)
    axes[-1].set_xlim(0, end * 1.005)
    _legend(fig, used, doc["virtual_stages"] > 1)
    chunks = f" × {doc['virtual_stages']} chunks" if doc["virtual_stages"] > 1 else ""
    fig.suptitle(f"schedule {doc['schedule']}: {doc['num_stages']} stages{chunks}, {doc['micro_batches']} micro-batches",
                 fontsize=11, x=0.01, ha="left")
    return fig


# --- the two panels ------------------------------------------------------------------------------------------


PANEL_TITLES = {"planned": "planned:", "predicted": "predicted: simulator,"}  # the planner's promise; the schedule's


def _predicted_panel(ax: Any, doc: dict[str, Any], key: str, scale: float, end: float, used: set[str]) -> None:
    predicted = doc[key]
    makespan = predicted["makespan"] * scale
    labels = []
    for row, stage in enumerate(doc["stages"]):
        ax.barh(row, makespan, height=BAR, color=COLOURS["idle"], zorder=1)
        spans = [s for s in predicted["spans"] if s["stage"] == stage["stage"]]
        _bars(ax, row, spans, scale, end, doc["virtual_stages"], used)
        _note(ax, row, f"idle {predicted['bubble'][row]:.0%}")
        labels.append(f"stage {stage['stage']}  ({stage['backend']}, ranks {_ranks(stage['ranks'])})")
    _rows(ax, labels)
    ax.axvline(makespan, color="#444444", linewidth=0.8, linestyle="--", zorder=4)
    unit = "ms" if doc["unit"] == "s" else "units"
    ax.set_title(f"{PANEL_TITLES[key]} {predicted['assumes']} — makespan {makespan:.3g} {unit}",
                 fontsize=9, loc="left")


def _measured_panel(ax: Any, doc: dict[str, Any], ranks: Sequence[dict[str, Any]], scale: float, end: float,
                    used: set[str]) -> None:
    makespan = doc["makespan"] * scale
    labels = []
    for row, r in enumerate(ranks):
        ax.barh(row, makespan, height=BAR, color=COLOURS["idle"], zorder=1)
        _bars(ax, row, r["spans"], scale, end, doc["virtual_stages"], used)
        _note(ax, row, f"idle {1.0 - r['compute']:.0%} ({r['p2p']:.0%} in send/recv)")
        grid = f"dp {r['dp']} tp {r['tp']}" if len(ranks) > len(doc["stages"]) else doc["stages"][r["stage"]]["backend"]
        labels.append(f"rank {r['rank']}  (stage {r['stage']}, {grid})")
    _rows(ax, labels)
    for row in range(1, len(ranks)):  # a line between stages
        if ranks[row]["stage"] != ranks[row - 1]["stage"]:
            ax.axhline(row - 0.5, color="#999999", linewidth=0.6, zorder=0)
    ax.axvline(makespan, color="#444444", linewidth=0.8, linestyle="--", zorder=4)
    shown = "" if len(ranks) == len(doc["ranks"]) else f" (first rank of each stage; {len(doc['ranks'])} ranks)"
    ax.set_title(f"measured: step {doc['step']} ({doc['clock']} clock, ranks aligned by {doc['aligned']}){shown} — "
                 f"makespan {makespan:.3g} ms; idle = not computing, as predicted",
                 fontsize=9, loc="left")


# --- pieces ---------------------------------------------------------------------------------------------------


def _bars(ax: Any, row: int, spans: Sequence[dict[str, Any]], scale: float, end: float, chunks: int,
          used: set[str]) -> None:
    """One row's spans: compute as full bars (named when wide enough), P2P and gradient sync as thin bands."""
    for s in spans:
        kind = s["kind"]
        if kind not in COLOURS:
            continue
        used.add(kind)
        left, width = s["start"] * scale, (s["end"] - s["start"]) * scale
        thin = kind == "grad_sync"  # after the schedule: a band, apart from the rows' bars
        shade = 0.55 if chunks > 1 and s.get("chunk") else 1.0  # later chunks lighter
        ax.barh(row, max(width, end * 0.0015), left=left, height=THIN if thin else BAR, color=COLOURS[kind],
                alpha=shade, edgecolor="white" if not thin else "none", linewidth=0.5, zorder=3 if thin else 2)
        fit = _label(f"{kind}{s['mb']}" + (f".{s['chunk']}" if chunks > 1 else ""), str(s["mb"]),
                     width / end * PLOT_PX) if kind in COMPUTE else None
        if fit is not None:
            name, size = fit
            ax.text(left + width / 2, row, name, ha="center", va="center", fontsize=size,
                    color="white" if shade == 1.0 else "#222222", zorder=5, clip_on=True)


def _label(name: str, short: str, width_px: float) -> tuple[str, float] | None:
    """``name`` (F3.1) or, in a narrow bar, ``short`` (the micro-batch: colour and shade say the rest), at the
    largest of 7 / 5.5 pt that fits in ``width_px``; None when nothing does."""
    for text in (name, short):
        for size in (7.0, 5.5):
            if len(text) * 0.62 * size * DPI / 72 + 4 <= width_px:
                return text, size
    return None


def _note(ax: Any, row: int, text: str) -> None:
    """A row's shares, just right of the plot area."""
    ax.annotate(text, xy=(1.0, row), xycoords=("axes fraction", "data"), xytext=(6, 0), textcoords="offset points",
                ha="left", va="center", fontsize=8, color="#333333")


def _rows(ax: Any, labels: Sequence[str]) -> None:
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # the first stage on top
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="x", color="#f0f0f0", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _legend(fig: Any, used: set[str], chunks: bool) -> None:
    from matplotlib.patches import Patch

    order = [k for k in ("F", "B", "I", "W", "P", "p2p", "grad_sync", "idle") if k in used]
    if "B" in used and "I" in used:  # one colour, one entry
        order.remove("I")
    handles = [Patch(color=COLOURS[k], label=NAMES[k]) for k in order]
    if chunks:
        handles.append(Patch(color=COLOURS["F"], alpha=0.55, label="lighter: a later chunk (a bar says F3.1 or, narrow, 3: its micro-batch)"))
    # one row while it fits the figure's width; more entries (a V's pairs, chunks) wrap onto a second row
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=8, frameon=False)


def _measured_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank, or the first rank of each stage when there are more than MAX_RANK_ROWS."""
    ranks: list[dict[str, Any]] = doc.get("ranks") or []
    if len(ranks) <= MAX_RANK_ROWS:
        return ranks
    return [r for r in ranks if r["rank"] == doc["stages"][r["stage"]]["ranks"][0]]


def _ranks(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def write_replicas_png(docs: Sequence[dict[str, Any]], titles: Sequence[str], path: str | Path) -> Path:
    """Several replicas' predicted timelines, one panel each (``titles``: a replica's line above its panel). Each
    panel keeps its own time axis: the replicas run different plans, often on different devices, and layer units
    of one are not those of another."""
    from matplotlib.figure import Figure

    heights = [len(d["stages"]) for d in docs]
    fig = Figure(figsize=(WIDTH, 1.6 + 0.42 * sum(heights) + 1.1 * len(heights)), layout="constrained")
    axes = fig.subplots(len(docs), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    used: set[str] = {"idle"}
    chunks = False
    for ax, doc, title in zip(axes, docs, titles):
        end = doc["predicted"]["makespan"] or 1.0
        _predicted_panel(ax, doc, "predicted", 1.0, end, used)
        ax.set_title(f"{title} — {ax.get_title(loc='left')}", fontsize=9, loc="left")
        ax.set_xlim(0, end * 1.005)
        ax.set_xlabel("time (one layer's forward of this replica's micro-batch = 1)", fontsize=8)
        chunks = chunks or doc["virtual_stages"] > 1
    _legend(fig, used, chunks)
    fig.suptitle(f"{len(docs)} replicas, each its own plan: predicted timelines (own time axes)", fontsize=11, x=0.01,
                 ha="left")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return path
