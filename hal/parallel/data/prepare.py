"""``hal data prepare``'s library: text and JSONL documents -> one token file (``parallel.data.token_file``).

Why here and not in the trainer: tokenizing is done once, ahead of training, so that ranks only
memory-map ids. The inputs are read by ``parallel.data.documents`` in pieces of bounded size (a long document
is tokenized piece by piece, counted in the index's ``split_documents``), and pieces go to the tokenizer in
batches bounded in count and characters, so memory stays bounded whatever the input.

Each document is encoded with the Hugging Face ``tokenizers`` library (no special tokens added) and followed by
the end-of-document id. ``PREFIX.bin`` (uint16 when the vocabulary is under 65536 ids, else uint32,
little-endian) and ``PREFIX.idx.json`` are written unnamed (``hal.pending_file``) and named only when complete,
so a failing, interrupted or killed run leaves nothing behind, and a full disk is one line.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from hal.errors import ConfigError, HalError
from hal.parallel.data.documents import WINDOW_CHARS, Piece, documents, pieces
from hal.parallel.data.token_file import DTYPES, INDEX_FORMAT, index_path
from hal.parallel.data.tokenizer_file import MAX_TOKENIZER_BYTES, token_count
from hal.parallel.data.tokenizer_file import load_tokenizer as load_file
from hal.pending_file import PendingFile
from hal.run_dirs import check_creatable_file

EOD_CANDIDATES: tuple[str, ...] = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
BATCH_DOCUMENTS = 512  # pieces per encode_batch call (the tokenizer's threads work on a batch)
BATCH_CHARS = 4 * WINDOW_CHARS  # characters per encode_batch call: what bounds the tokenizer's memory
INPUT_KINDS = (".txt", ".jsonl")


@dataclass
class Progress:
    """Counts so far, handed to the caller's progress callback after every batch."""

    files_done: int
    files: int
    documents: int
    tokens: int


def load_tokenizer(path: str | Path) -> Any:
    """``tokenizers.Tokenizer`` from ``--tokenizer PATH``; one line if the package or the file is missing or bad."""
    return load_file(path, f"--tokenizer {Path(path)}")


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


def _batches(items: Iterator[Piece], count: int, chars: int) -> Iterator[list[Piece]]:
    """Pieces in batches of at most ``count`` pieces and about ``chars`` characters (one piece may pass it)."""
    batch: list[Piece] = []
    size = 0
    for item in items:
        if batch and (len(batch) == count or size + len(item.text) > chars):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += len(item.text)
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


def _read_ahead(batches: Iterator[list[Piece]], depth: int = 2) -> Iterator[list[Piece]]:
    """``batches``, read by a thread of their own up to ``depth`` ahead: the next batch is read and split while the
    tokenizer (which releases the GIL) encodes this one. Memory: at most ``depth`` + 1 batches. An error of the
    reading (a bad line) comes out here, in order, after the batches before it."""
    import queue
    import threading

    ahead: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def read() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        ahead.put(("batch", batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ahead.put(("end", None))
        except BaseException as exc:  # handed to the consumer, raised there
            ahead.put(("error", exc))

    reader = threading.Thread(target=read, name="hal-data-read", daemon=True)
    reader.start()
    try:
        while True:
            kind, value = ahead.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        while reader.is_alive():  # unblock a reader waiting on a full queue, then let it finish
            try:
                ahead.get_nowait()
            except queue.Empty:
                pass
            reader.join(0.05)


@dataclass
class _Counts:
    documents: int = 0
    tokens: int = 0
    split: int = 0  # documents longer than the window, tokenized in pieces


def _encode_file(path: Path, tokenizer: Any, eod: int, dtype: str, out: PendingFile, progress: Progress,
                 report: Callable[[Progress], None], window: int) -> _Counts:
    """Append one file's documents (each + eod) to ``out``; its counts."""
    counts = _Counts()
    open_piece = False  # the previous piece did not end its document
    # The same ids without the character offsets nobody reads here (tokenizers >= 0.21): a third faster.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for batch in _read_ahead(_batches(pieces(path, window), BATCH_DOCUMENTS, BATCH_CHARS)):
        try:
            encodings = encode([p.text for p in batch], add_special_tokens=False)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # the Rust side raises plain Exception, or a PanicException (a BaseException)
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise HalError(f"{path}: the tokenizer failed near document {counts.documents + 1} ({first}); nothing "
                           "was written. Check the file's text or use another tokenizer.json") from None
        ids: list[int] = []
        before = counts.documents
        for piece, encoding in zip(batch, encodings):
            ids += encoding.ids
            if piece.last:
                ids.append(eod)
                counts.documents += 1
                counts.split += open_piece
            open_piece = not piece.last
        out.write(np.asarray(ids, dtype=DTYPES[dtype]).tobytes())
        counts.tokens += len(ids)
        progress.documents += counts.documents - before
        progress.tokens += len(ids)
        report(progress)
    return counts


def prepare_tokens(files: Sequence[str | Path], tokenizer_path: str | Path, prefix: str | Path, *, eod: str | None = None,
                   report: Callable[[Progress], None] = lambda progress: None,
                   window: int = WINDOW_CHARS) -> dict[str, Any]:
    """Tokenize ``files`` into ``PREFIX.bin`` + ``PREFIX.idx.json`` (both named only when complete).

    Returns the index plus where it went and how fast it was (``seconds``, ``input_bytes``, ``mb_per_s``,
    ``tokens_per_s``: timings are the run's, never written into the index, which describes the data only).
    """
    started = time.perf_counter()
    paths = check_inputs(files)
    tokenizer = load_tokenizer(tokenizer_path)
    eod_id = end_of_document(tokenizer, tokenizer_path, eod)
    vocab_size = token_count(tokenizer)
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
    progress, sources, split = Progress(0, len(paths), 0, 0), [], 0
    with PendingFile(bin_path, "--out") as out:
        for path in paths:
            counts = _encode_file(path, tokenizer, eod_id, dtype, out, progress, report, window)
            sources.append({"path": str(path.resolve()), "documents": counts.documents, "tokens": counts.tokens})
            split += counts.split
            progress.files_done += 1
            report(progress)
        if progress.documents == 0:
            raise ConfigError(f"no documents in {', '.join(map(str, paths))}: every file is empty or blank; "
                              "give files with text")
        index = {"format": INDEX_FORMAT, "dtype": dtype, "tokens": progress.tokens, "documents": progress.documents,
                 "vocab_size": vocab_size, "eod_id": eod_id, "tokenizer_sha256": _sha256(Path(tokenizer_path)),
                 "window_chars": window, "split_documents": split, "sources": sources}
        with PendingFile(idx_path, "--out") as idx:
            idx.write((json.dumps(index, indent=2) + "\n").encode("utf-8"))
            idx.sync()
            out.commit()
            try:
                idx.commit()
            except BaseException:
                bin_path.unlink(missing_ok=True)  # the pair or nothing
                raise
    seconds = max(time.perf_counter() - started, 1e-9)
    size = sum(path.stat().st_size for path in paths)
    return {**index, "bin": str(bin_path), "index": str(idx_path), "seconds": seconds, "input_bytes": size,
            "mb_per_s": size / 1e6 / seconds, "tokens_per_s": progress.tokens / seconds}


__all__ = ["EOD_CANDIDATES", "MAX_TOKENIZER_BYTES", "Progress", "check_inputs", "documents", "dtype_for", "end_of_document", "load_tokenizer",
           "prepare_tokens"]
