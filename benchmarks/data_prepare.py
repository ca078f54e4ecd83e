"""``hal data prepare`` at scale: peak memory and throughput on a single-line file and on a normal corpus.

    python benchmarks/data_prepare.py --size 1GiB --dir /tmp/prep [--baseline-tree /path/to/old/checkout] [--json]

Writes two inputs of SIZE bytes into DIR (kept between runs, so a second run reuses them): ``one_line.txt``, words
with no newline at all (one document), and ``normal.txt``, the shipped examples' paragraphs, numbered, separated
by blank lines. Each is prepared with the shipped tokenizer (examples/data/tokenizer.json) by ``python -m hal data
prepare`` in a process of its own; its peak resident memory comes from the kernel (``wait4``'s ru_maxrss), its
throughput from the command's own report. ``--baseline-tree`` (with ``--baseline-python``, an interpreter
whose hal is that checkout) runs the same command from another checkout on the normal corpus too (the one-line
file would run it out of memory) and prints the throughput ratio. A table is printed last; name the machine with the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB)?", text.strip())
    if match is None:
        raise SystemExit(f"--size {text!r}: give bytes like 1GiB, 256MiB or 1000000")
    return int(match.group(1)) * {"B": 1, None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[match.group(2)]


def _paragraphs() -> list[str]:
    text = "\n".join((DATA / name).read_text(encoding="utf-8") for name in ("corpus.txt", "ledger.txt"))
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def write_inputs(folder: Path, size: int) -> dict[str, Path]:
    """The two inputs, each ``size`` bytes (written once; reused when already that size)."""
    folder.mkdir(parents=True, exist_ok=True)
    paragraphs = _paragraphs()
    made = {}
    for name, separator in (("one_line", " "), ("normal", "\n\n")):
        path = folder / f"{name}.txt"
        made[name] = path
        if path.exists() and path.stat().st_size == size:
            continue
        with path.open("w", encoding="utf-8") as out:
            written, i = 0, 0
            while written < size:
                chunk = f"Entry {i}. {paragraphs[i % len(paragraphs)]}"
                chunk = chunk.replace("\n", " ") if name == "one_line" else chunk
                piece = (chunk + separator)[: size - written]
                out.write(piece)
                written += len(piece.encode("utf-8"))
                i += 1
        print(f"wrote {path} ({path.stat().st_size / 2**20:,.0f} MiB)", file=sys.stderr)
    return made


def peak_rss_runner(tree: Path, source: Path, out: Path, python: str = sys.executable) -> dict:
    """One ``hal data prepare`` run from checkout ``tree``, under a small wrapper that reports its child's peak RSS
    (ru_maxrss of RUSAGE_CHILDREN, MiB): the report, wall seconds and peak memory."""
    wrapper = ("import os, resource, subprocess, sys, json\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
               "print(json.dumps({'rc': p.returncode, 'out': p.stdout, 'err': p.stderr, 'peak': peak}))\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [python, "-m", "hal", "data", "prepare", "--tokenizer", str(DATA / "tokenizer.json"),
               "--out", str(out), str(source), "--json"]
    started = time.monotonic()
    done = subprocess.run([python, "-c", wrapper, *command], cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    result = json.loads(done.stdout)
    for suffix in (".bin", ".idx.json"):
        Path(str(out) + suffix).unlink(missing_ok=True)
    if result["rc"] != 0:
        return {"ok": False, "error": (result["err"].strip().splitlines() or ["?"])[-1], "seconds": seconds,
                "peak_rss_mib": result["peak"]}
    report = json.loads(result["out"])
    return {"ok": True, "seconds": seconds, "tokens": report["tokens"], "tokens_per_s": report["tokens_per_s"],
            "mb_per_s": report["mb_per_s"], "split_documents": report.get("split_documents"),
            "peak_rss_mib": result["peak"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1GiB", help="bytes of each input (default 1GiB)")
    parser.add_argument("--dir", default="/tmp/hal-prepare-bench", help="where the inputs and outputs go")
    parser.add_argument("--baseline-tree", help="another checkout to run on the normal corpus, for a ratio")
    parser.add_argument("--baseline-python", default=sys.executable,
                        help="the interpreter that imports hal from --baseline-tree (an editable install maps hal.* to "
                        "one checkout: give a venv where the baseline is installed with pip install -e)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    folder = Path(args.dir)
    inputs = write_inputs(folder, parse_size(args.size))
    rows = []
    for name, path in inputs.items():
        rows.append({"input": name, "tree": "this", **peak_rss_runner(REPO, path, folder / f"out_{name}")})
        print(f"{name}: {rows[-1]}", file=sys.stderr)
    if args.baseline_tree:
        rows.append({"input": "normal", "tree": "baseline",
                     **peak_rss_runner(Path(args.baseline_tree), inputs["normal"], folder / "out_base",
                                       args.baseline_python)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'input':<9} {'tree':<9} {'ok':<3} {'seconds':>8} {'tokens/s':>12} {'MB/s':>7} {'peak MiB':>9} {'split':>6}")
    for r in rows:
        print(f"{r['input']:<9} {r['tree']:<9} {'yes' if r['ok'] else 'NO':<3} {r['seconds']:>8.1f} "
              f"{r.get('tokens_per_s', 0):>12,.0f} {r.get('mb_per_s', 0):>7.1f} {r['peak_rss_mib']:>9,.0f} "
              f"{r.get('split_documents') if r['ok'] else r.get('error', '')!s:>6}")
    base = [r for r in rows if r["tree"] == "baseline" and r["ok"]]
    this = [r for r in rows if r["tree"] == "this" and r["input"] == "normal" and r["ok"]]
    if base and this:
        print(f"throughput ratio on the normal corpus (this / baseline): {this[0]['tokens_per_s'] / base[0]['tokens_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
