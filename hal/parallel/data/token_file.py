"""Token files: a flat little-endian array of token ids on disk, read through ``numpy.memmap``.

Why a flat array: a training row is any window of ``seq + 1`` consecutive ids, so the file needs no
structure beyond its dtype — documents are already separated by an end-of-document id. Two kinds
are read:

- hal's own (``hal data prepare``): ``PREFIX.bin`` with ``PREFIX.idx.json`` beside it (``format``,
  ``dtype`` uint16 | uint32, ``tokens``, ``documents``, ``vocab_size``, ``eod_id``, ...);
- a plain nanoGPT-style ``.bin`` without an index: uint16 ids.

The file is never loaded whole: one memmap per process (cached), windows are gathered by fancy
indexing, and the vocabulary check scans it in chunks. ``train.validation`` holds out the last
fraction of the tokens; training windows never reach into it.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hal.errors import ConfigError

INDEX_FORMAT = 1
DTYPES: dict[str, str] = {"uint16": "<u2", "uint32": "<u4"}  # index name -> little-endian numpy dtype
SCAN_CHUNK = 1 << 24  # ids per chunk when scanning the whole file (32-64 MiB of memory at most)


def is_token_file(source: str) -> bool:
    """``train.data`` names a token file (rather than a built-in source) when it ends in ``.bin``."""
    return source.endswith(".bin")


def index_path(path: str | Path) -> Path:
    """``PREFIX.bin`` -> ``PREFIX.idx.json`` (the index ``hal data prepare`` writes beside it)."""
    text = str(path)
    return Path((text[: -len(".bin")] if text.endswith(".bin") else text) + ".idx.json")


@dataclass(frozen=True)
class TokenFileInfo:
    """What the file holds, from its index (or its size alone for an index-less uint16 file)."""

    path: str
    dtype: str  # "uint16" | "uint32"
    tokens: int
    index: dict[str, Any] | None  # the parsed PREFIX.idx.json, None for a plain .bin

    def split(self, validation: float) -> int:
        return split_point(self.tokens, validation)


def split_point(tokens: int, validation: float) -> int:
    """The first validation token: the last ``validation`` fraction of ``tokens`` is held out (rounded down)."""
    return tokens - int(tokens * validation)


def _read_index(path: Path, where: str) -> dict[str, Any] | None:
    idx = index_path(path)
    if not idx.is_file():
        return None
    try:
        index = json.loads(idx.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: index {idx} is unreadable ({exc}); run hal data prepare again or remove it "
                          "(then the .bin is read as plain uint16 ids)") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or index.get("dtype") not in DTYPES \
            or not isinstance(index.get("tokens"), int):
        raise ConfigError(f"{where}: index {idx} is not a format-{INDEX_FORMAT} token index (format, dtype uint16|uint32, "
                          "tokens); run hal data prepare again")
    return index


def read_info(path: str | Path, where: str = "train.data") -> TokenFileInfo:
    """The file's dtype and token count, checked against its size and index; one ConfigError line otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{where} {p}: no such token file; make it with hal data prepare, or fix the path "
                          "(a relative path is read from the current directory)")
    index = _read_index(p, f"{where} {p}")
    dtype = str(index["dtype"]) if index else "uint16"
    size, item = p.stat().st_size, np.dtype(DTYPES[dtype]).itemsize
    if size % item:
        raise ConfigError(f"{where} {p}: {size} bytes is not a whole number of {dtype} ids ({item} bytes each); the file "
                          "is truncated or not a token file — prepare it again")
    tokens = size // item
    if index is not None and index["tokens"] != tokens:
        raise ConfigError(f"{where} {p}: its index {index_path(p).name} says {index['tokens']} tokens but the file holds "
                          f"{tokens}; they come from different runs — run hal data prepare again")
    return TokenFileInfo(str(p), dtype, tokens, index)


@functools.lru_cache(maxsize=4)
def open_tokens(path: str) -> np.memmap:
    """The file's ids as a read-only memmap (opened once per process; pages are read on demand)."""
    info = read_info(path)
    return np.memmap(path, dtype=DTYPES[info.dtype], mode="r", shape=(info.tokens,))


def max_token(path: str) -> tuple[int, int]:
    """The largest id in the file and its first position, scanned in chunks (the file is never loaded whole)."""
    ids = open_tokens(path)
    best, where = -1, -1
    for start in range(0, len(ids), SCAN_CHUNK):
        chunk = np.asarray(ids[start:start + SCAN_CHUNK])
        top = int(chunk.max())
        if top > best:
            best, where = top, start + int(chunk.argmax())
    return best, where


def check_token_file(path: str, *, seq_len: int, vocab_size: int, validation: float, where: str) -> TokenFileInfo:
    """Everything training will assume about the file, before any process starts; one ConfigError line per problem."""
    info = read_info(path, where)
    top, position = max_token(path) if info.tokens else (-1, -1)
    if top >= vocab_size:
        made = info.index.get("vocab_size") if info.index else None
        fix = f"set model.vocab_size: {made}" if isinstance(made, int) and made > top else f"raise model.vocab_size above {top}"
        raise ConfigError(f"{where} {path}: token id {top} (at position {position}) is not below model.vocab_size {vocab_size}; "
                          f"{fix}, or prepare the file with the model's tokenizer")
    split, window = info.split(validation), seq_len + 1
    if split < window:
        raise ConfigError(f"{where} {path}: the training part holds {split} tokens, fewer than one row of {window} "
                          f"(seq_len + 1); use a bigger file, lower seq_len{' or train.validation' if validation else ''}")
    if validation and info.tokens - split < window:
        raise ConfigError(f"{where} {path}: train.validation {validation} holds out {info.tokens - split} tokens, fewer than "
                          f"one row of {window}; raise validation or lower seq_len")
    return info


def windows(path: str, generator: torch.Generator, rows: int, seq_len: int, first: int, end: int) -> torch.Tensor:
    """``rows`` windows of ``seq_len + 1`` ids at offsets drawn from ``generator``, all inside ``[first, end)``."""
    ids = open_tokens(path)
    starts = first + torch.randint(0, end - first - seq_len, (rows,), generator=generator).numpy()
    picked = ids[starts[:, None] + np.arange(seq_len + 1)]  # fancy indexing reads only these pages
    return torch.from_numpy(picked.astype(np.int64))


__all__ = ["DTYPES", "INDEX_FORMAT", "TokenFileInfo", "check_token_file", "index_path", "is_token_file", "max_token",
           "open_tokens", "read_info", "split_point", "windows"]
