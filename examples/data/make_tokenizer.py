"""Regenerate examples/data/tokenizer.json: a small byte-level BPE tokenizer trained on the shipped text.

Why it ships: the tiny example (examples/tiny_cpu.yaml) trains on real subword tokens without
downloading anything. Byte-level (GPT-2 style): every byte is in the base alphabet, so any UTF-8
text encodes and decodes back to itself; ``<|endoftext|>`` (id 0) is the end-of-document token that
``hal data prepare`` puts after every document. Training is deterministic for a given ``tokenizers``
version: the same corpus gives the same file.

    python3 examples/data/make_tokenizer.py            # rewrites examples/data/tokenizer.json
    python3 examples/data/make_tokenizer.py --out F    # writes F instead

Needs the ``tokenizers`` package (``pip install 'hetero-hal[data]'``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
TEXTS = (HERE / "corpus.txt", HERE / "ledger.txt")  # 55 KB of English prose written for this repository
OUT = HERE / "tokenizer.json"
VOCAB_SIZE = 1024  # 256 bytes + 1 special token + 767 merges (the texts support about 2100 at most)
EOD = "<|endoftext|>"


def build_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:  # the trainer stops early when the text runs out of pairs
        raise SystemExit(f"make_tokenizer: the text supports only {tokenizer.get_vocab_size()} tokens, not "
                         f"{vocab_size}; lower VOCAB_SIZE or add text")
    return tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the shipped byte-level BPE tokenizer on examples/data/corpus.txt and ledger.txt.")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write tokenizer.json (default {OUT})")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer([path.read_text(encoding="utf-8") for path in TEXTS])
    args.out.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    print(f"make_tokenizer: {args.out}: {tokenizer.get_vocab_size()} tokens, end of document {EOD!r} "
          f"(id {tokenizer.token_to_id(EOD)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
