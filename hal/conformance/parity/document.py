"""One parity as a document: the verdict, each check's numbers, the band and every curve; a plot of the band with the
candidate's curves (inline SVG: no plotting library needed); sealed with its provenance like every results.json."""
from __future__ import annotations

import datetime
import html
from pathlib import Path
from typing import Any

from hal.conformance.reports.provenance import provenance, seal
from hal.conformance.reports.results import dumps, json_safe

from .band import LOSS_FLOOR, SIGMAS, Band
from .runs import Curve, ParityConfig
from .verdict import Check

KIND = "hal-conformance-parity"
SCHEMA = 1
FILES = ("results.json", "summary.md", "report.html")


def assemble(config: ParityConfig, band: Band, candidate_backend: Any, candidates: list[Curve], checks: list[Check], *,
             fault: str | None, wall_s: float, started: datetime.datetime) -> dict[str, Any]:
    passed = all(c.passed for c in checks)
    doc = {
        "schema": SCHEMA, "kind": KIND, "verdict": "pass" if passed else "fail",
        "reference": {"backend": band.backend, "device": band.device, "seeds": band.seeds, "cached": band.cached},
        "candidate": {"backend": candidate_backend.name, "device": candidate_backend.device_name(0),
                      "standin": candidate_backend.standin, "seeds": [c.seed for c in candidates], "planted_fault": fault},
        "training": {"source": config.source, **config.key(), "warmup": config.warmup, "layer_steps": list(config.layer_steps)},
        "rule": {"loss_band": f"mean ± max({LOSS_FLOOR:.0%} of |mean|, {SIGMAS:g} sigma) after warm-up",
                 "grad_norm": "mean ± max(10 %, 3 sigma)", "layers": "cosine >= 0.99 and norm within the precision's bound",
                 "convergence": "Welch one-sided t-test of steps to target, p = 0.05 each way"},
        "checks": [c.to_dict() for c in checks],
        "band": band.to_dict(),
        "candidates": [c.to_dict() for c in candidates],
        "started": started.isoformat(timespec="seconds"), "wall_s": round(wall_s, 1),
        "provenance": provenance(candidate_backend),
    }
    return seal(json_safe(doc))


