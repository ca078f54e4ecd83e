"""A Hugging Face ``tokenizer.json``, read and checked the same way wherever hal takes one (data prepare, export).

Why one place: ``hal data prepare`` tokenizes with it and ``hal export`` ships it beside the weights; both must
refuse, in one line, a file that is not a tokenizer (random bytes, a truncated download, something too large to
be one) before anything is written, and export must also refuse one whose ids do not fit the model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hal.errors import ConfigError, HalError
from hal.run_dirs import read_limited

MAX_TOKENIZER_BYTES = 128 * 2**20  # published tokenizer.json files are tens of MB at most (Gemma 3's: 33 MB)
FIX = "give the model's Hugging Face tokenizer.json"


def load_tokenizer(path: str | Path, what: str, needed_by: str = "hal data prepare") -> Any:
    """``tokenizers.Tokenizer`` from a tokenizer.json; one line if the package or the file is missing or bad.
    ``what`` names the file in messages (``--tokenizer PATH``)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise HalError(f"{needed_by} needs the 'tokenizers' package, which is not installed; "
                       "pip install 'hetero-hal[data]' (or pip install tokenizers)") from None
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what}: no such file; give a Hugging Face tokenizer.json")
    raw = read_limited(p, MAX_TOKENIZER_BYTES, what, FIX)
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the Rust side raises plain Exception for a malformed file; UnicodeDecodeError too
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{what}: not a Hugging Face tokenizer.json ({first}); {FIX}") from None


def token_count(tokenizer: Any) -> int:
    """Ids the tokenizer can produce: its vocabulary with the added (special) tokens."""
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def highest_id(tokenizer: Any) -> int:
    """The largest id the tokenizer can produce (added tokens may sit above a gap in the vocabulary)."""
    ids = list(tokenizer.get_vocab(with_added_tokens=True).values())
    return max(ids) if ids else -1


__all__ = ["MAX_TOKENIZER_BYTES", "highest_id", "load_tokenizer", "token_count"]
