"""The documents of ``hal data prepare``'s inputs, read in pieces of bounded size.

Why pieces: a tokenizer holds about 200 bytes of memory per byte of the text it encodes at once, and a plain-text
file without blank lines is one document however large it is. So no more than ``window`` characters of a document
are ever handed over at once: a longer document comes as several pieces, cut at the last whitespace inside the
window (a word is never cut unless it is longer than the window), and only the last piece ends the document. A
document within the window is one piece, exactly as before; a longer one is tokenized piece by piece (the tokens
at each cut may differ from tokenizing it whole), which ``hal data prepare`` counts and says.

Inputs:

- ``.txt``: documents separated by one or more blank lines; the lines of a document keep their newlines (the
  document's trailing newlines are dropped). A line is read at most ``window`` characters at a time; whitespace
  before a document's first text in such a long line is dropped.
- ``.jsonl``: one JSON object per line, the document in its ``"text"`` field (blank lines skipped); a line may
  hold at most ``MAX_JSONL_LINE`` bytes (JSON is parsed whole).

Whitespace-only documents are skipped. A decoding or format error is one ``ConfigError`` naming file and line.
"""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hal.errors import ConfigError

WINDOW_CHARS = 1 << 18  # 256 Ki characters of one document at a time: ~50 MB of tokenizer memory, far above a web page
MAX_JSONL_LINE = 64 * 2**20  # bytes of one JSONL record (parsed whole: ~5x that in memory)
_WHITESPACE = (" ", "\n", "\t")


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
    """Bounded reads of one UTF-8 file: ``window`` characters of a line at most; a decoding error names the line."""

    def __init__(self, path: Path, window: int) -> None:
        self.path, self.window = path, window
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.line = 0  # lines completed so far
        self.carry = ""  # a "\r" at the end of a chunk, waiting to see whether "\n" follows

    def chunks(self) -> Iterator[tuple[str, bool, bool]]:
        """(text, starts a line, ends a line); "\\r\\n" read as "\\n"."""
        starts, offset = True, 0  # offset: bytes of the current line already read
        with self.path.open("rb") as handle:
            while True:
                raw = handle.readline(self.window)  # at most window bytes, so at most window characters
                if not raw:
                    break
                ends = raw.endswith(b"\n")
                pending = len(self.decoder.getstate()[0])  # bytes of a character split by the previous read
                try:
                    text = self.carry + self.decoder.decode(raw)
                except UnicodeDecodeError as exc:
                    at = max(0, offset - pending + exc.start)
                    raise ConfigError(f"{self.path}:{self.line + 1}: not UTF-8 text ({exc.reason} at byte {at}); "
                                      "convert the file to UTF-8") from None
                self.carry = ""
                if not ends and text.endswith("\r"):
                    text, self.carry = text[:-1], "\r"
                yield text.replace("\r\n", "\n"), starts, ends
                if ends:
                    self.line += 1
                starts, offset = ends, 0 if ends else offset + len(raw)
        try:
            tail = self.carry + self.decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{self.path}:{self.line + 1}: not UTF-8 text ({exc.reason}: the file ends inside a "
                              "character); convert the file to UTF-8") from None
        if tail:
            yield tail, False, True


def text_pieces(path: Path, window: int = WINDOW_CHARS) -> Iterator[Piece]:
    """The documents of a .txt file (runs of lines between blank lines), in pieces of at most ``window``."""
    held = ""  # the open document's text not yet handed out (under the window)
    for text, starts, ends in _TextReader(path, window).chunks():
        if starts and ends and not text.strip():  # a blank line: the open document ends
            if held:
                yield Piece(held.rstrip("\n"), True)
                held = ""
            continue
        if not held and not text.strip():
            continue  # whitespace of a long line before any text
        held += text
        if len(held) > window:
            *full, held = _split(held, window)
            for piece in full:
                yield Piece(piece, False)
    if held:
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
            *pieces, rest = _split(text, window)
            for piece in pieces:
                yield Piece(piece, False)
            yield Piece(rest, True)


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
