"""What ``hal train`` shows while it trains: the progress line, the evaluation lines, and how a terminal draws them.

Why here and not in the rank alone: under ``hal train`` a rank's stderr is a pipe to the parent (which
echoes it and keeps the last lines for a failure report), so a rank can never tell that a person watches.
The writer rank therefore always writes plain lines, and whoever owns the terminal — the parent, or the
rank itself when it was started on one (plain torchrun) — passes them through ``InPlace``, which redraws
progress lines on one terminal line and writes every other line (evaluations, warnings, errors) above it
on a line of its own. Off a terminal nothing is rewritten: one line a report, as a log or CI wants.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, TextIO

PROGRESS = re.compile(r"step \d+/\d+ ")
"""How a progress line starts (``progress_line``); what ``InPlace`` redraws in place."""


def progress_line(record: dict[str, Any], total: int) -> str:
    """``step 7/20 loss 4.1234 1234 tok/s 41 ms/step`` (and the expert balance for an MoE model), from a step record."""
    rate = record["tokens_per_s"] or 0.0
    loss = record["loss"]
    shown = "nan" if loss is None or (isinstance(loss, float) and math.isnan(loss)) else f"{loss:.4f}"
    line = f"step {record['step']}/{total} loss {shown} {rate:.0f} tok/s {record['step_s'] * 1e3:.0f} ms/step"
    moe = record.get("moe")
    if moe and moe.get("min_max") is not None:  # the expert balance: worst layer's least/most loaded expert
        line += f" · experts min/max {moe['min_max']:.2f} aux {moe['aux_loss']:.3f}"
        if moe.get("exchange"):  # under ep: how tokens crossed ranks (symmetric memory or all-to-alls)
            line += f" via {moe['exchange']}"
    return line


def eval_line(step: int, total: int, loss: float) -> str:
    """``eval step 20/400 loss 2.3456 ppl 10.43``: one line per evaluation, kept on screen (not redrawn)."""
    ppl = math.exp(min(loss, 80.0))
    return f"eval step {step}/{total} loss {loss:.4f} ppl {ppl:.2f}"


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a stream without ``isatty`` is not)."""
    check = getattr(stream, "isatty", None)
    return bool(check()) if callable(check) else False


def _width(stream: Any) -> int | None:
    """The terminal's columns, None where unknown (a pty nobody sized reports 0): a longer line would wrap, and
    ``\\r`` only returns to the start of its last row."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None
    return columns if columns > 1 else None


class InPlace:
    """A terminal stream on which progress lines redraw one line and every other line is written above it.

    Takes text as a pipe delivers it (whole lines, usually one a call). A progress line is drawn after a
    carriage return and cleared to the end of the line, without a newline, so the next one replaces it; any
    other line first ends the progress line shown (it stays, as the last step before that line) and is
    written as it came. ``close`` ends a progress line still shown with a newline.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.width = _width(stream)
        self.showing = False  # a progress line is drawn and not yet ended by a newline

    def write(self, text: str) -> int:
        for line in text.splitlines(keepends=True):
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        body = line.rstrip("\r\n")
        if PROGRESS.match(body):
            if self.width is not None:
                body = body[: self.width - 1]
            self.stream.write(f"\r{body}\x1b[K")
            self.showing = True
            return
        if self.showing:
            self.stream.write("\n")
            self.showing = False
        self.stream.write(line)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        """End the progress line shown, if any, so what is printed next starts on a line of its own."""
        if self.showing:
            self.stream.write("\n")
            self.showing = False
        self.stream.flush()

    def isatty(self) -> bool:
        return True


def on_screen(stream: TextIO) -> TextIO | InPlace:
    """``stream`` as the progress should reach it: through ``InPlace`` on a terminal, as it is elsewhere."""
    return InPlace(stream) if is_terminal(stream) else stream


class Progress:
    """The writer rank's lines: one progress line per step and one line per evaluation, in place on a terminal."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        import sys

        self.total = total
        self.out = on_screen(stream if stream is not None else sys.stderr)

    def update(self, record: dict[str, Any]) -> None:
        """The step's progress line."""
        self.say(progress_line(record, self.total))

    def evaluated(self, step: int, loss: float) -> None:
        """The evaluation's line, which stays on screen above the progress line."""
        self.say(eval_line(step, self.total, loss))

    def say(self, line: str) -> None:
        """One line as the progress shows it (a progress-shaped line is redrawn in place on a terminal)."""
        self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if isinstance(self.out, InPlace):
            self.out.close()


class SlowStepNotice:
    """While a step runs longer than ``first_after`` seconds, one line now and then says so, with why it may.

    Why: the first step of a compiled run can spend minutes in torch.compile (every stage compiles its own
    layers) with nothing on screen, which looks like a hang. Only the writer rank runs one, so a run says it
    once, not once a rank. A daemon timer thread: ``with SlowStepNotice(...):`` around the step; nothing is
    printed when the step ends in time."""

    def __init__(self, progress: Progress, step: int, why: str, *, first_after: float = 20.0, every: float = 60.0) -> None:
        import threading

        self.progress, self.step, self.why = progress, step, why
        self.first_after, self.every = first_after, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hal-slow-step-notice", daemon=True)
        self.said = 0  # lines printed

    def __enter__(self) -> SlowStepNotice:
        import time

        self._began = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import time

        wait = self.first_after
        while not self._stop.wait(wait):
            elapsed = time.perf_counter() - self._began
            self.progress.say(f"step {self.step}/{self.progress.total} still running after {elapsed:.0f} s: {self.why}")
            self.said += 1
            wait = self.every


__all__ = ["InPlace", "PROGRESS", "Progress", "SlowStepNotice", "eval_line", "is_terminal", "on_screen", "progress_line"]
