"""``hal data prepare`` at its limits: memory bounded by the window, a full disk one line, a killed run no litter."""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data"
TOKENIZER = DATA / "tokenizer.json"


def _text(size: int, separator: str) -> str:
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", (DATA / "corpus.txt").read_text(encoding="utf-8")) if p.strip()]
    out, total, i = [], 0, 0
    while total < size:
        out.append(f"Entry {i}. {paragraphs[i % len(paragraphs)]}".replace("\n", " ") + separator)
        total += len(out[-1])
        i += 1
    return "".join(out)


PEAKS = """
import resource, sys
from hal.parallel.data.prepare import prepare_tokens
peaks = []
for source, out in zip(sys.argv[2::2], sys.argv[3::2]):
    prepare_tokens([source], sys.argv[1], out)
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print(*peaks)
"""


def test_a_file_without_blank_lines_is_tokenized_in_bounded_memory(tmp_path: Path) -> None:
    """One process prepares a 1 MiB and then a 5 MiB single-line file: the peak grows by far less than the 4 MiB of
    text more times the ~180 bytes a character the tokenizer holds when given a document whole (~700 MiB)."""
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text(_text(1 << 20, " "), encoding="utf-8")
    large.write_text(_text(5 << 20, " "), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", PEAKS, str(TOKENIZER), str(small), str(tmp_path / "s"), str(large),
                           str(tmp_path / "l")], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = map(float, done.stdout.split())
    assert second - first < 96, f"peak resident memory grew by {second - first:.0f} MiB from 1 to 5 MiB of text"


def _limited_file_size(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_is_one_line_exit_2_and_nothing_left(tmp_path: Path) -> None:
    """The file-size limit (ulimit -f) stands in for a full disk: the write fails with EFBIG as with ENOSPC."""
    source = tmp_path / "in" / "corpus.txt"
    source.parent.mkdir()
    source.write_text(_text(1 << 20, "\n\n"), encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "hal", "data", "prepare", "--tokenizer", str(TOKENIZER),
                           "--out", str(out / "train"), str(source)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO, preexec_fn=lambda: _limited_file_size(64 << 10))
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, lines
    assert "file-size limit" in lines[0] and str(out / "train.bin") in lines[0] and "another disk" in lines[0]
    assert list(out.iterdir()) == []


def _output_open(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` holds a file of ``folder`` open (its output, named or not)."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(link.startswith(str(folder) + "/") for link in links)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to see the output opened")
def test_a_killed_run_leaves_no_temporary_file(tmp_path: Path) -> None:
    """SIGKILL (the out-of-memory killer; a native abort is the same to the file system) while the output is
    being written: the folder holds exactly what it held before."""
    source = tmp_path / "corpus.txt"
    source.write_text(_text(4 << 20, "\n\n"), encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "hal", "data", "prepare", "--tokenizer", str(TOKENIZER),
                             "--out", str(out / "train"), str(source)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not _output_open(proc.pid, out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed: give it more text"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert list(out.iterdir()) == []
