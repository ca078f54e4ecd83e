"""``hal data prepare``'s library: text and JSONL documents -> one token file (``parallel.data.token_file``).

Why here and not in the trainer: tokenizing is done once, ahead of training, so that ranks only
memory-map ids. Inputs:

- ``.txt``: documents separated by one or more blank lines (a file without blank lines is one
  document); the lines of a document keep their newlines.
- ``.jsonl``: one JSON object per line, the document in its ``"text"`` field (blank lines skipped).

Whitespace-only documents are skipped. Each document is encoded with the Hugging Face ``tokenizers``
library (no special tokens added) and followed by the end-of-document id. ``PREFIX.bin`` (uint16
when the vocabulary is under 65536 ids, else uint32, little-endian) and ``PREFIX.idx.json`` are
written to temporary files beside them and renamed at the end, so an interrupted or failing run
leaves nothing half-written.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import numpy as np

from hal.errors import ConfigError, HalError
from hal.run_dirs import check_creatable_file, read_limited

from hal.parallel.data.token_file import DTYPES, INDEX_FORMAT, index_path

EOD_CANDIDATES: tuple[str, ...] = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
BATCH_DOCUMENTS = 512  # documents per encode_batch call (the tokenizer's threads work on a batch)
INPUT_KINDS = (".txt", ".jsonl")


@dataclass
class Progress:
    """Counts so far, handed to the caller's progress callback after every batch."""

    files_done: int
    files: int
    documents: int
    tokens: int


MAX_TOKENIZER_BYTES = 128 * 2**20  # published tokenizer.json files are tens of MB at most (Gemma 3's: 33 MB)


def load_tokenizer(path: str | Path) -> Any:
    """``tokenizers.Tokenizer`` from a tokenizer.json; one line if the package or the file is missing or bad."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise HalError("hal data prepare needs the 'tokenizers' package, which is not installed; "
                       "pip install 'hetero-hal[data]' (or pip install tokenizers)") from None
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--tokenizer {p}: no such file; give a Hugging Face tokenizer.json")
    raw = read_limited(p, MAX_TOKENIZER_BYTES, f"--tokenizer {p}", "give the model's Hugging Face tokenizer.json")
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the Rust side raises plain Exception for a malformed file; UnicodeDecodeError too
        raise ConfigError(f"--tokenizer {p}: not a Hugging Face tokenizer.json ({str(exc).splitlines()[0]})") from None


def _config_eos(tokenizer_path: Path) -> str | None:
    """``eos_token`` of a tokenizer_config.json beside the tokenizer, if any (how Hugging Face names it)."""
    config = tokenizer_path.parent / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def end_of_document(tokenizer: Any, tokenizer_path: str | Path, eod: str | None) -> int:
    """The separator id: ``--eod``'s token, else the tokenizer's eos (its config, then common names)."""
    if eod is not None:
        found = tokenizer.token_to_id(eod)
        if found is None:
            raise ConfigError(f"--eod {eod!r} is not a token of {tokenizer_path}; give one of its tokens, e.g. its "
                              "end-of-text special token")
        return int(found)
    for name in (_config_eos(Path(tokenizer_path)), *EOD_CANDIDATES):
        if name is not None and tokenizer.token_to_id(name) is not None:
            return int(tokenizer.token_to_id(name))
    raise ConfigError(f"{tokenizer_path} has no end-of-document token ({', '.join(EOD_CANDIDATES)}); "
                      "name the one to put after every document with --eod TOKEN")


def check_inputs(files: Sequence[str | Path]) -> list[Path]:
    """Every input exists and is a .txt or .jsonl file — checked before anything is read or written."""
    if not files:
        raise ConfigError("no input files; give .txt or .jsonl files to tokenize")
    paths = [Path(f) for f in files]
    for p in paths:
        if p.exists() and not p.is_file():
            raise ConfigError(f"{p}: is not a regular file (a directory, pipe or device); give .txt or .jsonl files")
        if not p.is_file():
            raise ConfigError(f"{p}: no such file")
        if p.suffix not in INPUT_KINDS:
            raise ConfigError(f"{p}: unknown kind of input {p.suffix or '(no extension)'!r}; give .txt (documents "
                              "separated by a blank line) or .jsonl (one {\"text\": ...} object per line)")
    return paths


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file; a decoding error names the line."""
    with path.open("rb") as handle:  # decoded line by line, so that the error names the right line
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8").replace("\r\n", "\n")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                  "convert the file to UTF-8") from None


def _text_documents(path: Path) -> Iterator[str]:
    """Documents of a .txt file: runs of lines between blank lines."""
    lines: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines).rstrip("\n")
            lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _jsonl_documents(path: Path) -> Iterator[str]:
    """The "text" field of each line of a .jsonl file; a bad line is one error naming file and line."""
    for number, line in _lines(path):
        if not line.strip():
            continue
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
        yield text