def summary_text(doc: dict[str, Any]) -> str:
    ref, cand, tr = doc["reference"], doc["candidate"], doc["training"]
    lines = [f"training parity: {cand['backend']} ({cand['device']}) against {ref['backend']} ({ref['device']})"
             + (f"; planted fault: {cand['planted_fault']}" if cand.get("planted_fault") else ""),
             f"{tr['source']}: {tr['steps']} steps, {tr['precision']}, lr {tr['lr']:g}, {tr['batch']} rows of "
             f"{tr['model']['max_seq_len']} tokens; reference seeds {ref['seeds']}"
             + (" (cached band)" if ref.get("cached") else "") + f", candidate seeds {cand['seeds']}; warm-up "
             f"{tr['warmup']} steps", ""]
    for c in doc["checks"]:
        lines.append(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']}: {c['summary']}")
    lines += ["", f"verdict: {doc['verdict'].upper()} ({doc['wall_s']:.0f} s)"]
    return "\n".join(lines) + "\n"


def markdown(doc: dict[str, Any]) -> str:
    out = ["# Training parity", "", "```", summary_text(doc).rstrip(), "```", "", f"digest: `{doc['digest']}`", ""]
    return "\n".join(out) + "\n"


_COLORS = ("#c0392b", "#e67e22", "#8e44ad", "#16a085")


def plot_svg(doc: dict[str, Any], width: int = 860, height: int = 360) -> str:
    """The reference band (shaded), its mean (black) and every candidate curve (coloured), loss against step."""
    band = doc["band"]
    mean, half = band["mean"], band["width"]
    steps = len(mean)
    curves = [c["losses"] for c in doc["candidates"]]
    start = min(doc["training"]["warmup"], steps - 1)
    shown = [x for series in ([mean[start:]] + [c[start:] for c in curves]) for x in series if x == x]
    lo = min(min(shown), min(m - h for m, h in zip(mean[start:], half[start:])))
    hi = max(max(shown), max(m + h for m, h in zip(mean[start:], half[start:])))
    pad_l, pad_b, pad_t, pad_r = 60, 34, 14, 16
    sx = lambda t: pad_l + (width - pad_l - pad_r) * (t - start) / max(1, steps - 1 - start)  # noqa: E731
    sy = lambda v: pad_t + (height - pad_t - pad_b) * (hi - v) / max(hi - lo, 1e-12)  # noqa: E731
    upper = " ".join(f"{sx(t):.1f},{sy(mean[t] + half[t]):.1f}" for t in range(start, steps))
    lower = " ".join(f"{sx(t):.1f},{sy(mean[t] - half[t]):.1f}" for t in reversed(range(start, steps)))
    parts = [f'<polygon points="{upper} {lower}" fill="#d6eaf8" stroke="none"><title>reference band</title></polygon>',
             '<polyline fill="none" stroke="#1d1d1f" stroke-width="1.2" points="'
             + " ".join(f"{sx(t):.1f},{sy(mean[t]):.1f}" for t in range(start, steps)) + '"><title>reference mean</title></polyline>']
    for i, (c, losses) in enumerate(zip(doc["candidates"], curves)):
        pts = " ".join(f"{sx(t):.1f},{sy(losses[t]):.1f}" for t in range(start, steps) if losses[t] == losses[t])
        parts.append(f'<polyline fill="none" stroke="{_COLORS[i % len(_COLORS)]}" stroke-width="1" points="{pts}">'
                     f'<title>candidate seed {c["seed"]}</title></polyline>')
    for v in (lo, (lo + hi) / 2, hi):
        parts.append(f'<text x="{pad_l - 6}" y="{sy(v) + 4:.1f}" text-anchor="end" font-size="11">{v:.3f}</text>')
    for t in (start, (start + steps - 1) // 2, steps - 1):
        parts.append(f'<text x="{sx(t):.1f}" y="{height - 14}" text-anchor="middle" font-size="11">{t}</text>')
    parts.append(f'<text x="{(width + pad_l) / 2}" y="{height - 1}" text-anchor="middle" font-size="11">step (from the end '
                 'of warm-up)</text>')
    axes = (f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" stroke="#888"/>'
            f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - pad_r}" y2="{height - pad_b}" stroke="#888"/>')
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">{axes}{"".join(parts)}</svg>'


def render_html(doc: dict[str, Any]) -> str:
    from hal.conformance.reports.html_report import CSS

    verdict = doc["verdict"]
    rows = "".join(f"<tr><td>{'PASS' if c['passed'] else 'FAIL'}</td><td>{html.escape(c['name'])}</td>"
                   f"<td>{html.escape(c['summary'])}</td></tr>" for c in doc["checks"])
    head = summary_text(doc).split("\n\n")[0]
    legend = " · ".join(f'<span style="color:{_COLORS[i % len(_COLORS)]}">candidate seed {c["seed"]}</span>'
                        for i, c in enumerate(doc["candidates"]))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>training parity</title>"
            f"<style>{CSS}</style></head><body><main><h1>Training parity <span class='verdict {'pass' if verdict == 'pass' else 'fail'}'>"
            f"{verdict.upper()}</span></h1><pre>{html.escape(head)}</pre>"
            f"<h2>Checks</h2><table><tr><th></th><th>check</th><th>what it found</th></tr>{rows}</table>"
            f"<h2>Loss: the reference band and the candidate</h2><p>band shaded, reference mean black; {legend}</p>"
            f"{plot_svg(doc)}<p class='summary'>digest <code>{html.escape(doc['digest'])}</code> (<code>hal conformance "
            "verify</code> recomputes it)</p></main></body></html>")


def write(doc: dict[str, Any], directory: Path) -> list[Path]:
    from hal.conformance.reports.report import write_files

    return write_files(directory, {"results.json": dumps(doc), "summary.md": markdown(doc), "report.html": render_html(doc)})
