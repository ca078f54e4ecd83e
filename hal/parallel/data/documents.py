"""The documents of ``hal data prepare``'s inputs, read in pieces of bounded size.

Why pieces: a tokenizer holds about 200 bytes of memory per byte of the text it encodes at once, and a plain-text
file without blank lines is one document however large it is. So no more than ``window`` characters of a document
are ever handed over at once: a longer document comes as several pieces, cut at the last whitespace inside the
window (a word is never cut unless it is longer than the window), and only the last piece ends the document. A
document within the window is one piece, exactly as before; a longer one is tokenized piece by piece (the tokens
at each cut may differ from tokenizing it whole), which ``hal data prepare`` counts and says.

Inputs:

- ``.txt``: documents separated by one or more blank (whitespace-only) lines; the lines of a document keep their
  newlines (the document's trailing newline is dropped). Read 1 MiB at a time.
- ``.jsonl``: one JSON object per line, the document in its ``"text"`` field (blank lines skipped); a line may
  hold at most ``MAX_JSONL_LINE`` bytes (JSON is parsed whole).

Whitespace-only documents are skipped. A decoding or format error is one ``ConfigError`` naming file and line.
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NoReturn

from hal.errors import ConfigError

WINDOW_CHARS = 1 << 18  # 256 Ki characters of one document at a time: ~50 MB of tokenizer memory, far above a web page
MAX_JSONL_LINE = 64 * 2**20  # bytes of one JSONL record (parsed whole: ~5x that in memory)
_WHITESPACE = (" ", "\n", "\t")
BLOCK_BYTES = 1 << 20  # read a .txt file 1 MiB at a time
_BLANK_RUN = re.compile(r"\n(?:[^\S\n]*\n)+")  # a line's end, then one or more whitespace-only lines
_LEADING_BLANK = re.compile(r"\A(?:[^\S\n]*\n)+")  # whitespace-only lines at the start


@dataclass(frozen=True)
class Piece:
    """Up to ``window`` characters of one document; ``last``: the document ends here (its separator follows)."""

    text: str
    last: bool


def _cut(text: str, window: int) -> int:
    """Where to end a piece of ``text`` (longer than ``window``): after the text before the last whitespace inside
    the window, so the next piece starts with that whitespace (as a word-level pre-tokenizer splits); else at the
    window."""
    at = max(text.rfind(w, 1, window) for w in _WHITESPACE)
    return at if at > 0 else window


def _split(text: str, window: int) -> Iterator[str]:
    """``text`` in pieces of at most ``window`` characters (the rest, under the window, stays with the caller)."""
    while len(text) > window:
        at = _cut(text, window)
        yield text[:at]
        text = text[at:]
    yield text


class _TextReader:
    """One UTF-8 file in decoded blocks of ``BLOCK_BYTES`` ("\\r\\n" read as "\\n"); a decoding error names its line
    and byte."""

    def __init__(self, path: Path, block: int = 0) -> None:
        self.path, self.block = path, block or BLOCK_BYTES
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.lines = 0  # newlines before the current block
        self.line_bytes = 0  # bytes of the current (unfinished) line before the current block
        self.carry = ""  # a "\r" at the end of a block, waiting to see whether "\n" follows

    def blocks(self) -> Iterator[str]:
        with self.path.open("rb") as handle:
            while raw := handle.read(self.block):
                pending = len(self.decoder.getstate()[0])  # bytes of a character split by the previous block
                try:
                    text = self.carry + self.decoder.decode(raw)
                except UnicodeDecodeError as exc:
                    self._refuse(raw, exc.start - pending, exc.reason)
                self.carry = ""
                if text.endswith("\r"):
                    text, self.carry = text[:-1], "\r"
                newlines = raw.count(b"\n")
                self.line_bytes = len(raw) - 1 - raw.rfind(b"\n") if newlines else self.line_bytes + len(raw)
                self.lines += newlines
                yield text.replace("\r\n", "\n")
        try:
            tail = self.carry + self.decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{self.path}:{self.lines + 1}: not UTF-8 text ({exc.reason}: the file ends inside a "
                              "character); convert the file to UTF-8") from None
        if tail:
            yield tail

    def _refuse(self, raw: bytes, at: int, reason: str) -> NoReturn:
        before = raw[:max(at, 0)]
        line = self.lines + before.count(b"\n") + 1
        column = at - before.rfind(b"\n") - 1 if b"\n" in before else self.line_bytes + at
        raise ConfigError(f"{self.path}:{line}: not UTF-8 text ({reason} at byte {max(column, 0)}); "
                          "convert the file to UTF-8")


def _document(text: str, window: int) -> Iterator[Piece]:
    """One whole document in pieces (one piece when it fits the window)."""
    *pieces, rest = _split(text, window)
    for piece in pieces:
        yield Piece(piece, False)
    yield Piece(rest, True)


def text_pieces(path: Path, window: int = WINDOW_CHARS, block: int = 0) -> Iterator[Piece]:
    """The documents of a .txt file (runs of lines between blank lines), in pieces of at most ``window``.

    Block by block: the lines the block completes are split at runs of blank lines (a regular expression, not a
    loop over lines); what follows the last separator stays open — complete lines, then part of a line — and is
    handed out in pieces once it passes the window. ``block``: bytes a read (default ``BLOCK_BYTES``)."""
    held = ""  # the open document: its complete lines (each with its "\n"), then part of a line
    for text in _TextReader(path, block).blocks():
        buf = held + text
        if not held.strip():  # no document open: blank lines here separate nothing
            buf = _LEADING_BLANK.sub("", buf, count=1)
        cut = buf.rfind("\n") + 1
        *done, open_lines = _BLANK_RUN.split(buf[:cut])
        for doc in done:
            if doc.strip():
                yield from _document(doc, window)
        held = open_lines + buf[cut:]
        if len(held) > window and held.strip():
            *full, held = _split(held, window)
            for piece in full:
                yield Piece(piece, False)
    last = held.rfind("\n") + 1
    if not held[last:].strip():
        held = held[:last]  # a whitespace-only last line (no newline after it) is a blank line, not text
    if held.strip():
        yield Piece(held.rstrip("\n"), True)


def jsonl_pieces(path: Path, window: int = WINDOW_CHARS, max_line: int = MAX_JSONL_LINE) -> Iterator[Piece]:
    """The "text" field of each line of a .jsonl file, in pieces of at most ``window``; a bad line (or one longer
    than ``max_line`` bytes, found before it is read whole) is one error."""
    with path.open("rb") as handle:
        number = 0
        while True:
            raw = handle.readline(max_line + 1)
            if not raw:
                return
            number += 1
            if len(raw) > max_line and not raw.endswith(b"\n"):
                limit = f"{max_line >> 20} MiB" if max_line >= 2**20 else f"{max_line} bytes"
                raise ConfigError(f"{path}:{number}: a JSONL record longer than {limit} (JSON is read whole); give "
                                  "such a document as a .txt file, which is read in pieces")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                  "convert the file to UTF-8") from None
            if not line.strip():
                continue
            text = _record_text(path, number, line)
            if not text.strip():
                continue
            yield from _document(text, window)


def _record_text(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}, column {exc.colno}); each line must be one "
                          "JSON object with a \"text\" field") from None
    except RecursionError:
        raise ConfigError(f"{path}:{number}: JSON nested too deeply; each line must be one JSON object like "
                          "{\"text\": \"...\"}") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        got = "no \"text\" field" if not isinstance(record, dict) or "text" not in record else \
            f"\"text\" is {type(text).__name__}, not a string"
        raise ConfigError(f"{path}:{number}: {got}; each line must be a JSON object like {{\"text\": \"...\"}}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate such as "\ud800": the tokenizer cannot take it
        raise ConfigError(f"{path}:{number}: \"text\" is not valid Unicode text ({exc.reason} at character "
                          f"{exc.start}); remove or fix the escaped surrogate") from None
    return text


def pieces(path: Path, window: int = WINDOW_CHARS) -> Iterator[Piece]:
    """The non-blank documents of one input file, in pieces of at most ``window`` characters."""
    return jsonl_pieces(path, window) if path.suffix == ".jsonl" else text_pieces(path, window)


def documents(path: Path) -> Iterator[str]:
    """The whole documents of one file (pieces joined: unbounded; for reading back small files)."""
    held: list[str] = []
    for piece in pieces(path):
        held.append(piece.text)
        if piece.last:
            yield "".join(held)
            held = []


__all__ = ["MAX_JSONL_LINE", "Piece", "WINDOW_CHARS", "documents", "jsonl_pieces", "pieces", "text_pieces"]
