"""Runs the whole corpus natively on a CUDA machine (no hal): the check that every script is
genuine CUDA code that does what its header says on real GPUs. Needs 2 GPUs for the
distributed, DataParallel and model-parallel scripts.

    python tests/migration_corpus/data/run_native.py [--out DIR] [NAME ...]

Each script runs as its header's migrated run would, minus hal: ``python script.py ARGS`` or
``torchrun --standalone --nproc-per-node N script.py ARGS``. One line per script: exit status,
seconds, the RESULT line and any warning lines; with --out, each run's stdout/stderr is kept.
Every script must exit 0 here - including cuda_graph_capture.py, whose "error" expectation is
about the host only.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent


def header(path):
    fields = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line[1:].strip().partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    failed = 0
    for path in sorted(CORPUS.glob("*.py")):
        if args.names and path.stem not in args.names:
            continue
        fields = header(path)
        launch = re.fullmatch(r"hal run|hal launch --nproc (\d+)", fields["launch"])
        script_args = shlex.split(fields.get("args", ""))
        if launch.group(1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={launch.group(1)}",
                   str(path), *script_args]
        else:
            cmd = [sys.executable, str(path), *script_args]
        start = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=CORPUS)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = "timeout", exc.stdout or "", exc.stderr or ""
            out, err = (out.decode() if isinstance(out, bytes) else out), (err.decode() if isinstance(err, bytes) else err)
        seconds = time.time() - start
        failed += rc != 0
        result = [line for line in out.splitlines() if line.startswith("RESULT ")]
        warnings = sorted({re.sub(r"^.*?:\d+: ", "", line) for line in err.splitlines() if re.search(r":\d+: \w*Warning: ", line)})
        print(f"== {path.stem}: exit {rc}, {seconds:.1f} s", flush=True)
        print("   " + (result[0] if result else "(no RESULT)"), flush=True)
        for w in warnings:
            print("   warning: " + w[:300], flush=True)
        if rc != 0:
            print("   stderr tail: " + "\n   ".join(err.splitlines()[-15:]), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            Path(args.out, path.stem + ".stdout").write_text(out)
            Path(args.out, path.stem + ".stderr").write_text(err)
    print(f"{failed} script(s) failed natively", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
