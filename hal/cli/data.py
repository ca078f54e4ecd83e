"""``hal data prepare``: tokenize text and JSONL files into a token file that ``train.data`` reads.

The library is ``hal.parallel.data.prepare`` (imported only when the command runs, so ``hal --help``
stays fast and ``tokenizers`` stays optional). Progress goes to stderr, the result to stdout; bad
input is a HalError, which ``hal``'s main prints as one line and exit 2, with nothing written.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

NAME = "data"
PROGRESS_EVERY_S = 2.0  # short inputs print no progress at all


def add_parser(sub: Any) -> None:
    """Add ``data`` (with ``prepare``) to hal's sub-command parsers."""
    p = sub.add_parser(NAME, help="prepare training data: tokenize text into a token file for train.data",
                       description="Training data tools. 'prepare' turns .txt and .jsonl files into PREFIX.bin (token ids) "
                       "and PREFIX.idx.json; set train.data: PREFIX.bin to train on it.")
    inner = p.add_subparsers(dest="data_command", metavar="{prepare}", parser_class=type(p))
    inner.required = True
    r = inner.add_parser(
        "prepare",
        help="tokenize .txt / .jsonl files into PREFIX.bin + PREFIX.idx.json",
        description="Tokenize FILEs with a Hugging Face tokenizer.json and write PREFIX.bin, a flat little-endian array of "
        "token ids (uint16 when the vocabulary has under 65536 ids, else uint32; numpy.memmap-able), with the "
        "end-of-document id after every document, and PREFIX.idx.json (dtype, tokens, documents, vocab_size, eod_id, "
        "tokenizer sha256, sources). A .txt file holds documents separated by blank lines; a .jsonl file holds one "
        "JSON object per line with the document in \"text\". Memory stays bounded: a document longer than 256 Ki "
        "characters is tokenized in pieces cut at whitespace (counted as split_documents). Both files get their "
        "names only when complete: a failed or killed run leaves nothing. "
        "Needs the 'tokenizers' package (pip install 'hetero-hal[data]').",
    )
    r.add_argument("files", nargs="+", metavar="FILE", help=".txt or .jsonl input files")
    r.add_argument("--tokenizer", required=True, metavar="PATH", help="a Hugging Face tokenizer.json")
    r.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx.json")
    r.add_argument("--eod", metavar="TOKEN",
                   help="the token put after every document (default: the tokenizer's eos, </s> or <|endoftext|>)")
    r.add_argument("--json", action="store_true", help="print the index as JSON on stdout")
    r.set_defaults(func=run)


class _Reporter:
    """Throttled progress on stderr: in place on a terminal, one line per report otherwise."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()
        self.shown = False

    def __call__(self, progress: Any) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last, self.shown = now, True
        line = (f"hal data prepare: {progress.files_done}/{progress.files} files, {progress.documents:,} documents, "
                f"{progress.tokens:,} tokens, {now - self.started:.0f} s")
        print(f"\r{line}" if sys.stderr.isatty() else line, end="" if sys.stderr.isatty() else "\n",
              file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.shown and sys.stderr.isatty():
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from hal.parallel.data.prepare import prepare_tokens

    reporter = _Reporter()
    try:
        index = prepare_tokens(args.files, args.tokenizer, args.out, eod=args.eod, report=reporter)
    finally:
        reporter.finish()
    if index["split_documents"]:
        print(f"hal data prepare: {index['split_documents']:,} document(s) longer than {index['window_chars']:,} "
              "characters were tokenized in pieces of at most that, cut at whitespace (the tokens at a cut may differ "
              "from tokenizing the document whole)", file=sys.stderr)
    if args.json:
        print(json.dumps(index, indent=2))
    else:
        print(f"hal data prepare: {index['bin']}: {index['tokens']:,} tokens ({index['dtype']}), {index['documents']:,} "
              f"documents, vocab {index['vocab_size']}, eod id {index['eod_id']}; index {index['index']}; "
              f"{index['input_bytes'] / 1e6:.1f} MB in {index['seconds']:.1f} s ({index['mb_per_s']:.1f} MB/s, "
              f"{index['tokens_per_s']:,.0f} tokens/s)")
    return 0