def documents(path: Path) -> Iterator[str]:
    """The non-blank documents of one input file."""
    source = _jsonl_documents(path) if path.suffix == ".jsonl" else _text_documents(path)
    return (text for text in source if text.strip())


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dtype_for(vocab_size: int) -> str:
    """uint16 when every id fits (vocabulary under 65536), else uint32."""
    return "uint16" if vocab_size < 2**16 else "uint32"


def _encode_file(path: Path, tokenizer: Any, eod: int, dtype: str, out: BinaryIO, progress: Progress,
                 report: Callable[[Progress], None]) -> tuple[int, int]:
    """Append one file's documents (each + eod) to ``out``; its (documents, tokens)."""
    docs = tokens = 0
    for batch in _batches(documents(path), BATCH_DOCUMENTS):
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        ids = [i for enc in encodings for i in (*enc.ids, eod)]
        np.asarray(ids, dtype=DTYPES[dtype]).tofile(out)
        docs, tokens = docs + len(batch), tokens + len(ids)
        progress.documents, progress.tokens = progress.documents + len(batch), progress.tokens + len(ids)
        report(progress)
    return docs, tokens


def _remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def prepare_tokens(files: Sequence[str | Path], tokenizer_path: str | Path, prefix: str | Path, *, eod: str | None = None,
                   report: Callable[[Progress], None] = lambda progress: None) -> dict[str, Any]:
    """Tokenize ``files`` into ``PREFIX.bin`` + ``PREFIX.idx.json`` (both renamed into place at the end).

    Returns the index plus where it went and how fast it was (``seconds``, ``input_bytes``, ``mb_per_s``,
    ``tokens_per_s``: timings are the run's, never written into the index, which describes the data only).
    """
    started = time.perf_counter()
    paths = check_inputs(files)
    tokenizer = load_tokenizer(tokenizer_path)
    eod_id = end_of_document(tokenizer, tokenizer_path, eod)
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    dtype = dtype_for(vocab_size)
    text = str(prefix)
    stem = text[: -len(".bin")] if text.endswith(".bin") else text
    if not stem or stem.endswith(("/", os.sep)) or Path(stem).name in ("", ".", ".."):
        raise ConfigError(f"--out {text!r}: names no file; give a file prefix such as data/train "
                          "(writes data/train.bin and data/train.idx.json)")
    bin_path = Path(stem + ".bin")
    idx_path = index_path(bin_path)
    if not bin_path.parent.is_dir():
        why = (f"{bin_path.parent} is a file, not a directory" if bin_path.parent.exists()
               else f"directory {bin_path.parent} does not exist; create it first")
        raise ConfigError(f"--out {prefix}: {why}")
    for target in (bin_path, idx_path):  # checked now, not at the rename after all the tokenizing
        check_creatable_file(target, "--out")
    tmp_bin = bin_path.with_name(f".{bin_path.name}.tmp-{os.getpid()}")
    tmp_idx = idx_path.with_name(f".{idx_path.name}.tmp-{os.getpid()}")
    progress, sources = Progress(0, len(paths), 0, 0), []
    try:
        with tmp_bin.open("wb") as out:
            for path in paths:
                docs, tokens = _encode_file(path, tokenizer, eod_id, dtype, out, progress, report)
                sources.append({"path": str(path.resolve()), "documents": docs, "tokens": tokens})
                progress.files_done += 1
                report(progress)
        if progress.documents == 0:
            raise ConfigError(f"no documents in {', '.join(map(str, paths))}: every file is empty or blank; "
                              "give files with text")
        index = {"format": INDEX_FORMAT, "dtype": dtype, "tokens": progress.tokens, "documents": progress.documents,
                 "vocab_size": vocab_size, "eod_id": eod_id, "tokenizer_sha256": _sha256(Path(tokenizer_path)),
                 "sources": sources}
        tmp_idx.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        _remove(tmp_bin, tmp_idx)  # nothing left behind on an error or Ctrl-C (after success both are gone already)
    seconds = max(time.perf_counter() - started, 1e-9)
    size = sum(path.stat().st_size for path in paths)
    return {**index, "bin": str(bin_path), "index": str(idx_path), "seconds": seconds, "input_bytes": size,
            "mb_per_s": size / 1e6 / seconds, "tokens_per_s": progress.tokens / seconds}


__all__ = ["EOD_CANDIDATES", "Progress", "check_inputs", "documents", "dtype_for", "end_of_document", "load_tokenizer",
           "prepare_tokens"]
