"""Training data as a pure function of (seed, step): every rank builds the same global batch.

A step's batch is ``(micro_batches, micro_batch_size, seq + 1)`` token ids (inputs are ``[..., :-1]``,
labels ``[..., 1:]``). Every rank of every stage calls ``global_batch`` with the same arguments and
gets the same tensor; the engine then slices its own rows. Nothing is sent between ranks, nothing is
read twice from disk, and resuming at step ``s`` needs only ``s`` — the "data position" a checkpoint
records is the step itself.

Sources (``train.data``):

- ``corpus``: byte-level tokens (ids 0..255) of ``examples/data/corpus.txt``, shipped with the
  repository (nothing is downloaded). Each row is a window of ``seq + 1`` bytes at an offset drawn
  from (seed, step).
- ``synthetic``: uniformly random ids in ``[0, vocab_size)`` from (seed, step).
- a token file, any path ending in ``.bin`` (``hal data prepare``'s, or a plain nanoGPT-style uint16
  file; ``parallel.data.token_file``): each row is a window of ``seq + 1`` ids at an offset drawn from
  (seed, step) inside the training part — the file less its last ``validation`` fraction, from which
  ``validation_batch`` draws its windows (seeded by ``-1 - k``, never a training step's seed).

The batch depends on the global batch size (rows per step) and not on how the rows are grouped into
micro-batches, so two plans with the same ``micro_batches × micro_batch_size`` see the same data.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from hal.errors import ConfigError
from hal.parallel.data.token_file import is_token_file, open_tokens, split_point, windows

CORPUS_PATH = Path(__file__).resolve().parents[3] / "examples" / "data" / "corpus.txt"


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step), independent of everything else in the run."""
    digest = hashlib.sha256(f"data/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@functools.lru_cache(maxsize=2)
def load_corpus(path: str = str(CORPUS_PATH)) -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of its bytes (read once per process)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"train.data 'corpus': {p} is missing; it ships with the repository — restore it or use data: synthetic")
    return torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)


def check_corpus(seq_len: int, path: str = str(CORPUS_PATH)) -> None:
    """The corpus must hold at least one window of ``seq_len + 1`` bytes."""
    size = load_corpus(path).numel()
    if size < seq_len + 1:
        raise ConfigError(f"train.data 'corpus': {path} has {size} bytes, fewer than one row of {seq_len + 1}; lower seq_len")


def global_batch(source: str, seed: int, step: int, micro_batches: int, micro_batch_size: int, seq_len: int,
                 vocab_size: int, validation: float = 0.0) -> torch.Tensor:
    """Step ``step``'s token ids, shape (micro_batches, micro_batch_size, seq_len + 1), int64 on the host."""
    rows = micro_batches * micro_batch_size
    generator = torch.Generator().manual_seed(step_seed(seed, step))
    if is_token_file(source):
        flat = windows(source, generator, rows, seq_len, 0, split_point(len(open_tokens(source)), validation))
    elif source == "synthetic":
        flat = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=generator)
    elif source == "corpus":
        corpus = load_corpus()
        starts = torch.randint(0, corpus.numel() - seq_len, (rows,), generator=generator)
        flat = corpus[starts.unsqueeze(1) + torch.arange(seq_len + 1)].long()
    else:
        raise ConfigError(f"train.data {source!r} is unknown; use corpus, synthetic or a token file ending in .bin")
    return flat.view(micro_batches, micro_batch_size, seq_len + 1)


def validation_batch(source: str, seed: int, index: int, rows: int, seq_len: int, validation: float) -> torch.Tensor:
    """Validation batch ``index`` (0, 1, ...) of a token file: ``rows`` windows of ``seq_len + 1`` ids, shape
    (rows, seq_len + 1), drawn from the held-out end of the file with seed (seed, -1 - index) — never a step's."""
    if not is_token_file(source) or validation <= 0:
        raise ConfigError(f"validation batches need train.data to be a token file and train.validation > 0 "
                          f"(got data {source!r}, validation {validation})")
    tokens = len(open_tokens(source))
    generator = torch.Generator().manual_seed(step_seed(seed, -1 - index))
    return windows(source, generator, rows, seq_len, split_point(tokens, validation), tokens)


__all__ = ["CORPUS_PATH", "check_corpus", "global_batch", "load_corpus", "step_seed", "validation_batch"]
